"""The EngineCore idle-wait patch on vLLM's real ``EngineCoreProc`` methods.

The engine object is a real ``EngineCoreProc`` with the real (patched)
``_process_engine_step``, ``_handle_client_request``, ``add_request`` and
``abort_requests``, a real ``queue.Queue`` as input queue and the real
output-rate scheduler. Only its model executor is replaced (the step function
runs ``schedule()`` and feeds back one hand-made sampled token per request,
like harness/scheduler.py), because building the process needs
ZMQ handshakes with a front end. A real thread plays the front end.
"""

from __future__ import annotations

import collections
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState

from engine_ext import vllm_compat
from engine_ext.engine_core import (
    LEAVING_GRACE_S,
    idle_wait_after_step,
    install_wake,
    leave_on_signal,
)
from engine_ext.plugin import register
from harness.scheduler import make_request, make_scheduler, runner_output

# Bounds far from the expected values, so a loaded machine cannot break them.
LONG_WAIT_S = 30.0
WOKEN_WITHIN_S = 10.0


def make_engine(scheduler: Any) -> Any:
    register()
    engine: Any = object.__new__(EngineCoreProc)
    engine.scheduler = scheduler
    engine.input_queue = queue.Queue()
    engine.output_queue = queue.Queue()
    engine.shutdown_state = EngineShutdownState.RUNNING
    engine.check_for_draft_tokens = False
    engine.async_scheduling = False
    engine.num_model_steps = 0
    # What vLLM 0.34's EngineCoreProc.__init__ also sets (unused attributes before it).
    engine.reject_new_requests = False
    engine._deferred_inputs = collections.deque()

    def step_fn() -> tuple[dict[int, Any], bool]:
        if not scheduler.has_requests():
            return {}, False
        sched_out = scheduler.schedule()
        outputs = scheduler.update_from_output(sched_out, runner_output(scheduler, sched_out))
        model_executed = sched_out.total_num_scheduled_tokens > 0
        engine.num_model_steps += model_executed
        return outputs, model_executed

    engine.step_fn = step_fn
    # What the control-plane client is given to end the engine's idle wait.
    engine.wake = install_wake(engine)
    return engine


@pytest.fixture
def throttled_engine() -> Iterator[Any]:
    """An engine whose only request belongs to a user at 1 token/s."""
    scheduler = make_scheduler(user_rates={"slow": 1})
    engine = make_engine(scheduler)
    request = make_request("slow", max_tokens=100)
    engine._handle_client_request(EngineCoreRequestType.ADD, (request, 0))
    # The first token comes from the user's burst; after it the user is throttled.
    assert engine._process_engine_step() is True
    assert engine._process_engine_step() is False
    yield engine
    scheduler.shutdown()


def later(delay_s: float, action: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay_s), action()))
    thread.start()
    return thread


def test_an_all_throttled_engine_waits_instead_of_spinning(throttled_engine: Any) -> None:
    # Upstream loops every 1 ms here; the patched step waits up to 50 ms.
    num_steps = 0
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        throttled_engine._process_engine_step()
        num_steps += 1
    assert num_steps <= 0.5 / 0.05 + 5, num_steps


def test_a_new_request_ends_the_wait_at_once(throttled_engine: Any) -> None:
    scheduler = throttled_engine.scheduler
    scheduler.output_rate_wait_s = lambda now_ns=None: LONG_WAIT_S  # the only seam
    other = make_request("other", max_tokens=5)
    thread = later(
        0.1, lambda: throttled_engine.input_queue.put((EngineCoreRequestType.ADD, (other, 0)))
    )
    start = time.monotonic()
    assert throttled_engine._process_engine_step() is False
    assert time.monotonic() - start < WOKEN_WITHIN_S
    thread.join()
    assert other.request_id in scheduler.requests
    # ... and the next step serves it.
    assert throttled_engine._process_engine_step() is True


def test_an_abort_ends_the_wait_and_is_handled(throttled_engine: Any) -> None:
    scheduler = throttled_engine.scheduler
    scheduler.output_rate_wait_s = lambda now_ns=None: LONG_WAIT_S
    (req_id,) = scheduler.requests
    thread = later(
        0.1, lambda: throttled_engine.input_queue.put((EngineCoreRequestType.ABORT, [req_id]))
    )
    start = time.monotonic()
    throttled_engine._process_engine_step()
    assert time.monotonic() - start < WOKEN_WITHIN_S
    thread.join()
    assert req_id not in scheduler.requests
    assert scheduler.get_num_unfinished_requests() == 0


