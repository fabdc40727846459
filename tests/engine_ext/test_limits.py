"""The shared limit model: the effective-rate rule and the engine's table of it."""

from __future__ import annotations

from engine_ext import protocol as p
from engine_ext.limiter import OutputRateLimiter
from engine_ext.limits import DEFAULT, OVERRIDE, TIER, LimitTable, effective_rate


def test_override_then_tier_then_default() -> None:
    assert effective_rate(7, "pro", 100, 20) == (7, OVERRIDE)
    assert effective_rate(None, "pro", 100, 20) == (100, TIER)
    assert effective_rate(None, "pro", None, 20) == (None, TIER)  # an unlimited tier
    assert effective_rate(None, None, None, 20) == (20, DEFAULT)
    assert effective_rate(None, None, None, None) == (None, DEFAULT)


def test_the_table_gives_the_limiter_each_users_effective_rate_after_every_op() -> None:
    limiter = OutputRateLimiter(None)
    table = LimitTable()
    ops: list[p.Op] = [
        p.SetDefault(rate=30),
        p.SetTier(name="pro", rate=100),
        p.SetUser(user="a", tier="pro", rate=None),
        p.SetUser(user="b", tier="pro", rate=5),
        p.SetUser(user="c", tier=None, rate=None),
        p.SetTier(name="pro", rate=None),
        p.DeleteUser(user="b"),
        p.SetUser(user="a", tier=None, rate=None),
        p.DeleteTier(name="pro"),
    ]
    for op in ops:
        table.apply(op, limiter)
        for user in ("a", "b", "c", "nobody"):
            tier, override = table.users.get(user, (None, None))
            tier_rate = table.tiers.get(tier) if tier else None
            want = effective_rate(override, tier, tier_rate, table.default_rate)[0]
            assert limiter.rate_of(user) == want, (op, user)
