"""The worker's input-reader patch on vLLM's real shared-memory ``MessageQueue``.

A real writer/reader pair is built in this process (the reader is what a
multiproc worker reads its steps from). The busy window is checked with a fake
clock and a recording poller, so "spins" and "parks" are decided by the
reader's own code, not by timing. That the patch runs in a real spawned
worker is checked against the e2e servers' logs (tests/e2e/test_engine_limits.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.device_communicators import shm_broadcast
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
from vllm.v1.executor.multiproc_executor import WorkerProc

from engine_ext import worker_spin
from engine_ext.config import CONFIG_KEY
from engine_ext.plugin import register
from engine_ext.vllm_compat import PATCHED_MARK
from engine_ext.worker_spin import (
    BUSY_WINDOW_S,
    park_idle_worker,
    shorten_reader_spin,
)

LIMITED = SimpleNamespace(additional_config={CONFIG_KEY: {"default_rate": 5}})
UNLIMITED = SimpleNamespace(additional_config={})


@pytest.fixture
def queues() -> Iterator[tuple[MessageQueue, MessageQueue]]:
    writer = MessageQueue(n_reader=1, n_local_reader=1, max_chunk_bytes=1 << 16, max_chunks=4)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    thread = threading.Thread(target=writer.wait_until_ready)
    thread.start()
    reader.wait_until_ready()
    thread.join()
    yield writer, reader
    reader.shutdown()
    writer.shutdown()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class RecordingPoller:
    """Stands in for the reader's zmq poller: records that the reader parked."""

    def __init__(self) -> None:
        self.calls: list[int | None] = []

    def poll(self, timeout: int | None = None) -> list[Any]:
        self.calls.append(timeout)
        return []


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    # Both the reader and the patch read time.monotonic through their module's `time`.
    monkeypatch.setattr(shm_broadcast, "time", fake)
    monkeypatch.setattr(worker_spin, "time", fake)
    return fake


def spin_of(reader: MessageQueue) -> Any:
    return reader._spin_condition


def test_upstream_reader_spins_one_second_from_the_read(
    queues: tuple[MessageQueue, MessageQueue], clock: FakeClock
) -> None:
    # The baseline this patch changes: vLLM's window counts from the last read.
    spin = spin_of(queues[1])
    spin.poller = poller = RecordingPoller()
    assert spin.busy_loop_s == 1
    spin.record_read()
    clock.now += 0.9  # a step that takes the model 0.9 s: still spinning
    spin.wait(timeout_ms=0)
    assert poller.calls == []
    clock.now += 0.2
    spin.wait(timeout_ms=0)
    assert poller.calls == [0]


def test_patched_reader_spins_a_short_window_from_the_start_of_each_wait(
    queues: tuple[MessageQueue, MessageQueue], clock: FakeClock
) -> None:
    spin = spin_of(queues[1])
    spin.poller = poller = RecordingPoller()
    assert shorten_reader_spin(spin)
    assert spin.busy_loop_s == BUSY_WINDOW_S
    spin.record_read()
    clock.now += 10.0  # however long the model ran, the next wait starts spinning
    spin.wait(timeout_ms=0)
    clock.now += BUSY_WINDOW_S * 0.9
    spin.wait(timeout_ms=0)
    assert poller.calls == []  # back-to-back steps never leave the spin
    clock.now += BUSY_WINDOW_S * 0.2
    spin.wait(timeout_ms=0)
    spin.wait(timeout_ms=7)
    assert poller.calls == [0, 7]  # no step within the window: parked
    spin.record_read()  # the next step arrived: a new wait period begins
    clock.now += 1.0
    spin.wait(timeout_ms=0)
    assert poller.calls == [0, 7]


def test_patched_reader_parks_at_once_when_told_at_the_start_of_a_wait(
    queues: tuple[MessageQueue, MessageQueue], clock: FakeClock
) -> None:
    spin = spin_of(queues[1])
    spin.poller = poller = RecordingPoller()
    park = [True]
    assert shorten_reader_spin(spin, park_at_once=lambda: park[0])
    spin.record_read()
    spin.wait(timeout_ms=3)  # no time has passed, yet no window
    assert poller.calls == [3]
    park[0] = False
    spin.wait(timeout_ms=4)  # asked at the start of a wait period only
    assert poller.calls == [3, 4]
    spin.record_read()  # a new period: the usual window again
    spin.wait(timeout_ms=5)
    assert poller.calls == [3, 4]


