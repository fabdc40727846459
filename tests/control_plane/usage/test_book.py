"""Usage aggregation, with a fake clock (the one seam)."""

from __future__ import annotations

import pytest

from control_plane.usage.book import (
    MAX_REPORT_BURST,
    MAX_REPORTS_PER_S,
    PART_TIMEOUT_S,
    USAGE_BURST_S,
    UsageBook,
)
from output_rate_core import protocol as p
from tests.control_plane.factories import FakeClock


def test_rates_are_summed_over_engines_and_windows_expire() -> None:
    clock = FakeClock()
    book = UsageBook(clock)
    for _ in range(10):  # engine e1: 20 tokens/s for 10 s, half its steps throttled
        clock.now += 1.0
        book.add(p.Usage("e1", 1.0, {"a": 20}, {"a": 20}))
    book.add(p.Usage("e2", 2.0, {"a": 10, "b": 4}, {}))  # engine e2: 5 tokens/s of a
    (a, b) = book.totals()
    assert (a.user, b.user) == ("a", "b")
    assert a.tokens_per_s_10s == pytest.approx(25.0)
    assert a.tokens_per_s_1s == pytest.approx(25.0)  # each engine's latest report
    assert b.tokens_per_s_10s == pytest.approx(2.0)
    assert a.throttled_fraction == pytest.approx(200 / (210 + 200))
    assert b.throttled_fraction == 0.0
    clock.now += 2.5  # the latest reports are no longer "the last second"
    (a, _) = book.totals()
    assert a.tokens_per_s_1s == 0.0 and a.tokens_per_s_10s > 0
    clock.now += 10.0
    assert book.totals() == []


def test_one_users_rate_is_what_totals_says_of_it() -> None:
    clock = FakeClock()
    book = UsageBook(clock)
    for second in range(6):
        clock.now += 1.0
        book.add(p.Usage("e1", 1.0, {"a": 20 + second, "b": 3}, {"c": 1}))
        book.add(p.Usage("e2", 0.5, {"a": 4, "d": 1 + second}, {}))
    for elapsed in (0.0, 1.5, 2.5, 11.0):
        clock.now += elapsed
        totals = {u.user: u.tokens_per_s_1s for u in book.totals()}
        assert {user: book.rate_1s(user) for user in "abcdz"} == {
            user: totals.get(user) for user in "abcdz"
        }
    assert book.rate_1s("a") is None  # every report has left the window


R = p.MAX_ENGINE_TOKENS_PER_S


def refused(book: UsageBook) -> dict[str, int]:
    return {reason: n for reason, n in book.refused.counts().items() if n}


def test_reports_beyond_an_engines_pace_are_refused_and_counted() -> None:
    clock = FakeClock()
    book = UsageBook(clock)
    taken = [book.add(p.Usage("e1", 1.0, {"a": 1}, {})) for _ in range(20)]
    assert taken == [True] * MAX_REPORT_BURST + [False] * (20 - MAX_REPORT_BURST)
    assert book.add(p.Usage("e2", 1.0, {"a": 1}, {}))  # each engine has its own pace
    clock.now += 1.0
    taken = [book.add(p.Usage("e1", 1.0, {"a": 1}, {})) for _ in range(10)]
    assert sum(taken) == MAX_REPORTS_PER_S
    assert refused(book) == {"reports": 20 - MAX_REPORT_BURST + 10 - MAX_REPORTS_PER_S}


def test_tokens_and_steps_are_bounded_per_second_of_the_control_planes_clock() -> None:
    # Before: each report was checked only against the interval it claims (3600 s here),
    # so 12 reports in 3 s granted 7.2e6 tokens from one engine.
    clock = FakeClock()
    book = UsageBook(clock)
    start = clock.now
    results: dict[str, list[bool]] = {"e1": [], "e2": []}
    for _ in range(12):
        results["e1"].append(book.add(p.Usage("e1", 3600.0, {"a": 600_000}, {})))
        results["e2"].append(book.add(p.Usage("e2", 3600.0, {"b": 1}, {"b": 700_000})))
        clock.now += 0.25
    elapsed = clock.now - start
    tokens, steps = sum(results["e1"]), sum(results["e2"])
    assert 0 < tokens * 600_000 <= R * (elapsed + USAGE_BURST_S)
    assert 0 < steps * 700_000 <= p.MAX_ENGINE_STEPS_PER_S * (elapsed + USAGE_BURST_S)
    assert refused(book) == {"tokens": 12 - tokens, "steps": 12 - steps}
    # An engine well within its bound, reporting once a second, is never refused.
    for _ in range(30):
        clock.now += 1.0
        assert book.add(p.Usage("e3", 1.0, {"a": int(0.9 * R)}, {"a": int(0.9 * R)}))


