"""The outage policy (output_rate_core/outage.py) and the one rule that says what an engine
enforces of a fleet limit once its lease ended (output_rate_core.limits.outage_share)."""

from __future__ import annotations

import pytest

from output_rate_core.limits import outage_share, safe_share
from output_rate_core.outage import DEFAULT_OUTAGE, OutagePolicy

L = 40_000  # milli-tokens/s: a limit of 40 tokens/s
SERVING = DEFAULT_OUTAGE
KEEP = OutagePolicy("keep", keep_s=30)
QUARTER = OutagePolicy("fraction", fraction=0.25)


@pytest.mark.parametrize("policy", [SERVING, KEEP])
def test_serving_divides_by_the_engines_serving_the_user_else_by_the_fleet(
    policy: OutagePolicy,
) -> None:
    # 64 engines; the user is served by 1, 2 or 3 of them.
    assert outage_share(L, 64, 1, policy) == L
    assert outage_share(L, 64, 2, policy) == L // 2
    assert outage_share(L, 64, 3, policy) == 13_333
    # A user the engine never had a count for: the safe share of the whole fleet.
    assert outage_share(L, 64, None, policy) == safe_share(L, 64) == 625


def test_the_serving_shares_of_the_engines_serving_a_user_sum_to_at_most_its_limit() -> None:
    for limit in (1, 7, 999, 1000, L, 1_000_000_000):
        for n in range(1, 70):
            total = n * outage_share(limit, 64, n, SERVING)
            assert total <= max(limit, n), (limit, n)  # never 0: 1 milli each at least


def test_fraction_gives_each_engine_that_part_of_the_limit_whatever_it_was_told() -> None:
    assert outage_share(L, 64, 1, QUARTER) == 10_000
    assert outage_share(L, 64, None, QUARTER) == 10_000
    assert outage_share(L, 2, 2, OutagePolicy("fraction", fraction=1.0)) == L
    assert outage_share(3, 2, None, OutagePolicy("fraction", fraction=0.1)) == 1  # never 0


def test_how_long_shares_are_kept_past_the_lease() -> None:
    assert (SERVING.kept_s, KEEP.kept_s, QUARTER.kept_s) == (0.0, 30.0, 0.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mode": "drop"}, "mode"),
        ({"mode": "keep"}, "keep_s"),
        ({"mode": "keep", "keep_s": 3601}, "keep_s"),
        ({"mode": "serving", "keep_s": 5}, "keep_s"),
        ({"mode": "fraction"}, "fraction"),
        ({"mode": "fraction", "fraction": 1.5}, "fraction"),
        ({"mode": "fraction", "fraction": float("nan")}, "fraction"),
        ({"mode": "keep", "keep_s": 5, "fraction": 0.5}, "fraction"),
    ],
)
def test_a_bad_policy_is_refused_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        OutagePolicy(**kwargs)  # type: ignore[arg-type]
