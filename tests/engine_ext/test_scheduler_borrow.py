"""Borrowing idle capacity on the real vLLM scheduler (sync and async), driven by a fake
clock (the only fakes: the clock and the model runner's hand-built outputs).

A user with a ceiling above its rate takes tokens beyond the rate only in steps no other
user needs them, shares them with other borrowers in proportion to the rates, and drops
back to its rate at the first step another user needs the capacity. Every comparison is
with the same run without the ceiling (the rate then a hard limit).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from harness.scheduler import (
    FakeClock,
    Trace,
    drive,
    drive_speculative,
    make_request,
    make_scheduler,
)
from output_rate_core.protocol import MILLI
from tests.engine_ext.test_scheduler import assert_window_bound

MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
STEP_MS = 10
NUM_STREAMS = 4
# A ceiling no engine here reaches: the borrower is held back by nothing but others.
HIGH = 100_000


def make_borrow_scheduler(
    async_scheduling: bool,
    clock: FakeClock,
    user_rates: dict[str, int | None],
    ceilings: dict[str, int],
    **kwargs: Any,
) -> Any:
    # The ceilings come as the command line's do (OutputRateConfig.user_ceilings).
    sched: Any = make_scheduler(
        async_scheduling=async_scheduling,
        user_rates=user_rates,
        user_ceilings=dict(ceilings),
        clock=clock,
        **kwargs,
    )
    sched.output_rate_planner.count_granted = True  # counts tokens lent (num_borrowed)
    return sched


def add_streams(sched: Any, user: str, num: int = NUM_STREAMS, max_tokens: int = 2000) -> None:
    # Long enough that no stream finishes in a trace: every step asks the same.
    for i in range(num):
        sched.add_request(make_request(user, max_tokens=max_tokens, request_id=f"{user}-{i}"))


def user_of(request_id: str) -> str:
    return request_id.rsplit("-", 1)[0]


def tokens_by_user(trace: Trace, since_ns: int = 0) -> Counter[str]:
    return Counter(user_of(r) for t, r in trace.samples if t >= since_ns)


def scheduled_by_step(trace: Trace, user: str) -> list[int]:
    return [sum(user_of(r) == user for r in o.num_scheduled_tokens) for o in trace.outputs]


@MODES
def test_a_borrower_alone_runs_at_the_engines_pace(async_scheduling: bool) -> None:
    """Rate 20 and a ceiling no engine reaches: from the second step every stream is
    served every step, as an unlimited user's are; without the ceiling, its rate."""
    per_step = {}
    tokens = {}
    for case, rates, ceilings in (
        ("borrower", {"a": 20}, {"a": HIGH}),
        ("unlimited", {"a": None}, {}),
        ("hard", {"a": 20}, {}),
    ):
        clock = FakeClock()
        sched = make_borrow_scheduler(async_scheduling, clock, rates, ceilings)
        add_streams(sched, "a")
        trace = drive(sched, num_steps=200, clock=clock, step_ms=STEP_MS, keep_outputs=True)
        per_step[case] = scheduled_by_step(trace, "a")
        tokens[case] = tokens_by_user(trace)["a"]
    assert per_step["borrower"][1:] == [NUM_STREAMS] * 199
    assert tokens["borrower"] >= tokens["unlimited"] - NUM_STREAMS  # at most one step behind
    assert tokens["hard"] <= 20 * 2.0 + 3  # the rate binds without a ceiling
    assert tokens["borrower"] > 10 * tokens["hard"]


@MODES
def test_a_borrower_alone_is_held_to_its_ceilings_bound(async_scheduling: bool) -> None:
    """Rate 20, ceiling 100, on an engine that could give it 400 tok/s: in every window
    at most (W + 0.1) x ceiling + 2 tokens (one burst token of the rate's and one of the
    borrowed state's), and it does reach the ceiling."""
    clock = FakeClock()
    sched = make_borrow_scheduler(async_scheduling, clock, {"a": 20}, {"a": 100})
    add_streams(sched, "a")
    trace = drive(sched, num_steps=300, clock=clock, step_ms=STEP_MS)
    times = sorted(t for t, _ in trace.samples)
    for i in range(0, len(times), 7):
        for j in range(i, len(times)):
            window_s = (times[j] - times[i]) / 1e9
            assert j - i + 1 <= (window_s + 0.1) * 100 + 2, (i, j)
    assert len(times) >= 100 * 2.9  # 3 s at its ceiling, less the first steps
    assert sched.output_rate_planner.num_borrowed["a"] >= len(times) - 20 * 3 - 3