def test_rates_never_exceed_one_engines_bound_whatever_interval_is_claimed() -> None:
    clock = FakeClock()
    book = UsageBook(clock)
    for _ in range(4):  # 1 ms claimed, as many tokens as the protocol lets 1 ms have
        assert book.add(p.Usage("e1", p.MIN_USAGE_INTERVAL_S, {"a": 1000, "b": 1}, {}))
        clock.now += 0.25
    (a, b) = book.totals()
    assert a.tokens_per_s_1s <= R and a.tokens_per_s_10s <= R
    assert a.tokens_per_s_1s + b.tokens_per_s_1s == pytest.approx(R)
    assert book.rate_1s("a") == a.tokens_per_s_1s


def test_the_parts_of_a_report_are_one_interval() -> None:
    clock = FakeClock()
    book = UsageBook(clock)
    seen: list[p.Usage] = []
    book.on_report.append(seen.append)
    parts = [
        p.Usage("e1", 2.0, {"a": 10}, {"a": 5}, 0, 3),
        p.Usage("e1", 2.0, {"b": 20}, {}, 1, 3),
        p.Usage("e1", 2.0, {}, {"c": 5}, 2, 3),
    ]
    assert [book.add(part) for part in parts] == [False, False, True]
    assert seen == parts
    totals = {u.user: u for u in book.totals()}
    # Over the interval once: 10 tokens in 2 s (not in the 6 s of three intervals).
    assert totals["a"].tokens_per_s_10s == pytest.approx(5.0)
    assert totals["b"].tokens_per_s_1s == pytest.approx(10.0) == book.rate_1s("b")
    assert totals["c"].throttled_fraction == 1.0
    assert refused(book) == {}


def test_split_reports_out_of_order_or_incomplete_are_refused_whole() -> None:
    clock = FakeClock()
    book = UsageBook(clock)
    book.add(p.Usage("e1", 1.0, {"a": 1}, {}, 0, 2))
    book.add(p.Usage("e1", 1.0, {"b": 1}, {}, 0, 1))  # a whole report: the split one is lost
    book.add(p.Usage("e1", 1.0, {"c": 1}, {}, 1, 2))  # no first part
    book.add(p.Usage("e1", 1.0, {"d": 1}, {}, 0, 3))
    book.add(p.Usage("e1", 1.0, {"e": 1}, {}, 2, 3))  # part 1 missing
    book.add(p.Usage("e1", 1.0, {"f": 1}, {}, 0, 2))
    book.add(p.Usage("e1", 2.0, {"g": 1}, {}, 1, 2))  # another interval's part
    book.add(p.Usage("e1", 1.0, {"h": 1}, {}, 0, 2))  # its last part never comes
    assert [u.user for u in book.totals()] == ["b"]
    assert refused(book) == {"parts": 4}
    clock.now += 2 * PART_TIMEOUT_S
    assert book.totals() == []
    assert refused(book) == {"parts": 5}


