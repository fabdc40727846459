"""Shadow limits on the real scheduler (sync and async), driven by a fake clock (the
only fake: the limiter's and the trace's time).

A shadow user counts exactly the request-steps the same limit would refuse enforced,
and a live switch to enforce binds at the next step from the user's real recent use.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine_ext.limit_table import LimitTable
from harness.scheduler import FakeClock, drive, make_request, make_scheduler
from output_rate_core import protocol as p

STEP_MS = 10
NUM_STREAMS = 4


def _scheduler(
    clock: FakeClock, async_scheduling: bool, snapshot: p.Snapshot
) -> tuple[Any, LimitTable]:
    sched: Any = make_scheduler(async_scheduling=async_scheduling, max_num_seqs=16, clock=clock)
    table = LimitTable.from_snapshot(snapshot)
    table.load(sched.output_rate_limiter)
    return sched, table


def _snapshot(rate: int, enforcement: p.Enforcement) -> p.Snapshot:
    return p.Snapshot(
        version=1,
        default_rate=None,
        tiers={"t": rate},
        users={"a": ("t", None)},
        tier_enforcements={"t": enforcement},
    )


def _streams(sched: Any, num_streams: int = NUM_STREAMS) -> None:
    # Long enough that no stream finishes in the trace: both runs ask the same every step.
    for i in range(num_streams):
        sched.add_request(make_request("a", max_tokens=900, request_id=f"a{i}"))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("rate", [20, 150])
def test_would_throttle_count_equals_the_throttle_count_enforced(
    async_scheduling: bool, rate: int
) -> None:
    counts = {}
    served = {}
    for enforcement in ("enforce", "shadow"):
        clock = FakeClock()
        sched, _ = _scheduler(clock, async_scheduling, _snapshot(rate, enforcement))
        _streams(sched)
        trace = drive(sched, num_steps=300, clock=clock, step_ms=STEP_MS, keep_outputs=True)
        planner = sched.output_rate_planner
        counts[enforcement] = (planner.num_throttled, planner.num_would_throttle)
        served[enforcement] = sum(len(o.num_scheduled_tokens) for o in trace.outputs)
    (enforced_throttled, enforced_would), (shadow_throttled, shadow_would) = counts.values()
    assert enforced_would == {} and shadow_throttled == {}
    assert shadow_would == enforced_throttled
    assert shadow_would["a"] > 0
    # Enforced, "a" got about its rate over 3 s; in shadow every stream ran every step.
    assert served["shadow"] == NUM_STREAMS * 300
    assert served["enforce"] <= rate * 3.0 + NUM_STREAMS + rate * 0.1 + 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_switch_to_enforce_binds_at_the_next_step_from_real_recent_use(
    async_scheduling: bool,
) -> None:
    """In shadow "a" runs 4 streams at 400 tok/s against a 200 tok/s limit; the switch
    to enforce (a live op, applied between steps) holds it from the next step: in every
    window of steps from the switch it gets at most rate x the steps' time + 2 tokens
    (its GCRA state was saturated by its real use: no fresh 100 ms burst of 20 more
    tokens), and it is held to the rate, not starved."""
    rate = 200
    clock = FakeClock()
    sched, table = _scheduler(clock, async_scheduling, _snapshot(rate, "shadow"))
    _streams(sched)
    switch_step = 100
    switch_ns: list[int] = []

    def on_step(step: int) -> None:
        if step == switch_step:
            op = p.SetTier("t", rate, enforcement="enforce")
            table.apply(op, sched.output_rate_limiter)
            switch_ns.append(clock())

    trace = drive(
        sched,
        num_steps=switch_step + 200,
        clock=clock,
        step_ms=STEP_MS,
        on_step=on_step,
        keep_outputs=True,
    )
    # Tokens dispatched per step (each scheduled stream samples one: all are decodes).
    per_step = [len(o.num_scheduled_tokens) for o in trace.outputs]
    assert per_step[1:switch_step] == [NUM_STREAMS] * (switch_step - 1)  # shadow: unthrottled
    assert sched.output_rate_planner.num_would_throttle["a"] > 0
    after = per_step[switch_step:]
    assert after[0] < NUM_STREAMS  # binds at the very next step
    for num_steps in range(1, len(after) + 1):
        assert sum(after[:num_steps]) <= rate * num_steps * STEP_MS // 1000 + 2, num_steps
    assert sum(after) >= rate * len(after) * STEP_MS // 1000 - 2
    assert sched.output_rate_planner.num_throttled["a"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_switch_to_shadow_stops_throttling_at_the_next_step(async_scheduling: bool) -> None:
    clock = FakeClock()
    sched, table = _scheduler(clock, async_scheduling, _snapshot(50, "enforce"))
    _streams(sched)

    def on_step(step: int) -> None:
        if step == 50:
            table.apply(p.SetTier("t", 50, enforcement="shadow"), sched.output_rate_limiter)

    trace = drive(
        sched, num_steps=100, clock=clock, step_ms=STEP_MS, on_step=on_step, keep_outputs=True
    )
    per_step = [len(o.num_scheduled_tokens) for o in trace.outputs]
    assert sum(per_step[1:50]) < NUM_STREAMS * 49 / 2
    assert per_step[50:] == [NUM_STREAMS] * 50