def test_patch_is_idempotent_and_the_queue_still_delivers(
    queues: tuple[MessageQueue, MessageQueue],
) -> None:
    writer, reader = queues
    spin = spin_of(reader)
    assert shorten_reader_spin(spin)
    wrapped = spin.wait
    assert shorten_reader_spin(spin)
    assert spin.wait is wrapped
    for i in range(10):  # more items than ring slots, read after every write
        writer.enqueue({"step": i})
        assert reader.dequeue(timeout=10) == {"step": i}

    def late_write() -> None:
        threading.Event().wait(0.05)  # the reader is already waiting, past the window
        writer.enqueue("late")

    thread = threading.Thread(target=late_write)
    thread.start()
    assert reader.dequeue(timeout=30) == "late"  # woken from the parked poll by the notify
    thread.join()


def test_unexpected_objects_are_left_alone() -> None:
    writer_side = SimpleNamespace(is_reader=False, busy_loop_s=0, last_read=0.0, wait=print)
    assert not shorten_reader_spin(writer_side)
    assert not shorten_reader_spin(None)
    assert not shorten_reader_spin(SimpleNamespace(is_reader=True))  # attributes renamed
    assert writer_side.wait is print


class StepRecorder:
    """Stands in for the worker's model runner: records the steps it was given."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.steps: list[Any] = []

    def execute_model(self, scheduler_output: Any) -> str:
        self.steps.append(scheduler_output)
        return "output"


def worker_proc(vllm_config: Any, queue: Any) -> Any:
    proc: Any = object.__new__(WorkerProc)
    proc.worker = StepRecorder(vllm_config)
    proc.rpc_broadcast_mq = queue
    return proc


def test_a_step_with_no_token_makes_the_next_wait_park_at_once(
    queues: tuple[MessageQueue, MessageQueue], clock: FakeClock
) -> None:
    reader = queues[1]
    proc = worker_proc(LIMITED, reader)
    park_idle_worker(proc)
    park_idle_worker(proc)  # idempotent: execute_model is wrapped once
    spin = spin_of(reader)
    spin.poller = poller = RecordingPoller()
    empty, busy = (
        SimpleNamespace(total_num_scheduled_tokens=0),
        SimpleNamespace(total_num_scheduled_tokens=8),
    )
    for step, parks in ((empty, True), (busy, False), (empty, True)):
        del poller.calls[:]
        clock.now += 0.01  # the next step arrives a little later
        spin.record_read()
        assert proc.worker.execute_model(step) == "output"
        spin.wait(timeout_ms=1)
        assert poller.calls == ([1] if parks else [])
    assert proc.worker.steps == [empty, busy, empty]


def test_only_a_limited_engine_worker_is_patched(
    queues: tuple[MessageQueue, MessageQueue],
) -> None:
    reader = queues[1]
    park_idle_worker(worker_proc(UNLIMITED, reader))
    assert spin_of(reader).busy_loop_s == 1  # upstream, untouched
    park_idle_worker(worker_proc(LIMITED, reader))
    assert spin_of(reader).busy_loop_s == BUSY_WINDOW_S


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_changed_internals_log_and_skip() -> None:
    # Our own handler: vLLM's logger may or may not propagate to pytest's.
    handler = Records()
    worker_spin.logger.addHandler(handler)
    try:
        renamed = SimpleNamespace(_is_local_reader=True, spin_condition=object())
        park_idle_worker(worker_proc(LIMITED, renamed))
        remote = SimpleNamespace(_is_local_reader=False, _spin_condition=None)
        park_idle_worker(worker_proc(LIMITED, remote))  # nothing spins: nothing to say
        park_idle_worker(SimpleNamespace())  # no worker, no config: not limited
    finally:
        worker_spin.logger.removeHandler(handler)
    warnings = [r for r in handler.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "keeps vLLM's busy-poll" in warnings[0].getMessage()


def test_real_worker_busy_loop_patches_its_reader_before_reading(
    queues: tuple[MessageQueue, MessageQueue],
) -> None:
    register()
    register()  # idempotent: the loop is wrapped once
    assert getattr(WorkerProc.worker_busy_loop, PATCHED_MARK, False)
    assert not getattr(WorkerProc.worker_busy_loop.__wrapped__, PATCHED_MARK, False)
    reader = queues[1]
    reader.shutting_down = True  # the real loop's first dequeue raises "cancelled"
    with pytest.raises(RuntimeError, match="cancelled"):
        worker_proc(LIMITED, reader).worker_busy_loop()
    assert spin_of(reader).busy_loop_s == BUSY_WINDOW_S
