"""GCRA limiter, driven by a fake clock (the only fake: time)."""

from __future__ import annotations

import random

import pytest

from engine_ext.limiter import NS_PER_S, OutputRateLimiter

MS = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 5 * NS_PER_S

    def __call__(self) -> int:
        return self.now


def greedy_run(
    limiter: OutputRateLimiter, clock: Clock, user: str, *, duration_s: float, seed: int
) -> list[int]:
    """At random small intervals, take until refused; return the grant times."""
    rng = random.Random(seed)
    end = clock.now + int(duration_s * NS_PER_S)
    granted = []
    while clock.now < end:
        while limiter.try_take(user):
            granted.append(clock.now)
        clock.now += rng.randint(1, 30) * MS
    return granted


def assert_window_bound(times: list[int], rate: float, *, max_window_s: float) -> None:
    """In any window [t_i, t_j] at most (W + 0.1) * rate + 1 tokens."""
    for i in range(len(times)):
        for j in range(i, len(times)):
            window_ns = times[j] - times[i]
            if window_ns > max_window_s * NS_PER_S:
                break
            allowed = (window_ns / NS_PER_S + 0.1) * rate + 1
            assert j - i + 1 <= allowed + 1e-9, (i, j, window_ns)


@pytest.mark.parametrize("rate", [1, 7, 20, 100, 1000])
def test_window_bound_holds_for_a_greedy_user(rate: int) -> None:
    clock = Clock()
    limiter = OutputRateLimiter(rate, clock_ns=clock)
    times = greedy_run(limiter, clock, "u", duration_s=6, seed=rate)
    assert times
    assert_window_bound(times, rate, max_window_s=3)


@pytest.mark.parametrize("rate", [20, 100, 777])
def test_long_run_rate_is_the_limit(rate: int) -> None:
    clock = Clock()
    limiter = OutputRateLimiter(rate, clock_ns=clock)
    times = greedy_run(limiter, clock, "u", duration_s=100, seed=1)
    measured = (len(times) - 1) / ((times[-1] - times[0]) / NS_PER_S)
    assert measured == pytest.approx(rate, rel=0.005)


def test_refund_restores_exactly_one_token() -> None:
    clock = Clock()
    limiter = OutputRateLimiter(10, clock_ns=clock)
    # burst 100 ms at 10 tok/s: two tokens at once, then refused.
    assert limiter.try_take("u")
    assert limiter.try_take("u")
    assert not limiter.try_take("u")
    limiter.refund("u")
    assert limiter.try_take("u")
    assert not limiter.try_take("u")


def test_ready_at_is_exactly_when_the_next_token_is_allowed() -> None:
    clock = Clock()
    limiter = OutputRateLimiter(10, clock_ns=clock)
    while limiter.try_take("u"):
        pass
    ready = limiter.ready_at_ns("u")
    assert ready > clock.now
    clock.now = ready - 1
    assert not limiter.try_take("u")
    clock.now = ready
    assert limiter.try_take("u")


def test_users_have_separate_budgets_and_overrides() -> None:
    clock = Clock()
    limiter = OutputRateLimiter(10, {"vip": 1000, "free": None}, clock_ns=clock)
    assert sum(limiter.try_take("a") for _ in range(100)) == 2
    assert sum(limiter.try_take("b") for _ in range(100)) == 2
    assert sum(limiter.try_take("vip") for _ in range(1000)) == 101
    assert all(limiter.try_take("free") for _ in range(10_000))
    assert limiter.rate_of("free") is None
    assert limiter.num_tracked_users == 3  # unlimited users keep no state


def test_lowering_a_limit_never_stalls_longer_than_one_new_interval() -> None:
    clock = Clock()
    limiter = OutputRateLimiter(1000, clock_ns=clock)
    while limiter.try_take("u"):
        pass
    limiter.set_rate("u", 2)  # new interval 500 ms
    assert limiter.ready_at_ns("u") - clock.now <= NS_PER_S // 2
    clock.now = limiter.ready_at_ns("u")
    assert limiter.try_take("u")