@MODES
def test_two_borrowers_share_the_spare_capacity_in_proportion_to_their_rates(
    async_scheduling: bool,
) -> None:
    """Rates 20 and 60, 4 streams each, 4 active slots: the slots their rates leave over
    are lent 1:3 (weighted by the rate, token by token), so each gets as many tokens per
    unit of its rate, within a step's tokens."""
    clock = FakeClock()
    sched = make_borrow_scheduler(
        async_scheduling,
        clock,
        {"a": 20, "b": 60},
        {"a": HIGH, "b": HIGH},
        max_num_seqs=2 * NUM_STREAMS,
        max_num_active_seqs=NUM_STREAMS,
    )
    add_streams(sched, "a")
    add_streams(sched, "b")
    num_steps = 500
    trace = drive(sched, num_steps=num_steps, clock=clock, step_ms=STEP_MS, keep_outputs=True)
    borrowed = sched.output_rate_planner.num_borrowed
    total = tokens_by_user(trace)
    # The engine is saturated: once every stream is admitted, every step runs 4.
    assert [len(o.num_scheduled_tokens) for o in trace.outputs[10:]] == [4] * (num_steps - 10)
    # Tokens lent per unit of rate: equal within one step's tokens (and the first burst).
    assert abs(borrowed["a"] * 3 - borrowed["b"]) <= 3 * NUM_STREAMS + 8, borrowed
    assert abs(total["a"] * 3 - total["b"]) <= 3 * NUM_STREAMS + 8, total


@MODES
def test_two_borrowers_never_go_below_their_rates(async_scheduling: bool) -> None:
    """One active slot (100 tokens/s at 10 ms a step), borrowers of 20 and 60 tok/s with
    one stream each: each keeps at least its rate, and the 20 tok/s left over are lent
    1:3."""
    clock = FakeClock()
    sched = make_borrow_scheduler(
        async_scheduling,
        clock,
        {"a": 20, "b": 60},
        {"a": HIGH, "b": HIGH},
        max_num_seqs=2,
        max_num_active_seqs=1,
    )
    add_streams(sched, "a", 1)
    add_streams(sched, "b", 1)
    trace = drive(sched, num_steps=400, clock=clock, step_ms=STEP_MS)
    total = tokens_by_user(trace, since_ns=clock.now_ns - 3_000_000_000)
    assert total["a"] >= 20 * 3 - 2, total
    assert total["b"] >= 60 * 3 - 2, total
    borrowed = sched.output_rate_planner.num_borrowed
    assert abs(borrowed["a"] * 3 - borrowed["b"]) <= 3 + 8, borrowed


EIGHT_RATES = (15, 15, 30, 30, 45, 45, 60, 60)


