"""The output-rate schedulers on the real vLLM scheduler and KV manager (of each release).

Fakes, at narrow seams only: the clock (``FakeClock``) and the model runner
(hand-built ``ModelRunnerOutput``s, one token per sampling request).
"""

from __future__ import annotations

from collections import Counter

import pytest
from vllm.v1.request import RequestStatus

from engine_ext.limiter import ANONYMOUS_USER, NS_PER_S, OutputRateLimiter
from harness.scheduler import (
    FakeClock,
    Trace,
    drive,
    make_request,
    make_scheduler,
)

MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def assert_window_bound(times: list[int], rate: int) -> None:
    times = sorted(times)
    for i in range(len(times)):
        for j in range(i, len(times)):
            window_s = (times[j] - times[i]) / NS_PER_S
            assert j - i + 1 <= (window_s + 0.1) * rate + 1 + 1e-9, (i, j, window_s)


def tokens_of(trace: Trace, requests: list) -> list[int]:
    return trace.times_of({r.request_id for r in requests})


class CountingLimiter(OutputRateLimiter):
    """The real limiter, also counting net grants per user (a spy, not a fake)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.net_taken: Counter[str] = Counter()

    def try_take(self, user: str) -> bool:
        ok = super().try_take(user)
        self.net_taken[user] += ok
        return ok

    def take_many(self, num_wanted) -> dict[str, int]:
        num_got = super().take_many(num_wanted)
        for user, num in num_wanted.items():
            self.net_taken[user] += num_got.get(user, num)
        return num_got

    def refund(self, user: str, num: int = 1) -> None:
        super().refund(user, num)
        self.net_taken[user] -= num


def spy_limiter(scheduler, clock: FakeClock) -> CountingLimiter:
    old = scheduler.output_rate_limiter
    spy = CountingLimiter(old.default_rate, old.user_rates(), clock_ns=clock)
    scheduler.output_rate_limiter = spy
    return spy


@MODES
@pytest.mark.parametrize("num_streams", [1, 4])
def test_window_bound_per_user(async_scheduling: bool, num_streams: int) -> None:
    clock = FakeClock()
    sched = make_scheduler(
        async_scheduling=async_scheduling, user_rates={"a": 20, "b": 100}, clock=clock
    )
    a = [make_request("a", max_tokens=200) for _ in range(num_streams)]
    b = [make_request("b", max_tokens=200)]
    for r in a + b:
        sched.add_request(r)
    trace = drive(sched, num_steps=400, clock=clock, step_ms=10)  # 4 s
    times_a, times_b = tokens_of(trace, a), tokens_of(trace, b)
    assert_window_bound(times_a, 20)
    assert_window_bound(times_b, 100)
    # Long-run rate reaches the limit (the engine could go at 100 tok/s/stream).
    assert len(times_a) >= 0.95 * 20 * 4
    assert len(times_b) >= 0.95 * 100 * 2  # b finishes 200 tokens in ~2 s
    assert b[0].request_id in trace.finished


@MODES
def test_throttled_user_does_not_slow_an_unthrottled_one(async_scheduling: bool) -> None:
    def run_c(with_throttled_a: bool) -> list[int]:
        clock = FakeClock()
        sched = make_scheduler(
            async_scheduling=async_scheduling,
            user_rates={"a": 5, "c": None},
            max_num_seqs=12,
            max_num_active_seqs=4,
            clock=clock,
        )
        c = make_request("c", max_tokens=100)
        sched.add_request(c)
        a = [make_request("a", max_tokens=100) for _ in range(8)]
        if with_throttled_a:
            for r in a:
                sched.add_request(r)
        trace = drive(sched, num_steps=80, clock=clock, step_ms=10)
        if with_throttled_a:
            assert_window_bound(tokens_of(trace, a), 5)
        return tokens_of(trace, [c])

    alone = run_c(with_throttled_a=False)
    beside = run_c(with_throttled_a=True)
    # c is served every step either way: the same tokens at the same steps.
    assert len(alone) >= 78
    assert beside == alone


@MODES
def test_throttled_requests_resume_and_finish_with_all_tokens(async_scheduling: bool) -> None:
    clock = FakeClock()
    sched = make_scheduler(async_scheduling=async_scheduling, default_rate=50, clock=clock)
    reqs = [make_request("a", max_tokens=30) for _ in range(4)]
    for r in reqs:
        sched.add_request(r)
    trace = drive(sched, num_steps=400, clock=clock, step_ms=10)
    assert trace.finished == {r.request_id for r in reqs}
    per_request = Counter(req_id for _, req_id in trace.samples)
    assert all(per_request[r.request_id] == 30 for r in reqs)
    assert all(len(r.output_token_ids) == 30 for r in reqs)


@MODES
def test_same_user_streams_take_turns(async_scheduling: bool) -> None:
    clock = FakeClock()
    sched = make_scheduler(async_scheduling=async_scheduling, user_rates={"a": 10}, clock=clock)
    reqs = [make_request("a", max_tokens=100) for _ in range(4)]
    for r in reqs:
        sched.add_request(r)
    trace = drive(sched, num_steps=300, clock=clock, step_ms=10)  # 3 s: ~31 tokens
    per_request = Counter(req_id for _, req_id in trace.samples)
    counts = [per_request[r.request_id] for r in reqs]
    assert sum(counts) >= 28
    assert max(counts) - min(counts) <= 1, counts


@MODES
def test_throttled_requests_stay_resident_and_free_their_active_slot(
    async_scheduling: bool,
) -> None:
    clock = FakeClock()
    sched = make_scheduler(
        async_scheduling=async_scheduling,
        user_rates={"a": 20},
        max_num_seqs=8,
        max_num_active_seqs=2,
        clock=clock,
    )
    a = [make_request("a", max_tokens=50) for _ in range(2)]
    for r in a:
        sched.add_request(r)
    drive(sched, num_steps=5, clock=clock, step_ms=10)
    # a is mostly out of budget: both streams are throttled but resident.
    assert all(r.status == RequestStatus.RUNNING for r in a)
    blocks_before = {r.request_id: sched.kv_cache_manager.get_block_ids(r.request_id) for r in a}
    others = [make_request(f"u{i}", max_tokens=50) for i in range(2)]
    for r in others:
        sched.add_request(r)
    trace = drive(sched, num_steps=20, clock=clock, step_ms=10)
    # The other users were admitted into the slots a is not using, and ran.
    assert all(r.status == RequestStatus.RUNNING for r in others)
    assert all(len(tokens_of(trace, [r])) >= 12 for r in others)
    assert_window_bound(tokens_of(trace, a), 20)
    assert len(sched.running) == 4
    assert all(r in sched.running for r in a)
    for r in a:
        assert sched.kv_cache_manager.get_block_ids(r.request_id) == blocks_before[r.request_id]
    # The active limit still holds: at most 2 requests per step.
    out = sched.schedule()
    assert len(out.num_scheduled_tokens) <= 2


@MODES
def test_active_slots_go_to_least_recently_served_users(async_scheduling: bool) -> None:
    clock = FakeClock()
    # Three users, two streams each, one active slot: throttling lets all six
    # be resident, and the single slot must rotate fairly across users.
    sched = make_scheduler(
        async_scheduling=async_scheduling,
        default_rate=40,
        max_num_seqs=6,
        max_num_active_seqs=1,
        clock=clock,
    )
    users = ["x", "y", "z"]
    reqs = {u: [make_request(u, max_tokens=400) for _ in range(2)] for u in users}
    # Throttle everyone once so all six become resident.
    for u in users:
        for _ in range(6):
            sched.output_rate_limiter.try_take(u)
    for u in users:
        for r in reqs[u]:
            sched.add_request(r)
    trace = drive(sched, num_steps=600, clock=clock, step_ms=10)
    per_user = {u: len(tokens_of(trace, reqs[u])) for u in users}
    total = sum(per_user.values())
    assert total >= 500  # the slot is rarely idle
    for u in users:
        assert per_user[u] >= 0.25 * total, per_user


@MODES
def test_refunds_keep_accounting_exact_under_kv_pressure(async_scheduling: bool) -> None:
    clock = FakeClock()
    # 12 blocks of 16 tokens for 4 requests that each grow to 8 + 60 tokens
    # (5 blocks): they cannot all fit, so requests are preempted and resumed.
    sched = make_scheduler(
        async_scheduling=async_scheduling,
        user_rates={"a": 200, "b": 30},
        num_blocks=12,
        max_num_seqs=4,
        clock=clock,
    )
    spy = spy_limiter(sched, clock)
    reqs = [make_request(u, max_tokens=60) for u in ("a", "a", "b", "b")]
    for r in reqs:
        sched.add_request(r)
    trace = drive(sched, num_steps=800, clock=clock, step_ms=10)
    preemptions = sum(r.num_preemptions for r in reqs)
    assert preemptions > 0
    assert trace.finished == {r.request_id for r in reqs}
    sampled = Counter(sched_user for sched_user in (req_user(trace, reqs)))
    # Every charged token was sampled: nothing lost to refunds, nothing free.
    assert spy.net_taken["a"] == sampled["a"] == 120
    assert spy.net_taken["b"] == sampled["b"] == 120
    assert_window_bound(tokens_of(trace, reqs[2:]), 30)


def req_user(trace: Trace, reqs: list) -> list[str]:
    users = {r.request_id: r.sampling_params.extra_args["output_rate_user"] for r in reqs}
    return [users[req_id] for _, req_id in trace.samples]


@MODES
def test_throttled_requests_are_preempted_first(async_scheduling: bool) -> None:
    clock = FakeClock()
    sched = make_scheduler(
        async_scheduling=async_scheduling,
        user_rates={"slow": 1},
        num_blocks=11,  # 10 usable: 3 blocks for each of the three prompts, 1 spare
        max_num_seqs=4,
        clock=clock,
    )
    slow = make_request("slow", max_tokens=100, num_prompt_tokens=40)  # 3 blocks
    sched.add_request(slow)
    drive(sched, num_steps=3, clock=clock, step_ms=10)
    assert slow.status == RequestStatus.RUNNING
    fast = [make_request("fast", max_tokens=100, num_prompt_tokens=40) for _ in range(2)]
    for r in fast:
        sched.add_request(r)
    drive(sched, num_steps=40, clock=clock, step_ms=10)
    # The fast streams outgrow the cache; the throttled stream gave way.
    assert slow.num_preemptions >= 1
    assert all(r.num_preemptions == 0 for r in fast)


@MODES
def test_waiting_requests_of_a_user_without_budget_are_not_admitted(
    async_scheduling: bool,
) -> None:
    clock = FakeClock()
    sched = make_scheduler(async_scheduling=async_scheduling, user_rates={"a": 1}, clock=clock)
    first = make_request("a", max_tokens=100)
    sched.add_request(first)
    drive(sched, num_steps=3, clock=clock, step_ms=10)
    assert len(first.output_token_ids) == 1
    second = make_request("a", max_tokens=5)
    sched.add_request(second)
    drive(sched, num_steps=20, clock=clock, step_ms=10)
    assert second.status == RequestStatus.WAITING
    assert second.num_computed_tokens == 0
    ready = sched.output_rate_limiter.ready_at_ns("a")
    assert sched.output_rate_planner.wakeup_ns == ready
    assert 0 < sched.output_rate_wait_s() <= 0.05
    clock.now_ns = ready
    drive(sched, num_steps=2, clock=clock, step_ms=1)
    assert len(first.output_token_ids) + len(second.output_token_ids) == 2


@MODES
def test_requests_without_user_share_the_anonymous_bucket(async_scheduling: bool) -> None:
    clock = FakeClock()
    sched = make_scheduler(
        async_scheduling=async_scheduling,
        user_rates={ANONYMOUS_USER: 10, "named": None},
        clock=clock,
    )
    anon = [make_request(None, max_tokens=100) for _ in range(3)]
    named = make_request("named", max_tokens=100)
    for r in [*anon, named]:
        sched.add_request(r)
    trace = drive(sched, num_steps=200, clock=clock, step_ms=10)
    times = tokens_of(trace, anon)
    assert_window_bound(times, 10)
    assert len(times) >= 19
    assert named.request_id in trace.finished


@MODES
def test_chunked_prefill_charges_only_the_sampling_chunk(async_scheduling: bool) -> None:
    clock = FakeClock()
    sched = make_scheduler(
        async_scheduling=async_scheduling,
        user_rates={"a": 1},
        max_num_batched_tokens=64,
        clock=clock,
    )
    spy = spy_limiter(sched, clock)
    long = make_request("a", num_prompt_tokens=300, max_tokens=3)
    sched.add_request(long)
    trace = drive(sched, num_steps=6, clock=clock, step_ms=10)
    # Five chunks of 64 tokens: only the last one samples and is charged.
    assert len(tokens_of(trace, [long])) == 1
    assert spy.net_taken["a"] == 1


def test_all_throttled_step_schedules_nothing() -> None:
    clock = FakeClock()
    sched = make_scheduler(default_rate=1, clock=clock)
    reqs = [make_request(f"u{i}", max_tokens=10) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    drive(sched, num_steps=2, clock=clock, step_ms=10)
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == 0
    assert sched.has_requests()
    assert sched.output_rate_planner.wakeup_ns is not None
    assert sched.output_rate_wait_s() == pytest.approx(0.05)


@MODES
def test_hot_swapped_limit_applies_at_the_next_step(async_scheduling: bool) -> None:
    clock = FakeClock()
    sched = make_scheduler(async_scheduling=async_scheduling, user_rates={"a": 10}, clock=clock)
    r = make_request("a", max_tokens=1000)
    sched.add_request(r)
    before = drive(sched, num_steps=200, clock=clock, step_ms=10)
    sched.output_rate_limiter.set_rate("a", 50)
    changed_at = clock.now_ns
    after = drive(sched, num_steps=200, clock=clock, step_ms=10)
    assert 19 <= len(before.samples) <= 22
    times = [t for t, _ in after.samples if t >= changed_at]
    assert 0.95 * 100 <= len(times) <= 2 * 50 + 0.1 * 50 + 1 + 1


@MODES
def test_the_user_table_holds_the_requests_the_scheduler_holds_and_no_more(
    async_scheduling: bool,
) -> None:
    clock = FakeClock()
    sched = make_scheduler(
        async_scheduling=async_scheduling, user_rates={"a": 1000}, max_num_seqs=2, clock=clock
    )
    short = [make_request("a", max_tokens=3) for _ in range(4)]
    long = make_request("b", max_tokens=80)
    for request in [*short, long]:
        sched.add_request(request)
    sched.finish_requests(short[3].request_id, RequestStatus.FINISHED_ABORTED)  # while waiting
    drive(sched, num_steps=30, clock=clock, step_ms=10)
    sched.schedule()  # drops what the last update freed
    assert list(sched.output_rate_users) == [long]
    assert list(sched.requests.values()) == [long]


@MODES
def test_a_streaming_sessions_next_inputs_keep_the_sessions_entry(async_scheduling: bool) -> None:
    clock = FakeClock()
    sched = make_scheduler(async_scheduling=async_scheduling, user_rates={"a": 1000}, clock=clock)

    def session_input(*, resumable: bool = True):  # type: ignore[no-untyped-def]
        request = make_request("a", max_tokens=3, request_id="session")
        request.resumable = resumable
        return request

    session = session_input()
    sched.add_request(session)
    drive(sched, num_steps=10, clock=clock, step_ms=10)
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    sched.add_request(session_input())  # the next input chunk, merged into the session
    assert list(sched.output_rate_users) == [session]
    assert session.status == RequestStatus.WAITING
    drive(sched, num_steps=10, clock=clock, step_ms=10)
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ  # served, paused again
    sched.add_request(session_input(resumable=False))  # the end of the session
    sched.schedule()
    assert session.status == RequestStatus.FINISHED_ABORTED
    assert not sched.output_rate_users and not sched.requests