def test_raising_a_limit_speeds_up_at_once() -> None:
    clock = Clock()
    limiter = OutputRateLimiter(1, clock_ns=clock)
    while limiter.try_take("u"):
        pass
    stalled_until = limiter.ready_at_ns("u")
    limiter.set_rate("u", 1000)
    assert limiter.ready_at_ns("u") <= stalled_until
    clock.now += 2 * MS
    assert limiter.try_take("u")
    times = greedy_run(limiter, clock, "u", duration_s=2, seed=3)
    assert len(times) >= 0.95 * 2 * 1000


def test_hot_swap_keeps_the_window_bound_across_changes() -> None:
    clock = Clock()
    limiter = OutputRateLimiter(50, clock_ns=clock)
    times = greedy_run(limiter, clock, "u", duration_s=3, seed=4)
    limiter.set_default_rate(20)
    changed_at = clock.now
    after = greedy_run(limiter, clock, "u", duration_s=3, seed=5)
    assert_window_bound([t for t in after if t >= changed_at], 20, max_window_s=3)
    assert times


def test_a_rate_moved_up_and_down_adds_no_burst() -> None:
    """A greedy user whose rate swings 10 <-> 1,000 tokens/s every 300 ms (a fleet share
    moving between engines) gets at most the integral of its rate + 0.1 s of its highest
    rate + 1 token over the whole run: a raise keeps the tokens the user may take at once
    and the larger burst fills at the new rate. Re-pricing the debt at the new rate (the
    rule before) handed out 0.1 s of each raise at once: 99 tokens per swing."""
    clock = Clock()
    limiter = OutputRateLimiter(None, {"u": 10}, clock_ns=clock)
    rng = random.Random(9)
    num_taken = 0
    integral = 0.0
    for swing in range(40):
        rate = 1000 if swing % 2 else 10
        limiter.set_rate("u", rate)
        start, end = clock.now, clock.now + 300 * MS
        while clock.now < end:
            while limiter.try_take("u"):
                num_taken += 1
            clock.now += rng.randint(1, 5) * MS
        integral += rate * (clock.now - start) / NS_PER_S
    assert num_taken <= integral + 0.1 * 1000 + 1
    assert num_taken >= integral - 40 * 2  # and the user still gets its rate


def test_raising_an_idle_users_rate_fills_the_larger_burst_at_the_new_rate() -> None:
    clock = Clock()
    limiter = OutputRateLimiter(None, {"u": 10}, clock_ns=clock)
    clock.now += NS_PER_S  # idle: its whole burst (1 token at 10/s, + 1) is there
    limiter.try_take("u")
    clock.now += NS_PER_S
    limiter.set_rate("u", 1000)
    assert limiter.num_available("u", 1000) == 2  # what it had, not 0.1 s of the raise
    clock.now += 100 * MS
    assert limiter.num_available("u", 1000) == 101  # filled at 1,000/s


def test_clear_rate_and_replace_all() -> None:
    clock = Clock()
    limiter = OutputRateLimiter(None, {"a": 5}, clock_ns=clock)
    assert not limiter.is_unlimited
    limiter.clear_rate("a")
    assert limiter.is_unlimited
    assert limiter.rate_of("a") is None
    limiter.replace_all(7, {"b": None, "c": 3})
    assert (limiter.rate_of("a"), limiter.rate_of("b"), limiter.rate_of("c")) == (7, None, 3)
    limiter.replace_all(None, {"b": None})
    assert limiter.is_unlimited
    assert limiter.num_tracked_users == 0


def test_cleanup_never_changes_a_decision() -> None:
    clock_a, clock_b = Clock(), Clock()
    kept = OutputRateLimiter(30, {"x": 5, "y": 200}, clock_ns=clock_a)
    cleaned = OutputRateLimiter(30, {"x": 5, "y": 200}, clock_ns=clock_b)
    rng = random.Random(7)
    users = ["x", "y", "z", "w"]
    for step in range(20_000):
        user = rng.choice(users)
        assert kept.try_take(user) == cleaned.try_take(user), step
        if rng.random() < 0.05:
            cleaned.cleanup_idle_users()
        dt = rng.choice([0, 1, 5, 40, 300]) * MS
        clock_a.now += dt
        clock_b.now += dt
    cleaned.cleanup_idle_users()
    assert cleaned.num_tracked_users <= kept.num_tracked_users


def test_cleanup_drops_idle_users() -> None:
    clock = Clock()
    limiter = OutputRateLimiter(10, clock_ns=clock)
    for user in ("a", "b", "c"):
        limiter.try_take(user)
    clock.now += NS_PER_S
    limiter.cleanup_idle_users()
    assert limiter.num_tracked_users == 0