@MODES
@pytest.mark.parametrize(
    "rates", [EIGHT_RATES, EIGHT_RATES[::-1]], ids=["slow-first", "fast-first"]
)
def test_eight_borrowers_of_different_rates_share_in_proportion_whatever_their_names(
    async_scheduling: bool, rates: tuple[int, ...]
) -> None:
    """Rates 15 to 60 named u0..u7 in either order, each keeping 6 short requests
    outstanding (a finished one is replaced at the next step, so requests are admitted
    all along, some on a token lent at admission): every user is lent the same number of
    tokens per unit of its rate within 2 % of the mean (0.1 % here). A loan at admission
    is out of the weighted fair order; it once moved the virtual clock up to its
    borrower's tag, and every borrower behind it was lifted there and lost what it was
    owed: 16-18 % from the mean with the slow users first (u0, u1 at 15 tok/s: 1.3x as
    many per unit of rate as u6, u7), 3-5 % with the fast ones first."""
    clock = FakeClock()
    users = [f"u{i}" for i in range(len(rates))]
    sched = make_borrow_scheduler(
        async_scheduling,
        clock,
        dict(zip(users, rates, strict=True)),
        dict.fromkeys(users, HIGH),
        max_num_seqs=64,
        max_num_active_seqs=8,
    )
    rngs = {user: random.Random(i) for i, user in enumerate(users)}
    live: dict[str, set[str]] = {user: set() for user in users}
    num_sent = Counter[str]()

    def keep_six_outstanding(step: int) -> None:
        for user in users:
            mine = live[user] = {r for r in live[user] if r in sched.requests}
            while len(mine) < 6:
                request_id = f"{user}-{num_sent[user]}"
                num_sent[user] += 1
                max_tokens = rngs[user].randint(16, 64)
                sched.add_request(make_request(user, max_tokens=max_tokens, request_id=request_id))
                mine.add(request_id)

    drive(sched, num_steps=1500, clock=clock, step_ms=STEP_MS, on_step=keep_six_outstanding)
    borrowed = sched.output_rate_planner.num_borrowed
    per_rate = {user: borrowed[user] / rate for user, rate in zip(users, rates, strict=True)}
    mean = sum(per_rate.values()) / len(per_rate)
    assert mean > 15, per_rate  # 5 of 8 tokens a step are spare: about 25 per tok/s
    assert all(abs(x - mean) <= 0.02 * mean for x in per_rate.values()), per_rate


@MODES
def test_an_arriving_user_is_served_as_soon_as_without_the_borrower(async_scheduling: bool) -> None:
    """A borrower fills every worker slot; 4 streams of another user arrive: their first
    tokens come no later than one step after they would without the ceiling, the newcomer
    then gets as many tokens as without it (within a step's), and the borrower is back to
    its rate's bound from that step on."""
    arrival_step = 100
    first_step: dict[str, list[int]] = {}
    tokens: dict[str, Counter[str]] = {}
    borrower_times: dict[str, list[int]] = {}
    for case, ceilings in (("borrowing", {"a": HIGH}), ("baseline", {})):
        clock = FakeClock()
        sched = make_borrow_scheduler(
            async_scheduling,
            clock,
            {"a": 20, "c": None},
            ceilings,
            max_num_seqs=8,
            max_num_active_seqs=4,
        )
        add_streams(sched, "a", 8)
        arrived_ns: list[int] = []

        def on_step(
            step: int,
            sched: Any = sched,
            clock: FakeClock = clock,
            arrived_ns: list[int] = arrived_ns,
        ) -> None:
            if step == arrival_step:
                add_streams(sched, "c", 4)
                arrived_ns.append(clock.now_ns)

        trace = drive(
            sched,
            num_steps=arrival_step + 100,
            clock=clock,
            step_ms=STEP_MS,
            on_step=on_step,
            keep_outputs=True,
        )
        outputs = trace.outputs
        first_step[case] = [
            next(i for i, o in enumerate(outputs) if f"c-{k}" in o.num_scheduled_tokens)
            for k in range(4)
        ]
        # Sampled from the arrival's step on (asynchronous: its output comes a step later).
        since_ns = arrived_ns[0] + (STEP_MS * 1_000_000 if async_scheduling else 0)
        tokens[case] = tokens_by_user(trace, since_ns=since_ns)
        borrower_times[case] = [t for t, r in trace.samples if user_of(r) == "a" and t >= since_ns]
    assert first_step["borrowing"][0] == arrival_step  # served at once
    for got, base in zip(first_step["borrowing"], first_step["baseline"], strict=True):
        assert got <= base + 1
    assert tokens["borrowing"]["c"] >= tokens["baseline"]["c"] - 4
    # From the arrival on, the borrower gets what its rate allows (c takes every slot).
    assert_window_bound(borrower_times["borrowing"], 20)


