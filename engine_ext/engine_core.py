"""EngineCore patch: an all-throttled engine waits instead of spinning.

Upstream ``EngineCoreProc._process_engine_step`` sleeps 1 ms and loops when a
step executed no model while requests exist, so an engine whose requests are
all throttled runs an empty ``schedule()`` every millisecond. With an
output-rate scheduler, such a step is followed by a blocking wait on the
engine's input queue for ``scheduler.output_rate_wait_s()`` (at most 50 ms,
less when a user's budget returns sooner). New requests and aborts arrive on
that queue, and limit updates from the control plane put a ``WAKEUP`` item on
it (vLLM's own no-op message), so all three end the wait at once. The
scheduler itself never sleeps.

Only engines whose scheduler is an output-rate scheduler are affected; with
upstream's scheduler both patched methods fall through to the originals.
Upstream's 1 ms sleep still runs before the wait: it is part of the original
step, and 1 ms on top of a wait of up to 50 ms does not change the bound.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

from engine_ext import vllm_compat

# A child of the "vllm" logger, so messages go through vLLM's own log configuration.
logger = logging.getLogger("vllm.output_rate." + __name__)


def is_output_rate_scheduler(scheduler: object) -> bool:
    from engine_ext.scheduler import OutputRateMixin

    return isinstance(scheduler, OutputRateMixin)


def wait_for_input(engine: Any, timeout_s: float) -> bool:
    """Block on the engine's input queue and handle what arrives. True if woken."""
    if timeout_s <= 0 or vllm_compat.has_deferred_engine_inputs(engine):
        # Inputs deferred during the step come before anything still queued: the busy
        # loop's next _process_input_queue() handles them first (vLLM 0.34).
        return False
    try:
        item = vllm_compat.engine_input_queue(engine).get(timeout=timeout_s)
    except queue.Empty:
        return False
    # The rest of the queue is drained by the busy loop's next
    # _process_input_queue(), exactly as for any other step.
    vllm_compat.handle_engine_input(engine, item)
    return True


def install_wake(engine: Any) -> Callable[[], None] | None:
    """Let another thread (the control-plane client) end the engine's idle wait."""
    from vllm.v1.engine import EngineCoreRequestType

    if not is_output_rate_scheduler(engine.scheduler):
        return None
    input_queue = vllm_compat.engine_input_queue(engine)
    wakeup = (EngineCoreRequestType.WAKEUP, None)

    def wake() -> None:
        input_queue.put_nowait(wakeup)

    logger.info("output-rate: engine idle wait on (throttled steps wait on the input queue)")
    return wake


def connect_control_plane(scheduler: Any, wake: Callable[[], None], rank: int = 0) -> Any:
    """Start the control-plane client of an engine with an endpoint and attach it.

    Called before the engine's busy loop reads its first request, so a
    request is never served before the snapshot is applied, unless the
    control plane does not answer within the snapshot timeout: then the
    engine serves with its command-line limits and takes the snapshot when
    it comes.
    """
    from engine_ext.push_client import PushClient

    config = scheduler.output_rate_config
    client = PushClient(
        endpoints=config.control_plane_endpoints,
        engine_id=config.engine_id_of_rank(rank),
        model=str(scheduler.vllm_config.model_config.served_model_name or ""),
        server_public_key=config.control_plane_public_key,
        wake=wake,
    )
    client.start()
    if not client.wait_for_snapshot(config.snapshot_timeout_s):
        logger.warning(
            "output-rate: control plane %s not reachable within %.1fs; "
            "serving with the limits from the command line until it answers",
            ",".join(config.control_plane_endpoints),
            config.snapshot_timeout_s,
        )
    scheduler.attach_push_client(client)
    return client


def idle_wait_after_step(engine: Any, model_executed: bool) -> None:
    """After a step that ran no model while requests remain, wait for input or budget."""
    scheduler = engine.scheduler
    if model_executed or not is_output_rate_scheduler(scheduler):
        return
    if scheduler.has_requests():
        wait_for_input(engine, scheduler.output_rate_wait_s())


# ---- EngineCoreProc (rows of vllm_compat.PATCHES) ---------------------------


def wrap_run_busy_loop(original: Callable[[Any], None]) -> Callable[[Any], None]:
    # The plugin is first loaded in the engine-core process from inside
    # EngineCore.__init__, too late to wrap __init__ for that instance; the busy
    # loop starts after construction, so the wake hook and the control-plane
    # client are installed there, before the first request is read.
    def run_busy_loop(self: Any) -> None:
        wake = install_wake(self)
        client = None
        if wake is not None and self.scheduler.output_rate_config.control_plane_endpoints:
            # engine_index: the data-parallel rank of this engine core (0 without DP).
            client = connect_control_plane(self.scheduler, wake, vllm_compat.engine_index(self))
        try:
            original(self)
        finally:
            if client is not None:
                client.close()

    return run_busy_loop


def wrap_process_engine_step(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def _process_engine_step(self: Any) -> bool:
        model_executed = original(self)
        idle_wait_after_step(self, model_executed)
        return model_executed

    return _process_engine_step