@pytest.mark.parametrize(
    ("rate", "error"),
    [
        (0, ValueError),
        (-5, ValueError),
        (1_000_001, ValueError),
        (2.5, TypeError),
        (float("nan"), TypeError),
        ("10", TypeError),
        (True, TypeError),
    ],
)
def test_bad_rates_raise_a_clear_error(rate: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="default_rate"):
        OutputRateLimiter(rate)  # type: ignore[arg-type]
    limiter = OutputRateLimiter(None)
    with pytest.raises(error, match="user 'u'"):
        limiter.set_rate("u", rate)  # type: ignore[arg-type]
    with pytest.raises(error, match="default_rate"):
        limiter.set_default_rate(rate)  # type: ignore[arg-type]
    assert limiter.rate_of("u") is None  # nothing changed


@pytest.mark.parametrize("burst_ns", [0, 100 * MS, 250 * MS])
def test_take_many_is_n_try_takes_at_one_instant(burst_ns: int) -> None:
    clock_a, clock_b = Clock(), Clock()
    rates = {"x": 5, "y": 200, "free": None, "fast": 1_000_000}
    batched = OutputRateLimiter(30, rates, burst_ns=burst_ns, clock_ns=clock_a)
    single = OutputRateLimiter(30, rates, burst_ns=burst_ns, clock_ns=clock_b)
    rng = random.Random(3)
    users = ["x", "y", "z", "w", "free", "fast"]
    for step in range(5_000):
        wanted = {u: rng.randint(1, 40) for u in rng.sample(users, rng.randint(1, len(users)))}
        got = {}
        for user, num in wanted.items():
            got[user] = 0
            while got[user] < num and single.try_take(user):
                got[user] += 1
        short = batched.take_many(wanted)
        assert short == {u: n for u, n in got.items() if n < wanted[u]}, step
        for user in wanted:
            for _ in range(rng.choice([0, 0, 1, 3])):
                batched.refund(user)
                single.refund(user)
            assert batched.ready_at_ns(user) == single.ready_at_ns(user), step
        if rng.random() < 0.02:
            rate = rng.choice([1, 5, 50])
            batched.set_rate("x", rate)
            single.set_rate("x", rate)
        dt = rng.choice([0, 1, 5, 40, 300]) * MS
        clock_a.now += dt
        clock_b.now += dt


@pytest.mark.parametrize("milli", [500, 2_500, 33_333])
def test_a_fractional_share_holds_the_window_bound_and_its_long_run_rate(milli: int) -> None:
    # Fleet shares are milli-tokens/s: 0.5, 2.5 and 33.333 tokens/s here.
    clock = Clock()
    limiter = OutputRateLimiter(None, clock_ns=clock)
    limiter.set_milli_rate("u", milli)
    times = greedy_run(limiter, clock, "u", duration_s=60, seed=milli)
    rate = milli / 1000
    assert_window_bound(times, rate, max_window_s=20)
    assert len(times) <= 60 * rate + 0.1 * rate + 1
    assert len(times) >= 60 * rate - 1 - rate  # the greedy user is held at its share, not below
    assert limiter.rate_of("u") == rate


def test_bad_milli_rates_raise() -> None:
    limiter = OutputRateLimiter(None)
    for bad in (0, -1, 1.5, True, 10**12):
        with pytest.raises(ValueError):
            limiter.set_milli_rate("u", bad)  # type: ignore[arg-type]


# ---- shadow limits ---------------------------------------------------------------


def test_a_shadow_user_is_unlimited_to_the_hot_path_and_charged_like_take_many() -> None:
    """shadow_take on a shadow user refuses (counts) exactly what take_many refuses
    the same user enforced, call for call, and the hot path never refuses it."""
    clock = Clock()
    shadow = OutputRateLimiter(None, clock_ns=clock)
    enforced = OutputRateLimiter(None, clock_ns=clock)
    shadow.set_milli_rate("a", 30_000, shadow=True)
    enforced.set_milli_rate("a", 30_000)
    assert not shadow.is_unlimited and shadow.has_shadow and shadow.is_shadow("a")
    assert shadow.rate_of("a") == 30 and shadow.user_rates() == {"a": 30}
    rng = random.Random(3)
    num_refused = 0
    for _ in range(500):
        clock.now += rng.randrange(0, 40) * MS
        num = rng.randint(1, 6)
        assert shadow.take_many({"a": num}) == {}  # unlimited to the plan
        assert shadow.num_available("a", num) == num
        short = enforced.take_many({"a": num})
        would = shadow.shadow_take({"a": num, "unlimited": 3})
        assert would.get("a", 0) == num - short.get("a", num)
        assert shadow.ready_at_ns("a") == 0  # no enforced state
        num_refused += would.get("a", 0)
    assert num_refused > 100