@MODES
def test_a_borrower_never_pushes_a_hard_limited_user_below_its_baseline(
    async_scheduling: bool,
) -> None:
    """A hard-limited user of 150 tok/s beside a borrower on 4 active slots: it gets the
    same tokens with the borrower as with the borrower held to its rate, while the
    borrower takes the rest."""
    tokens = {}
    for case, ceilings in (("borrowing", {"a": HIGH}), ("baseline", {})):
        clock = FakeClock()
        sched = make_borrow_scheduler(
            async_scheduling,
            clock,
            {"a": 20, "c": 150},
            ceilings,
            max_num_seqs=8,
            max_num_active_seqs=4,
        )
        add_streams(sched, "a")
        add_streams(sched, "c")
        trace = drive(sched, num_steps=300, clock=clock, step_ms=STEP_MS)
        tokens[case] = tokens_by_user(trace)
    assert tokens["borrowing"]["c"] >= tokens["baseline"]["c"] - 1, tokens
    assert tokens["borrowing"]["a"] > 5 * tokens["baseline"]["a"], tokens


@MODES
def test_no_decision_changes_while_nobody_can_borrow(async_scheduling: bool) -> None:
    """Ceilings at or below the rate, on a shadow user or on an unlimited one lend
    nothing: every step is the same as with no ceiling at all."""
    runs = []
    for ceilings in ({}, {"a": 20, "b": 5, "s": HIGH, "u": HIGH}):
        clock = FakeClock()
        sched = make_borrow_scheduler(
            async_scheduling,
            clock,
            {"a": 20, "b": 30, "s": 10, "u": None},
            ceilings,
            max_num_seqs=8,
            max_num_active_seqs=6,
        )
        limiter = sched.output_rate_limiter
        limiter.set_milli_rate("s", 10 * MILLI, shadow=True)
        for user in ("a", "b", "s", "u"):
            add_streams(sched, user, 3, max_tokens=60)
        trace = drive(sched, num_steps=300, clock=clock, step_ms=STEP_MS, keep_outputs=True)
        runs.append([dict(o.num_scheduled_tokens) for o in trace.outputs])
        assert not sched.output_rate_planner.num_borrowed
    assert runs[0] == runs[1]


@MODES
def test_a_default_ceiling_lends_to_users_of_the_default_rate(async_scheduling: bool) -> None:
    clock = FakeClock()
    sched = make_borrow_scheduler(async_scheduling, clock, {}, {}, default_rate=20)
    sched.output_rate_limiter.set_default_milli_ceiling(HIGH * MILLI)
    add_streams(sched, "a")
    trace = drive(sched, num_steps=100, clock=clock, step_ms=STEP_MS, keep_outputs=True)
    assert scheduled_by_step(trace, "a")[1:] == [NUM_STREAMS] * 99


@MODES
def test_with_speculative_decoding_a_borrowed_step_has_no_drafts_and_the_bound_holds(
    async_scheduling: bool,
) -> None:
    """Drafts are charged to the rate as without borrowing; a request lent a token is
    scheduled without drafts, so what the user receives stays within the ceiling's bound
    (on dispatch times) and nothing is charged late."""
    clock = FakeClock()
    sched = make_borrow_scheduler(
        async_scheduling, clock, {"a": 20}, {"a": 100}, num_speculative_tokens=3
    )
    add_streams(sched, "a")
    lent_ids: list[set[str]] = []
    planner = sched.output_rate_planner
    plan_of = planner.plan

    def spy_plan(*args: Any, **kwargs: Any) -> Any:
        plan, gate = plan_of(*args, **kwargs)
        lent_ids.append({r.request_id for r in plan.borrowed})
        return plan, gate

    planner.plan = spy_plan
    trace = drive_speculative(
        sched, num_steps=300, rng=random.Random(7), clock=clock, step_ms=STEP_MS, keep_outputs=True
    )
    assert sum(map(len, lent_ids)) > 100
    for lent, out in zip(lent_ids[1:], trace.outputs[1:], strict=True):
        for req_id in lent:
            assert not out.scheduled_spec_decode_tokens.get(req_id)
    times = sorted(d.dispatched_ns for d in trace.deliveries for _ in range(d.num_tokens))
    for i in range(0, len(times), 7):
        for j in range(i, len(times)):
            window_s = (times[j] - times[i]) / 1e9
            assert j - i + 1 <= (window_s + 0.1) * 100 + 2, (i, j)
    assert sched.output_rate_drafts.stats.num_charged_late == 0
