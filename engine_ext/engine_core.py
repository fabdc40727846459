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
from typing import Any

# A child of the "vllm" logger, so messages go through vLLM's own log configuration.
logger = logging.getLogger("vllm.output_rate." + __name__)

_PATCHED_ATTR = "_output_rate_patched"


def is_output_rate_scheduler(scheduler: object) -> bool:
    from engine_ext.scheduler import OutputRateMixin

    return isinstance(scheduler, OutputRateMixin)


def wait_for_input(engine: Any, timeout_s: float) -> bool:
    """Block on the engine's input queue and handle what arrives. True if woken."""
    if timeout_s <= 0:
        return False
    try:
        request = engine.input_queue.get(timeout=timeout_s)
    except queue.Empty:
        return False
    # The rest of the queue is drained by the busy loop's next
    # _process_input_queue(), exactly as for any other step.
    engine._handle_client_request(*request)
    return True


def install_wake(engine: Any) -> None:
    """Let another thread (the control-plane client) end the engine's idle wait."""
    from vllm.v1.engine import EngineCoreRequestType

    if not is_output_rate_scheduler(engine.scheduler):
        return
    input_queue = engine.input_queue
    wakeup = (EngineCoreRequestType.WAKEUP, None)
    engine.scheduler.wake_engine = lambda: input_queue.put_nowait(wakeup)
    logger.info("output-rate: engine idle wait on (throttled steps wait on the input queue)")


def idle_wait_after_step(engine: Any, model_executed: bool) -> None:
    """After a step that ran no model while requests remain, wait for input or budget."""
    scheduler = engine.scheduler
    if model_executed or not is_output_rate_scheduler(scheduler):
        return
    if scheduler.has_requests():
        wait_for_input(engine, scheduler.output_rate_wait_s())


def patch_engine_core() -> None:
    """Patch ``EngineCoreProc`` once per process (the plugin may run several times)."""
    from vllm.v1.engine.core import EngineCoreProc

    if getattr(EngineCoreProc, _PATCHED_ATTR, False):
        return
    original_step = EngineCoreProc._process_engine_step
    original_busy_loop = EngineCoreProc.run_busy_loop

    # The plugin is first loaded in the engine-core process from inside
    # EngineCore.__init__, too late to wrap __init__ for that instance; the busy
    # loop starts after construction, so the wake hook is installed there.
    def run_busy_loop(self: Any) -> None:
        install_wake(self)
        original_busy_loop(self)

    def _process_engine_step(self: Any) -> bool:
        model_executed: bool = original_step(self)
        idle_wait_after_step(self, model_executed)
        return model_executed

    EngineCoreProc.run_busy_loop = run_busy_loop
    EngineCoreProc._process_engine_step = _process_engine_step
    setattr(EngineCoreProc, _PATCHED_ATTR, True)