def test_switching_enforcement_carries_the_gcra_state_over() -> None:
    clock = Clock()
    limiter = OutputRateLimiter(None, clock_ns=clock)
    limiter.set_milli_rate("a", 10_000, shadow=True)
    assert limiter.shadow_take({"a": 50}) == {"a": 48}  # a burst of 100 ms at 10/s: 2
    limiter.set_milli_rate("a", 10_000)  # enforce: its shadow use counts
    assert not limiter.try_take("a")
    clock.now += 100 * MS
    assert limiter.take_many({"a": 5}) == {"a": 1}
    # Back to shadow at twice the rate: it keeps its credit (one token less than none: it
    # owes 2, its burst was 1), so at 20/s none fits for 50 ms, then one.
    limiter.set_milli_rate("a", 20_000, shadow=True)
    assert limiter.try_take("a") and limiter.shadow_take({"a": 2}) == {"a": 2}
    clock.now += 50 * MS
    assert limiter.shadow_take({"a": 2}) == {"a": 1}
    # The default in shadow: users without their own entry are counted at its rate.
    limiter.set_default_milli_rate(10_000, shadow=True)
    assert limiter.is_shadow("b") and limiter.default_rate == 10
    assert limiter.shadow_take({"b": 4}) == {"b": 2}
    limiter.set_default_milli_rate(10_000)  # enforced now, from b's recent use
    assert not limiter.try_take("b")
    limiter.clear_rate("a")
    assert not limiter.try_take("a")  # a's state follows it to the (enforced) default
    limiter.replace_all_milli(5_000, {"a": 5_000}, default_shadow=True, shadow_users=["a"])
    assert limiter.is_shadow("a") and limiter.is_shadow("b") and limiter.try_take("b")
    clock.now += 10 * NS_PER_S
    limiter.cleanup_idle_users()
    assert limiter.num_tracked_users == 0
    # Idle shadow state is forgotten too: fresh, 1 token of burst at 5/s.
    assert limiter.shadow_take({"a": 2, "b": 2}) == {"a": 1, "b": 1}


def test_with_clock_keeps_shadow_rates() -> None:
    limiter = OutputRateLimiter(None)
    limiter.set_milli_rate("a", 7_000, shadow=True)
    limiter.set_default_milli_rate(3_000, shadow=True)
    copy = limiter.with_clock(Clock())
    assert copy.is_shadow("a") and copy.default_is_shadow and copy.rate_of("a") == 7


# ---- borrowing (docs/scheduler.md, "Borrowing") -----------------------------------


def borrowing_limiter(clock: Clock) -> OutputRateLimiter:
    limiter = OutputRateLimiter(None, {"a": 20, "b": 60, "u": None}, clock_ns=clock)
    limiter.set_milli_ceiling("a", 100_000)
    limiter.set_milli_ceiling("b", 600_000)
    limiter.set_milli_ceiling("u", 600_000)
    return limiter


def test_borrowed_tokens_are_bounded_by_the_ceiling_less_the_rate_and_leave_the_rate_alone() -> (
    None
):
    clock = Clock()
    limiter = borrowing_limiter(clock)
    assert limiter.has_ceilings
    assert limiter.borrow_milli_of("a") == 80_000
    lent: list[int] = []
    end = clock.now + 3 * NS_PER_S
    while clock.now < end:
        while limiter.try_borrow("a"):
            lent.append(clock.now)
        clock.now += 7 * MS
    # The extra rate's GCRA bound: (W + 0.1) x 80 + 1 in every window.
    assert_window_bound(lent, 80, max_window_s=3.0)
    assert len(lent) >= 80 * 2.9
    # The rate's state is untouched: a full burst is there.
    assert limiter.num_available("a", 100) == 3


