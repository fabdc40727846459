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
import signal
import threading
from collections.abc import Callable
from functools import partial
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

    Called before the engine's busy loop reads its first request, so a request is
    never served before a configuration is in force: the configuration saved by the
    last run (``--output-rate-state-dir``) from the start, then the control plane's
    snapshot. If the control plane does not answer within the snapshot timeout, the
    engine serves with the saved configuration (or, with none saved, its command-line
    limits) and takes the snapshot when it comes.
    """
    from engine_ext.push_client import PushClient
    from engine_ext.saved_state import StateFile, StateWriter

    config = scheduler.output_rate_config
    engine_id = config.engine_id_of_rank(rank)
    state = None if config.state_dir is None else StateFile(config.state_dir, engine_id, "engine")
    client = PushClient(
        endpoints=config.control_plane_endpoints,
        engine_id=engine_id,
        model=str(scheduler.vllm_config.model_config.served_model_name or ""),
        server_public_key=config.control_plane_public_key,
        wake=wake,
        state=None if state is None else StateWriter(state),
        capacity=int(scheduler.vllm_config.scheduler_config.max_num_seqs),
    )
    saved = None if state is None else state.load()
    if saved is not None:
        client.enforce_saved(
            scheduler.output_rate_limiter,
            saved.snapshot,
            saved.fleet,
            scheduler.output_rate_clock_ns(),
        )
    client.start()
    endpoints = ",".join(config.control_plane_endpoints)
    if client.wait_for_snapshot(config.snapshot_timeout_s):
        scheduler.attach_push_client(client)
        return client
    if saved is not None:
        logger.warning(
            "output-rate: control plane %s not reachable within %.1fs; enforcing the "
            "configuration saved at %s (version %d, %d users, fleet of %d) from %s until "
            "it answers",
            endpoints,
            config.snapshot_timeout_s,
            saved.saved_at_text,
            saved.snapshot.version,
            len(saved.snapshot.users),
            saved.snapshot.num_engines,
            state.path if state is not None else "",
        )
    else:
        logger.warning(
            "output-rate: control plane %s not reachable within %.1fs and no saved "
            "configuration for engine %s; serving with the limits from the command line "
            "until it answers",
            endpoints,
            config.snapshot_timeout_s,
            engine_id,
        )
    scheduler.attach_push_client(client)
    return client


def leave_on_signal(engine: Any, client: Any) -> None:
    """With vLLM's default shutdown (``--shutdown-timeout 0``) SIGTERM and SIGINT abort every
    request: the engine serves nothing more from then on, so it leaves the fleet then, in
    the signal handler before vLLM's own (the API server gives it no time to end its loop
    first). With a drain timeout it serves its requests on, and leaves when its loop ends.
    Handlers are the main thread's to set: an engine loop on another thread (tests) leaves
    when its loop ends."""
    if not vllm_compat.aborts_on_shutdown(engine):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)
        if not callable(previous):
            continue

        def handler(num: int, frame: Any, previous: Callable[[int, Any], Any] = previous) -> None:
            client.leave()
            previous(num, frame)

        signal.signal(signum, handler)


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
            self.scheduler.output_rate_publish_stats = partial(
                vllm_compat.publish_scheduler_stats, self
            )
            # engine_index: the data-parallel rank of this engine core (0 without DP).
            client = connect_control_plane(self.scheduler, wake, vllm_compat.engine_index(self))
            leave_on_signal(self, client)
        try:
            original(self)
        finally:
            if client is not None:
                # The loop is over (shutdown, or a fatal error): this engine serves nothing
                # more, so the control plane hands its fleet shares to the others now.
                client.close(leave=True)

    return run_busy_loop


# How long the API server waits for an engine core whose requests it aborts on shutdown
# (vLLM's default --shutdown-timeout 0) before it force-kills it. Upstream gives it no time
# at all (only ROCm a grace): in this window its SIGTERM handler runs and its Leaving goes
# out (leave_on_signal), so the control plane hands its fleet shares to the other engines
# now instead of after the silence of a dead engine (docs/fleet.md). It exits as soon as
# it is done; the API server waits no longer than that.
LEAVING_GRACE_S = 2.0


def wrap_engine_process_shutdown_timeout(
    original: Callable[[float | None, float | None], float | None],
) -> Callable[[float | None, float | None], float | None]:
    def get_engine_process_shutdown_timeout(
        request_timeout: float | None, process_timeout: float | None
    ) -> float | None:
        timeout = original(request_timeout, process_timeout)
        if request_timeout == 0 and timeout == 0:
            return LEAVING_GRACE_S
        return timeout

    return get_engine_process_shutdown_timeout


def wrap_process_engine_step(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def _process_engine_step(self: Any) -> bool:
        model_executed = original(self)
        idle_wait_after_step(self, model_executed)
        return model_executed

    return _process_engine_step
