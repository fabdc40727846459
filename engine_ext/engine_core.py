"""EngineCore patch: an all-throttled engine waits instead of spinning.

Upstream ``EngineCoreProc._process_engine_step`` sleeps 1 ms and loops when a
step executed no model while requests exist, so an engine whose requests are
all throttled runs an empty step every millisecond. With an output-rate
scheduler, such a step is followed by a blocking wait on the input queue for
``scheduler.output_rate_wait_s()`` (at most 50 ms, less when a user's budget
returns sooner). New requests, aborts and limit updates wake it at once; the
scheduler itself never sleeps.
"""

from __future__ import annotations

import queue
from typing import Any

_PATCHED_ATTR = "_output_rate_patched"


def wait_for_input(engine: Any, timeout_s: float) -> bool:
    """Block on the engine's input queue; handle what arrives. True if woken."""
    if timeout_s <= 0:
        return False
    try:
        request = engine.input_queue.get(timeout=timeout_s)
    except queue.Empty:
        return False
    engine._handle_client_request(*request)
    return True


def install_wake(engine: Any) -> None:
    """Let the scheduler (e.g. the control-plane client thread) end an idle wait."""
    from vllm.v1.engine import EngineCoreRequestType

    scheduler = engine.scheduler
    if hasattr(scheduler, "wake_engine"):
        input_queue = engine.input_queue
        scheduler.wake_engine = lambda: input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))


def patch_engine_core() -> None:
    from vllm.v1.engine.core import EngineCoreProc

    if getattr(EngineCoreProc, _PATCHED_ATTR, False):
        return
    original_step = EngineCoreProc._process_engine_step
    original_init = EngineCoreProc.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        install_wake(self)

    def _process_engine_step(self: Any) -> bool:
        model_executed = original_step(self)
        scheduler = self.scheduler
        if (
            not model_executed
            and hasattr(scheduler, "output_rate_wait_s")
            and scheduler.has_requests()
        ):
            wait_for_input(self, scheduler.output_rate_wait_s())
        return model_executed

    EngineCoreProc.__init__ = __init__
    EngineCoreProc._process_engine_step = _process_engine_step
    setattr(EngineCoreProc, _PATCHED_ATTR, True)
