"""Speculative decoding on the real schedulers: every emitted token is charged, exactly.

The model runner and its drafter are the fakes (harness/scheduler.drive_speculative:
random drafts, random acceptance, random stops); the schedulers, KV manager and
queues are vLLM's. The window bound is checked on the tokens each request really
received, at the time its step was dispatched (when it was charged).
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from typing import Any

import pytest

from engine_ext.limit_table import LimitTable
from engine_ext.limiter import DEFAULT_BURST_NS, OutputRateLimiter
from harness.scheduler import (
    Delivery,
    FakeClock,
    SpecTrace,
    drive_speculative,
    make_request,
    make_scheduler,
)
from harness.window import worst_window_excess
from output_rate_core import protocol as p

NUM_DRAFTS = 4
RATES = {"slow": 80, "mid": 150}  # tok/s; "free" has no limit
STEP_MS = 10
SCHEDULERS = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def run(
    seed: int,
    *,
    async_scheduling: bool,
    eos_probability: float = 0.0,
    user_rates: dict[str, int | None] | None = None,
    limited: bool = True,
    count_granted: bool = False,
    snapshot: p.Snapshot | None = None,
    num_steps: int = 800,
) -> tuple[Any, SpecTrace, dict[str, str], FakeClock]:
    """A random mix of streams of three users; returns (scheduler, trace,
    request id -> user, clock)."""
    rng = random.Random(seed)
    clock = FakeClock()
    sched = make_scheduler(
        async_scheduling=async_scheduling,
        limited=limited,
        user_rates=RATES if user_rates is None else user_rates,
        clock=clock,
        num_speculative_tokens=NUM_DRAFTS,
        max_num_seqs=8,
    )
    if count_granted:
        sched.output_rate_planner.count_granted = True
    if snapshot is not None:  # limits as the control plane sends them
        LimitTable.from_snapshot(snapshot).load(sched.output_rate_limiter)
    # step -> requests arriving then
    arrivals: dict[int, list] = defaultdict(list)
    user_of: dict[str, str] = {}
    for user, num_streams in (("slow", 4), ("mid", 2), ("free", 2)):
        for i in range(num_streams):
            request = make_request(
                user,
                request_id=f"{user}-{i}",
                num_prompt_tokens=rng.randint(5, 40),
                max_tokens=rng.randint(20, 80),
                ignore_eos=eos_probability == 0,
            )
            arrivals[rng.randint(0, 100)].append(request)
            user_of[request.request_id] = user

    def arrive(step: int) -> None:
        for request in arrivals.pop(step, ()):
            sched.add_request(request)

    trace = drive_speculative(
        sched,
        num_steps=num_steps,
        rng=rng,
        clock=clock,
        step_ms=STEP_MS,
        eos_probability=eos_probability,
        on_step=arrive,
        keep_outputs=True,
    )
    return sched, trace, user_of, clock


def tokens_by_dispatch(
    deliveries: list[Delivery], user_of: dict[str, str], user: str
) -> list[tuple[int, int]]:
    """(dispatch time, tokens the user received from that step), by time."""
    num_by_time: Counter[int] = Counter()
    for d in deliveries:
        if user_of[d.request_id] == user:
            num_by_time[d.dispatched_ns] += d.num_tokens
    return sorted(num_by_time.items())


def ideal_limiter(
    trace: SpecTrace, user_of: dict[str, str], clock: FakeClock
) -> tuple[OutputRateLimiter, set[str]]:
    """A limiter charged only what each user received, at dispatch; returns it and
    the users it would have refused any token."""
    ideal_clock = FakeClock(0)
    ideal = OutputRateLimiter(None, RATES, clock_ns=ideal_clock)
    refused: set[str] = set()
    by_time: dict[int, Counter[str]] = defaultdict(Counter)
    for d in trace.deliveries:
        by_time[d.dispatched_ns][user_of[d.request_id]] += d.num_tokens
    for at, num_by_user in sorted(by_time.items()):
        ideal_clock.now_ns = at
        refused |= ideal.take_many(+num_by_user).keys()
    ideal_clock.now_ns = clock.now_ns
    return ideal, refused


@SCHEDULERS
@pytest.mark.parametrize("seed", range(6))
def test_window_bound_holds_for_emitted_tokens_and_charges_match_them(
    seed: int, async_scheduling: bool
) -> None:
    _, trace, user_of, clock = run(
        seed, async_scheduling=async_scheduling, eos_probability=0.02 if seed % 2 else 0.0
    )
    assert len(trace.finished) == len(user_of), "every stream should finish"
    received: Counter[str] = Counter()
    accepted: Counter[str] = Counter()
    for d in trace.deliveries:
        received[user_of[d.request_id]] += d.num_tokens
        accepted[user_of[d.request_id]] += d.num_accepted
    # Drafts were really accepted, for limited users too.
    assert all(accepted[user] > 0 for user in ("slow", "mid", "free")), accepted
    for user, rate in RATES.items():
        events = tokens_by_dispatch(trace.deliveries, user_of, user)
        assert worst_window_excess(events, rate) <= 0, user
    # An ideal GCRA charged only the received tokens, when their step was
    # dispatched, accepts every one of them: the bound, exactly.
    _, refused = ideal_limiter(trace, user_of, clock)
    assert not refused


@SCHEDULERS
@pytest.mark.parametrize("seed", range(4))
def test_charges_equal_the_emitted_tokens_mid_stream(seed: int, async_scheduling: bool) -> None:
    # Stopped while the slow user is still backlogged, its streams mid-way.
    sched, trace, user_of, clock = run(seed, async_scheduling=async_scheduling, num_steps=200)
    ledger = sched.output_rate_drafts
    ledger.settle()  # what the next schedule() does first
    assert ledger.num_pending == 0
    ideal, refused = ideal_limiter(trace, user_of, clock)
    assert not refused
    # The limiter ends exactly where one charged only the received tokens ends.
    floor = clock.now_ns - DEFAULT_BURST_NS
    assert ideal.ready_at_ns("slow") > floor, "the slow user should still be backlogged"
    for user in RATES:
        got = max(sched.output_rate_limiter.ready_at_ns(user), floor)
        want = max(ideal.ready_at_ns(user), floor)
        assert got == want, user
    assert ledger.stats.num_refunded > 0


@SCHEDULERS
def test_a_limited_user_is_scheduled_at_most_its_allowance_of_drafts_per_step(
    async_scheduling: bool,
) -> None:
    sched, trace, user_of, _ = run(3, async_scheduling=async_scheduling)
    allowance = {user: DEFAULT_BURST_NS * rate // 1_000_000_000 + 1 for user, rate in RATES.items()}
    num_cut = 0
    for out in trace.outputs:
        charged: Counter[str] = Counter()
        for req_id in out.num_scheduled_tokens:
            request = sched.requests.get(req_id)
            if request is None or request.is_prefill_chunk:
                continue
            charged[user_of[req_id]] += 1 + len(out.scheduled_spec_decode_tokens.get(req_id, ()))
        for user, num in allowance.items():
            assert charged[user] <= num, (user, charged[user])
    for d in trace.deliveries:
        if user_of[d.request_id] == "free":
            assert d.num_drafts == d.num_proposed  # unlimited: every draft kept
        num_cut += d.num_proposed - d.num_drafts
    assert num_cut > 0, "the slow user's drafts should have been cut"
    assert sched.output_rate_drafts.stats.num_drafts_cut > 0


@SCHEDULERS
def test_no_decision_changes_while_no_limit_binds(async_scheduling: bool) -> None:
    not_binding = {user: 1_000_000 for user in RATES}
    _, upstream, _, _ = run(11, async_scheduling=async_scheduling, limited=False)
    _, ours, _, _ = run(11, async_scheduling=async_scheduling, user_rates=not_binding)
    assert len(upstream.outputs) == len(ours.outputs)
    for step, (want, got) in enumerate(zip(upstream.outputs, ours.outputs, strict=True)):
        assert got.num_scheduled_tokens == want.num_scheduled_tokens, step
        assert got.scheduled_spec_decode_tokens == want.scheduled_spec_decode_tokens, step
    assert upstream.deliveries == ours.deliveries


@SCHEDULERS
def test_usage_counts_emitted_tokens(async_scheduling: bool) -> None:
    sched, trace, user_of, _ = run(5, async_scheduling=async_scheduling, count_granted=True)
    received: Counter[str] = Counter()
    for d in trace.deliveries:
        received[user_of[d.request_id]] += d.num_tokens
    sched.schedule()  # settles the last steps
    granted, _, _ = sched.output_rate_planner.take_usage()
    assert granted == dict(received)


@SCHEDULERS
def test_a_shadow_user_keeps_every_draft_and_counts_what_it_would_refuse(
    async_scheduling: bool,
) -> None:
    shadow = p.Snapshot(
        version=1,
        default_rate=None,
        tiers={"t": 40},
        users={"slow": ("t", None)},
        tier_enforcements={"t": "shadow"},
    )
    sched, trace, user_of, _ = run(
        7, async_scheduling=async_scheduling, user_rates={}, snapshot=shadow, count_granted=True
    )
    sched.schedule()  # settles the last steps
    received: Counter[str] = Counter()
    for d in trace.deliveries:
        received[user_of[d.request_id]] += d.num_tokens
        assert d.num_drafts == d.num_proposed  # nobody's drafts cut: shadow slows nobody
    granted, throttled, would = sched.output_rate_planner.take_usage()
    assert granted == dict(received)
    assert not throttled
    # Received far beyond 40 tok/s: enforcement would have refused emitted tokens.
    assert would.keys() == {"slow"}