def test_refund_borrowed_undoes_the_loan_exactly() -> None:
    clock = Clock()
    limiter = borrowing_limiter(clock)
    while limiter.try_borrow("a"):
        pass
    tag = limiter.borrow_tag("a")
    limiter.refund_borrowed("a", 2)
    assert limiter.borrow_tag("a") < tag
    assert limiter.try_borrow("a") and limiter.try_borrow("a")
    assert not limiter.try_borrow("a")


def test_borrowers_are_ordered_by_tokens_per_unit_of_rate_and_bank_no_idle_time() -> None:
    clock = Clock()
    limiter = borrowing_limiter(clock)
    # Lend 400 tokens one at a time to the lowest tag: 1:3 for rates 20 and 60.
    num_lent = {"a": 0, "b": 0}
    for _ in range(400):
        user = min(("a", "b"), key=lambda u: (limiter.borrow_tag(u), u))
        assert limiter.try_borrow(user)
        num_lent[user] += 1
        clock.now += 10 * MS
    assert num_lent == {"a": 100, "b": 300}
    # "a" is away while "b" borrows on; back, it is lifted to the last tag lent: it
    # does not get the capacity to itself to catch up.
    for _ in range(300):
        assert limiter.try_borrow("b")
        clock.now += 10 * MS
    assert limiter.borrow_tag("a") == limiter.borrow_tag("b") - NS_PER_S * 1000 // 60_000


def test_a_loan_out_of_the_fair_order_charges_the_borrower_and_leaves_the_clock() -> None:
    clock = Clock()
    limiter = borrowing_limiter(clock)
    for _ in range(3):  # "a" is ahead: 3 x 50 ms of virtual time
        assert limiter.try_borrow("a")
    assert limiter.try_borrow("b")
    tag_a, tag_b = limiter.borrow_tag("a"), limiter.borrow_tag("b")
    # Lent at admission (queue order) although "b" is behind: "a" pays, and "b" is not
    # lifted to "a"'s tag (it keeps what it is owed).
    assert limiter.try_borrow("a", in_order=False)
    assert limiter.borrow_tag("a") == tag_a + NS_PER_S * 1000 // 20_000
    assert limiter.borrow_tag("b") == tag_b
    # In order, the same loan moves the clock to its tag: "b" is lifted to it.
    assert limiter.try_borrow("a")
    assert limiter.borrow_tag("b") == tag_a + NS_PER_S * 1000 // 20_000


def test_only_an_enforced_finite_rate_below_its_ceiling_borrows() -> None:
    clock = Clock()
    limiter = borrowing_limiter(clock)
    assert limiter.borrow_milli_of("u") is None  # unlimited
    assert not limiter.try_borrow("u")
    limiter.set_milli_rate("b", 60_000, shadow=True)
    assert limiter.borrow_milli_of("b") is None  # shadow: unlimited to the plan
    assert limiter.borrow_milli_of("nobody") is None  # no default rate
    limiter.set_milli_ceiling("a", 20_000)
    assert limiter.borrow_milli_of("a") is None  # a ceiling at the rate lends nothing
    limiter.set_default_rate(10)
    limiter.set_default_milli_ceiling(50_000)
    assert limiter.borrow_milli_of("nobody") == 40_000
    limiter.clear_ceiling("a")
    assert limiter.borrow_milli_of("a") == 30_000  # the default's ceiling over its rate
    limiter.set_milli_ceiling("a", None)
    assert limiter.borrow_milli_of("a") is None  # its own "none" wins over the default's
    limiter.replace_ceilings(None, {})
    assert not limiter.has_ceilings


def test_a_rate_change_rescales_the_borrowed_state() -> None:
    clock = Clock()
    limiter = borrowing_limiter(clock)
    while limiter.try_borrow("a"):
        pass
    limiter.set_rate("a", 90)  # extra rate 80 -> 10 tok/s: lowering keeps the TAT in time
    clock.now += 120 * MS
    assert limiter.try_borrow("a")
    assert limiter.borrow_milli_of("a") == 10_000


def test_with_clock_keeps_the_ceilings() -> None:
    limiter = borrowing_limiter(Clock())
    copy = limiter.with_clock(Clock())
    assert copy.ceiling_milli_of("a") == 100_000 and copy.borrow_milli_of("b") == 540_000
