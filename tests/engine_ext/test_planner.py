"""The step planner on its own, with plain values: no vLLM, no scheduler.

``Req`` carries exactly the attributes the planner reads of vLLM's Request;
``Queue`` is the per-user view of a waiting queue. The limiter is the real one
on a fake clock.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

from engine_ext.limiter import OutputRateLimiter
from engine_ext.planner import RECLAIM_COOLDOWN_STEPS, Slots, StepPlanner

NOW_NS = 10_000_000_000


@dataclass
class Req:
    request_id: str
    num_prompt_tokens: int = 8
    max_tokens: int = 100
    num_output_tokens: int = 5
    num_computed_tokens: int = 12  # a decode: everything but the last token computed
    num_output_placeholders: int = 0
    next_decode_eligible_step: int = 0
    is_prefill_chunk: bool = False
    arrival_time: float = 0.0

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


class Queue:
    """user -> number of waiting requests."""

    def __init__(self, counts: dict[str, int] | None = None) -> None:
        self.counts = dict(counts or {})

    def __len__(self) -> int:
        return sum(self.counts.values())

    def users(self):
        return self.counts.keys()

    def num_requests_of(self, user: str) -> int:
        return self.counts.get(user, 0)


def make_planner(rates: dict[str, int | None], default: int | None = None):
    clock = [NOW_NS]
    limiter = OutputRateLimiter(default, rates, clock_ns=lambda: clock[0])
    users: dict[str, str] = {}
    return StepPlanner(limiter, users), users, clock


def add(users: dict[str, str], user: str, n: int, **kwargs) -> list[Req]:
    start = len(users)
    reqs = [Req(f"{user}-{start + i}", **kwargs) for i in range(n)]
    for r in reqs:
        users[r.request_id] = user
    return reqs


def slots(num_held: int, *, max_active: int = 16, max_running: int = 16) -> Slots:
    return Slots(max_active=max_active, max_running=max_running, num_held=num_held, max_chunk=64)


def drain(planner: StepPlanner, user: str) -> None:
    while planner.limiter.try_take(user):
        pass


def test_planner_imports_nothing_from_vllm() -> None:
    code = "import sys, engine_ext.planner; sys.exit('vllm' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_only_requests_whose_step_samples_are_charged() -> None:
    planner, users, _ = make_planner({"a": 1000})
    decode = add(users, "a", 1)[0]
    mid_prefill = add(
        users, "a", 1, num_output_tokens=0, num_prompt_tokens=500, num_computed_tokens=0
    )[0]
    cadence = add(users, "a", 1, next_decode_eligible_step=9)[0]
    # Async look-ahead: the placeholder already reaches max_tokens.
    done = add(users, "a", 1, max_tokens=5, num_computed_tokens=13, num_output_placeholders=1)[0]
    plan, _ = planner.plan([decode, mid_prefill, cadence, done], (Queue(),), slots(4), step=5)
    assert plan.charged == [decode]
    assert plan.throttled == plan.parked == plan.victims == []
    assert plan.admission_cap is None


def test_a_short_user_rotates_its_tokens_and_is_throttled_otherwise() -> None:
    planner, users, clock = make_planner({"a": 10})
    streams = add(users, "a", 3)
    drain(planner, "a")
    served = []
    for step in range(1, 7):
        clock[0] += 100_000_000  # one token's worth at 10 tok/s
        plan, gate = planner.plan(streams, (Queue(),), slots(3), step)
        assert len(plan.charged) == 1 and len(plan.throttled) == 2
        assert plan.admission_cap == 16  # 16 active + 2 throttled, bounded by 16 slots
        served.append(plan.charged[0].request_id)
        planner.settle(plan, gate, {r.request_id: 1 for r in plan.charged}, step)
    assert served == [r.request_id for r in streams] * 2
    assert planner.wakeup_ns is not None
    assert planner.num_throttled["a"] == 12


def test_ready_requests_beyond_the_active_cap_are_parked_fairly() -> None:
    planner, users, _ = make_planner({}, default=1000)
    x, y = add(users, "x", 3), add(users, "y", 3)
    before = planner.limiter.num_available("x", 1000)
    first, gate = planner.plan(x + y, (Queue(),), slots(6, max_active=2), step=1)
    assert {users[r.request_id] for r in first.charged} == {"x"}
    assert len(first.parked) == 4
    # Parked requests were refunded: x paid for the two that got a slot only.
    assert planner.limiter.num_available("x", 1000) == before - 2
    planner.settle(first, gate, {r.request_id: 1 for r in first.charged}, step=1)
    # The user given the slots least recently goes first next time.
    second, _ = planner.plan(x + y, (Queue(),), slots(6, max_active=2), step=2)
    assert {users[r.request_id] for r in second.charged} == {"y"}


def test_a_waiting_stream_takes_a_running_streams_turn_only_with_a_free_slot() -> None:
    planner, users, clock = make_planner({"a": 10})
    running = add(users, "a", 1)
    drain(planner, "a")
    clock[0] += 100_000_000
    full, _ = planner.plan(running, (Queue({"a": 1}),), slots(16), step=1)
    assert full.charged == running  # no slot for the waiting stream: nothing taken
    drain(planner, "a")
    clock[0] += 100_000_000
    free, _ = planner.plan(running, (Queue({"a": 1}),), slots(1), step=2)
    assert free.charged == [] and free.throttled == running
    assert planner.limiter.num_available("a", 5) == 1  # the token waits for the queue


def test_reclaim_takes_from_the_most_throttled_user_its_cheapest_request() -> None:
    planner, users, _ = make_planner({"hog": 1, "small": 1})
    hog = [
        r
        for i in range(5)
        for r in add(users, "hog", 1, num_prompt_tokens=96 + i, num_computed_tokens=100 + i)
    ]
    small = add(users, "small", 2)
    for user in ("hog", "small"):
        drain(planner, user)
    plan, gate = planner.plan(hog + small, (Queue({"victim": 2}),), slots(7, max_running=7), 1)
    assert [r.request_id for r in plan.victims] == [hog[0].request_id, hog[1].request_id]
    assert plan.victims[0] not in plan.throttled
    assert gate.refused == {"hog"}  # not admitted again in the same step
    assert planner.reclaim_stats.num_reclaims == 2
    assert planner.reclaim_stats.num_tokens_dropped == 201


def test_no_reclaim_for_the_throttled_users_own_queue_or_a_user_without_budget() -> None:
    planner, users, _ = make_planner({"hog": 1, "other": 1})
    hog = add(users, "hog", 4)
    drain(planner, "hog")
    drain(planner, "other")
    # The hog's own queue: its budget is spent anyway, and it never gets its own slot.
    plan, _ = planner.plan(hog, (Queue({"hog": 3, "other": 3}),), slots(4, max_running=4), 1)
    assert plan.victims == []


def test_a_readmitted_request_is_protected_for_the_cooldown() -> None:
    planner, users, _ = make_planner({"hog": 1})
    (hog,) = add(users, "hog", 1)
    drain(planner, "hog")
    plan, gate = planner.plan([hog], (Queue({"v": 1}),), slots(1, max_running=1), step=1)
    assert plan.victims == [hog]
    # Later the hog stream is admitted again through the gate and scheduled.
    gate.charged[hog.request_id] = hog
    planner.settle(plan, gate, {hog.request_id: 9}, step=10)
    for step in (11, 10 + RECLAIM_COOLDOWN_STEPS - 1):
        again, _ = planner.plan([hog], (Queue({"v": 1}),), slots(1, max_running=1), step)
        assert again.victims == [], step
    later, _ = planner.plan([hog], (Queue({"v": 1}),), slots(1, max_running=1), step=42)
    assert later.victims == [hog]


def test_settle_refunds_exactly_what_did_not_sample() -> None:
    planner, users, _ = make_planner({"a": 1000})
    sampled, unscheduled, chunk = add(users, "a", 3)
    before = planner.limiter.num_available("a", 1000)
    plan, gate = planner.plan([sampled, unscheduled, chunk], (Queue(),), slots(3), step=1)
    assert planner.limiter.num_available("a", 1000) == before - 3
    chunk.is_prefill_chunk = True  # upstream cut its chunk short of the end
    planner.settle(plan, gate, {sampled.request_id: 1, chunk.request_id: 40}, step=1)
    assert planner.limiter.num_available("a", 1000) == before - 1