@pytest.mark.skipif(
    not vllm_compat.release().defers_engine_inputs,
    reason="this vLLM handles every input as it is taken from the queue",
)
def test_inputs_deferred_during_the_step_are_not_overtaken_by_the_wait(
    throttled_engine: Any,
) -> None:
    """vLLM 0.34 takes inputs from the queue while a step runs and defers some (utility
    calls) until the step is done; the busy loop handles them before anything still
    queued. The idle wait must not start then: it would handle a newer input first."""
    scheduler = throttled_engine.scheduler
    scheduler.output_rate_wait_s = lambda now_ns=None: LONG_WAIT_S
    (req_id,) = scheduler.requests
    deferred = (EngineCoreRequestType.ABORT, [req_id])
    throttled_engine._deferred_inputs.append(deferred)
    newer = (EngineCoreRequestType.ADD, (make_request("other", max_tokens=5), 0))
    throttled_engine.input_queue.put(newer)
    assert throttled_engine._process_engine_step() is False
    assert list(throttled_engine._deferred_inputs) == [deferred]
    assert throttled_engine.input_queue.get_nowait() == newer  # left for the busy loop


def test_wake_engine_from_another_thread_ends_the_wait(throttled_engine: Any) -> None:
    scheduler = throttled_engine.scheduler
    scheduler.output_rate_wait_s = lambda now_ns=None: LONG_WAIT_S
    thread = later(0.1, throttled_engine.wake)
    start = time.monotonic()
    throttled_engine._process_engine_step()
    assert time.monotonic() - start < WOKEN_WITHIN_S
    thread.join()
    assert throttled_engine.input_queue.empty()  # the WAKEUP item was consumed, as a no-op
    assert scheduler.has_requests()


def test_a_throttled_user_still_gets_its_tokens(throttled_engine: Any) -> None:
    scheduler = throttled_engine.scheduler
    scheduler.output_rate_limiter.set_rate("slow", 20)
    before = throttled_engine.num_model_steps
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        throttled_engine._process_engine_step()
    # 20 tokens/s for 1 s; waits are capped by the time the budget returns.
    assert throttled_engine.num_model_steps - before >= 10


def test_upstream_scheduler_is_left_alone() -> None:
    scheduler = make_scheduler(limited=False)
    engine = make_engine(scheduler)
    assert engine.wake is None
    engine._handle_client_request(EngineCoreRequestType.ADD, (make_request(None), 0))
    wakeup = (EngineCoreRequestType.WAKEUP, None)
    engine.input_queue.put(wakeup)
    idle_wait_after_step(engine, model_executed=False)
    assert engine.input_queue.get_nowait() == wakeup  # not waited on, not consumed
    assert engine._process_engine_step() is True


def test_a_stopped_engine_core_gets_the_time_to_leave_only_when_upstream_gives_none() -> None:
    import vllm.v1.engine.utils as engine_utils

    vllm_compat.apply_patches(vllm_compat.SHUTDOWN_PATCHES)
    assert vllm_compat.apply_patches(vllm_compat.SHUTDOWN_PATCHES) == []  # once
    timeout = engine_utils.get_engine_process_shutdown_timeout
    assert getattr(timeout, vllm_compat.PATCHED_MARK, False)
    # --shutdown-timeout 0 (abort, the default): upstream kills the core at once.
    assert timeout.__wrapped__(0, 0) == 0  # type: ignore[attr-defined]
    assert timeout(0, 0) == LEAVING_GRACE_S
    # A drain deadline, or an outer manager's remaining budget, is upstream's to keep.
    assert timeout(30, 30) == 30
    assert timeout(30, 0) == 0
    assert timeout(0, 5.0) == 5.0
    assert timeout(None, None) is None


def test_an_aborting_engine_leaves_in_its_signal_handler_before_vllms_own() -> None:
    class Client:
        left = 0

        def leave(self) -> None:
            self.left += 1

    class Engine:
        class vllm_config:
            shutdown_timeout = 0

    calls: list[tuple[str, int]] = []
    client = Client()
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for signum in saved:
            signal.signal(signum, lambda num, frame: calls.append(("vllm", client.left)))
        leave_on_signal(Engine(), client)
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        # Left first, then vLLM's handler ran as before.
        assert calls == [("vllm", 1), ("vllm", 2)]
        # Draining (--shutdown-timeout > 0): it serves on; it leaves when its loop ends.
        for signum in saved:
            signal.signal(signum, lambda num, frame: calls.append(("vllm", client.left)))
        Engine.vllm_config.shutdown_timeout = 30
        leave_on_signal(Engine(), client)
        signal.raise_signal(signal.SIGTERM)
        assert calls[-1] == ("vllm", 2)
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