def test_bounds_count_all_parts_of_a_report_together() -> None:
    clock = FakeClock()
    book = UsageBook(clock)
    half = p.MAX_USAGE_USERS // 2 + 1
    for part in range(2):  # each part is fine, together they name too many users
        users = {f"u{part}-{i}": 1 for i in range(half)}
        assert not book.add(p.Usage("e1", 1.0, users, {}, part, 2))
    # Each part within the 1 s interval's bound, together over it: refused whole.
    assert not book.add(p.Usage("e1", 1.0, {"a": R // 2 + 10}, {}, 0, 2))
    assert not book.add(p.Usage("e1", 1.0, {"b": R // 2 + 10}, {}, 1, 2))
    assert book.totals() == []
    assert refused(book) == {"users": 1, "tokens": 1}


def test_would_throttles_are_a_fraction_of_the_request_steps_and_bounded() -> None:
    clock = FakeClock()
    book = UsageBook(clock)
    clock.now += 1.0
    book.add(p.Usage("e1", 1.0, {"a": 40, "b": 10}, {"b": 10}, would_throttle={"a": 30}))
    book.add(p.Usage("e2", 1.0, {"a": 40}, {}, would_throttle={"a": 10}))
    # An engine claiming more would-throttles than steps is capped at 1.
    book.add(p.Usage("e3", 1.0, {"c": 1}, {}, would_throttle={"c": 5}))
    # Only a would-throttle count: the user is tracked, its fraction is 0 of no steps.
    book.add(p.Usage("e4", 1.0, {}, {}, would_throttle={"d": 5}))
    totals = {u.user: u for u in book.totals()}
    assert totals["a"].would_throttle_fraction == pytest.approx(40 / 80)
    assert totals["a"].throttled_fraction == 0.0
    assert (totals["b"].would_throttle_fraction, totals["b"].throttled_fraction) == (0.0, 0.5)
    assert totals["c"].would_throttle_fraction == 1.0
    assert totals["d"].would_throttle_fraction == 0.0
    clock.now += 20.0
    assert book.totals() == []


def test_would_throttle_steps_have_the_steps_pace() -> None:
    clock = FakeClock()
    book = UsageBook(clock)
    over = int(p.MAX_ENGINE_STEPS_PER_S * USAGE_BURST_S) + 2
    assert not book.add(p.Usage("e1", 1.0, {}, {}, would_throttle={"a": over}))
    assert book.refused.counts() == {"steps": 1}
    assert book.add(p.Usage("e1", 1.0, {"a": 1}, {}, would_throttle={"a": 1}))


def test_borrowed_rates_are_summed_over_engines_and_never_above_the_users_rate() -> None:
    clock = FakeClock()
    book = UsageBook(clock)
    for _ in range(10):  # engine e1: 30 tokens/s of a, 10 of them borrowed
        clock.now += 1.0
        book.add(p.Usage("e1", 1.0, {"a": 30, "b": 5}, {}, borrowed={"a": 10}))
    book.add(p.Usage("e2", 2.0, {"a": 20}, {}, borrowed={"a": 8}))  # e2: 4 of its 10
    # An engine claiming more borrowed than granted tokens: shown as all borrowed.
    book.add(p.Usage("e3", 1.0, {"c": 3}, {}, borrowed={"c": 50}))
    a, b, c = book.totals()
    assert (a.borrowed_per_s_10s, a.borrowed_per_s_1s) == pytest.approx((14.0, 14.0))
    assert (a.tokens_per_s_10s, a.tokens_per_s_1s) == pytest.approx((40.0, 40.0))
    assert (b.borrowed_per_s_10s, b.borrowed_per_s_1s) == (0.0, 0.0)
    assert (c.borrowed_per_s_10s, c.tokens_per_s_10s) == pytest.approx((3.0, 3.0))
    clock.now += 2.5  # the latest reports are no longer "the last second"
    a, _, _ = book.totals()
    assert a.borrowed_per_s_1s == 0.0 and a.borrowed_per_s_10s > 0


def test_a_user_named_only_as_borrowing_is_tracked_and_left_out_when_the_book_is_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("control_plane.usage.book.MAX_TRACKED_USERS", 2)
    book = UsageBook(FakeClock())
    book.add(p.Usage("e1", 1.0, {"a": 1}, {}, borrowed={"b": 1, "c": 1}))
    # No tokens granted to b: nothing of it shown as borrowed, but it counts to the bound.
    assert [u.user for u in book.totals()] == ["a"]
    assert book.num_users_left_out == 1
    assert book.rate_1s("b") == 0.0 and book.rate_1s("c") is None
