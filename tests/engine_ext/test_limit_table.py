"""The engine's table of the limit model: the limiter follows every op."""

from __future__ import annotations

from engine_ext.limit_table import LimitTable
from engine_ext.limiter import OutputRateLimiter
from output_rate_core import protocol as p


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
            # The rule, spelled out apart from the model's: override, else tier, else default.
            tier, own = table.model.users.get(user, (None, None))
            if own is not None and own.rate is not None:
                want = own.rate
            elif tier is not None:
                want = table.model.tiers[tier].rate if tier in table.model.tiers else None
            else:
                want = table.model.default.rate
            assert limiter.rate_of(user) == want, (op, user)


# ---- fleet shares (docs/fleet.md) ----------------------------------------------

MS = 1_000_000


def fleet_table(num_engines: int = 4) -> tuple[LimitTable, OutputRateLimiter]:
    snapshot = p.Snapshot(
        version=1,
        default_rate=8,
        tiers={"pro": 100, "solo": 40},
        users={"a": ("pro", None), "b": (None, 10), "e": ("solo", None)},
        tier_scopes={"solo": "engine"},
        num_engines=num_engines,
    )
    table = LimitTable.from_snapshot(snapshot)
    limiter = OutputRateLimiter(None)
    table.load(limiter)
    return table, limiter


def shares(seq: int, values: dict[str, int], *, full: bool = False, epoch: int = 7) -> p.Shares:
    return p.Shares(epoch, seq, lease_ms=1000, num_engines=4, full=full, shares=values)


def test_without_a_share_a_fleet_limit_is_split_evenly_and_an_engine_limit_is_whole() -> None:
    table, limiter = fleet_table(num_engines=4)
    assert limiter.milli_rate_of("a") == 25_000  # 100 tok/s over 4 engines
    assert limiter.milli_rate_of("b") == 2_500
    assert limiter.milli_rate_of("nobody") == 2_000  # the default, 8 tok/s, split too
    assert limiter.milli_rate_of("e") == 40_000  # scope "engine": never split
    assert table.is_fleet_limited("a") and not table.is_fleet_limited("e")


def test_shares_replace_the_safe_share_until_the_lease_ends() -> None:
    table, limiter = fleet_table()
    assert table.apply_shares(
        shares(1, {"a": 70_000, "nobody": 500, "e": 1}, full=True), limiter, 0
    )
    assert limiter.milli_rate_of("a") == 70_000
    assert limiter.milli_rate_of("nobody") == 500
    assert limiter.milli_rate_of("e") == 40_000  # a share of an engine-scoped user is ignored
    assert table.apply_shares(shares(2, {"a": 0}), limiter, 10 * MS)  # 0: no share any more
    assert limiter.milli_rate_of("a") == 25_000
    assert not table.expire_lease(limiter, 1000 * MS)  # renewed at 10 ms: lease until 1010 ms
    assert table.expire_lease(limiter, 1011 * MS)
    assert limiter.milli_rate_of("nobody") == 2_000
    # After a lease ran out only a full table is taken.
    assert not table.apply_shares(shares(3, {"a": 1}), limiter, 1012 * MS)
    assert limiter.milli_rate_of("a") == 25_000


def test_duplicates_and_old_messages_are_dropped_and_a_gap_asks_for_a_full_table() -> None:
    table, limiter = fleet_table()
    assert not table.apply_shares(shares(1, {"a": 1}), limiter, 0)  # no full table yet
    assert table.apply_shares(shares(5, {"a": 60_000}, full=True), limiter, 0)
    assert table.apply_shares(shares(6, {"a": 50_000}), limiter, 0)
    assert table.apply_shares(shares(6, {"a": 1}), limiter, 0)  # a duplicate
    assert table.apply_shares(shares(4, {"a": 2}), limiter, 0)  # out of order
    assert table.fleet.num_dropped == 2
    assert limiter.milli_rate_of("a") == 50_000
    assert not table.apply_shares(shares(8, {"a": 3}), limiter, 0)  # 7 went missing
    assert limiter.milli_rate_of("a") == 50_000
    # A new allocator (another epoch) starts with a full table.
    assert not table.apply_shares(shares(1, {"a": 4}, epoch=8), limiter, 0)
    assert table.apply_shares(shares(1, {"b": 9_000}, full=True, epoch=8), limiter, 0)
    assert limiter.milli_rate_of("a") == 25_000 and limiter.milli_rate_of("b") == 9_000


def test_the_fleet_size_rescales_every_safe_share() -> None:
    table, limiter = fleet_table(num_engines=4)
    message = p.Shares(7, 1, lease_ms=1000, num_engines=2, full=True, shares={"b": 3_000})
    assert table.apply_shares(message, limiter, 0)
    assert limiter.milli_rate_of("a") == 50_000
    assert limiter.milli_rate_of("nobody") == 4_000
    assert limiter.milli_rate_of("b") == 3_000


def test_a_limit_change_keeps_the_share_and_a_scope_change_drops_it() -> None:
    table, limiter = fleet_table()
    assert table.apply_shares(shares(1, {"a": 70_000}, full=True), limiter, 0)
    table.apply(p.SetTier("pro", 200), limiter)
    assert limiter.milli_rate_of("a") == 70_000  # until the control plane re-shares it
    table.apply(p.SetTier("pro", 200, "engine"), limiter)
    assert limiter.milli_rate_of("a") == 200_000
    table.apply(p.SetDefault(8, "engine"), limiter)
    assert limiter.milli_rate_of("nobody") == 8_000


def test_enforcement_follows_the_precedence_into_the_limiter() -> None:
    """Users in shadow (own, the tier's, the default's) get a shadow entry; an enforced
    user under a shadow default needs an entry of its own."""
    limiter = OutputRateLimiter(None)
    table = LimitTable()
    ops: list[p.Op] = [
        p.SetDefault(rate=30, enforcement="shadow"),
        p.SetTier(name="pro", rate=100),
        p.SetUser(user="a", tier="pro"),
        p.SetUser(user="b", tier=None, rate=None, enforcement="enforce"),
        p.SetUser(user="c", tier="pro", rate=5, enforcement="shadow"),
        p.SetTier(name="pro", rate=100, enforcement="enforce"),
        p.SetDefault(rate=30),
        p.SetTier(name="pro", rate=100, enforcement="shadow"),
        p.SetUser(user="c", tier="pro", rate=5),
    ]
    for op in ops:
        table.apply(op, limiter)
        reloaded = OutputRateLimiter(None)
        table.load(reloaded)
        for user in ("a", "b", "c", "nobody"):
            effective = table.model.effective(user)
            want = effective.rate if effective.enforcement == "shadow" else None
            assert limiter.shadow_milli_of(user) == (want and want * p.MILLI), (op, user)
            assert reloaded.shadow_milli_of(user) == limiter.shadow_milli_of(user), (op, user)
            assert limiter.rate_of(user) == effective.rate, (op, user)
    assert [table.model.effective(u).enforcement for u in ("a", "b", "c")] == [
        "shadow",
        "enforce",
        "shadow",
    ]
