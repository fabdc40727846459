"""The engine's table of the limit model: the limiter follows every op."""

from __future__ import annotations

from engine_ext.limit_table import LimitTable
from engine_ext.limiter import OutputRateLimiter
from output_rate_core import protocol as p
from output_rate_core.limits import effective_rate


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
