"""Usage aggregation, with a fake clock (the one seam)."""

from __future__ import annotations

import pytest

from control_plane.usage.book import UsageBook
from output_rate_core import protocol as p


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


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
