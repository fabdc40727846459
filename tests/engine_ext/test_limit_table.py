"""The engine's table of the limit model: the limiter follows every op."""

from __future__ import annotations

from engine_ext.limit_table import LimitTable
from engine_ext.limiter import OutputRateLimiter
from output_rate_core import protocol as p
from output_rate_core.outage import OutageMode


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


def test_a_full_table_of_an_older_epoch_is_dropped_while_the_lease_holds() -> None:
    """Epochs are ordered (docs/fleet.md, "Bound holes"): a late full table of a gone
    allocator never replaces a newer one's shares while their lease holds; once the lease
    ended (the engine is on its safe shares) any full table is taken again."""
    table, limiter = fleet_table()
    assert table.apply_shares(shares(1, {"a": 60_000}, full=True, epoch=9), limiter, 0)
    assert table.apply_shares(shares(3, {"a": 90_000}, full=True, epoch=8), limiter, 1 * MS)
    assert table.fleet.num_dropped == 1
    assert (table.fleet.epoch, limiter.milli_rate_of("a")) == (9, 60_000)
    assert table.expire_lease(limiter, 1001 * MS)
    assert table.apply_shares(shares(1, {"a": 10_000}, full=True, epoch=8), limiter, 1002 * MS)
    assert limiter.milli_rate_of("a") == 10_000


# ---- ceilings (borrowing, docs/scheduler.md) -------------------------------------


def test_ceilings_reach_the_limiter_scaled_like_the_rate() -> None:
    from output_rate_core.limits import LimitModel
    from output_rate_core.policy import Policy

    model = LimitModel(
        Policy(8, scope="fleet", ceiling=16),
        {"pro": Policy(100, scope="fleet", ceiling=300), "solo": Policy(40, scope="engine")},
        {
            "a": ("pro", Policy()),
            "e": ("solo", Policy(ceiling=50)),
            "s": ("pro", Policy(enforcement="shadow")),
            "d": (None, Policy()),
        },
    )
    table = LimitTable(model, num_engines=4)
    limiter = OutputRateLimiter(None)
    table.load(limiter)
    # Fleet: ceiling x (safe) share / rate: 300 x 25 / 100 per engine.
    assert table.ceiling_milli("a") == 75_000
    assert limiter.borrow_milli_of("a") == 75_000 - 25_000
    assert table.ceiling_milli("e") == 50_000  # engine scope: whole
    assert limiter.borrow_milli_of("e") == 10_000
    assert table.ceiling_milli("s") is None  # a shadow limit's ceiling is ignored
    assert limiter.borrow_milli_of("s") is None
    # The default's, at the default's safe share: 16 x 2 / 8.
    assert table.default_ceiling_milli() == 4_000
    assert limiter.borrow_milli_of("d") == limiter.borrow_milli_of("nobody") == 2_000
    # A share replaces the safe share: the ceiling follows it.
    assert table.apply_shares(
        p.Shares(7, 1, lease_ms=1000, num_engines=4, full=True, shares={"a": 40_000}), limiter, 0
    )
    assert table.ceiling_milli("a") == 120_000
    assert limiter.borrow_milli_of("a") == 80_000
    # An op that drops the tier's ceiling: "a" borrows nothing any more.
    table.apply(p.SetTier(name="pro", rate=100, scope="fleet"), limiter)
    assert limiter.borrow_milli_of("a") is None


# ---- the outage policy at lease end (docs/fleet.md, "Outage, engine death, partition") -----


def policy_shares(
    seq: int,
    values: dict[str, int],
    serving: dict[str, int],
    *,
    full: bool = False,
    outage: OutageMode = "serving",
    keep_ms: int = 0,
    fraction: float = 0.0,
) -> p.Shares:
    return p.Shares(7, seq, 1000, 4, full, values, outage, keep_ms, fraction, serving=serving)


def test_serving_falls_to_the_limit_over_the_engines_serving_each_user() -> None:
    """4 engines: "a" (100 tok/s) served by 2 of them, "b" (10) by one, with a share from
    a control plane that sent no count for it; "nobody" (the default, 8) never shared."""
    table, limiter = fleet_table(num_engines=4)
    message = policy_shares(1, {"a": 70_000, "b": 3_000}, {"a": 2}, full=True)
    assert table.apply_shares(message, limiter, 0)
    assert table.expire_lease(limiter, 1001 * MS)
    assert limiter.milli_rate_of("a") == 50_000  # 100 / 2, not 100 / 4
    assert limiter.milli_rate_of("b") == 2_500  # no count: the safe share, 10 / 4
    assert limiter.milli_rate_of("nobody") == 2_000
    assert limiter.milli_rate_of("e") == 40_000  # engine scope: whole, as always
    # A limit change in the outage rescales the outage share with the same count.
    table.apply(p.SetTier("pro", 60), limiter)
    assert limiter.milli_rate_of("a") == 30_000
    # The next full table ends the outage: shares, and the safe share for the rest.
    assert table.apply_shares(policy_shares(1, {"b": 4_000}, {"b": 1}, full=True), limiter, 2 * MS)
    assert limiter.milli_rate_of("a") == 15_000 and limiter.milli_rate_of("b") == 4_000
    assert table.fleet.serving == {"b": 1}


def test_a_share_withdrawn_keeps_its_count_until_the_next_full_table() -> None:
    """A user whose requests paused here (share 0) when the control plane stopped gets
    L / its last count when they resume; a full table replaces every count."""
    table, limiter = fleet_table(num_engines=4)
    assert table.apply_shares(policy_shares(1, {"a": 70_000}, {"a": 1}, full=True), limiter, 0)
    assert table.apply_shares(policy_shares(2, {"a": 60_000}, {"a": 3}), limiter, 0)
    assert table.apply_shares(policy_shares(3, {"a": 0}, {}), limiter, 0)  # no demand here
    assert limiter.milli_rate_of("a") == 25_000  # no share, the lease holds: the safe share
    assert table.expire_lease(limiter, 1001 * MS)
    assert limiter.milli_rate_of("a") == 33_333  # 100 / 3
    assert table.apply_shares(policy_shares(1, {"b": 4_000}, {"b": 1}, full=True), limiter, 0)
    assert table.fleet.serving == {"b": 1}
    assert table.expire_lease(limiter, 2 * 1001 * MS)
    assert limiter.milli_rate_of("a") == 25_000  # never told by this table: 100 / 4


def test_a_count_kept_past_its_share_expires_after_the_least_gone_after() -> None:
    """A count kept past its share lasts 2 x lease + keep + 1 s (3 s with a 1 s lease) from
    the arrival of the frame that withdrew the share, then the user is on the safe share of
    the whole fleet: a count from long ago (1: this engine alone served the user then) no
    longer gives the whole limit in an outage. A count of a user holding a share when the
    lease ends is the outage's and does not expire."""
    table, limiter = fleet_table(num_engines=4)
    assert table.apply_shares(
        policy_shares(1, {"a": 70_000, "b": 3_000}, {"a": 1, "b": 1}, full=True), limiter, 0
    )
    assert table.apply_shares(policy_shares(2, {"a": 0}, {}), limiter, 500 * MS)
    assert table.fleet.serving_until_ns == {"a": 3_500 * MS}
    # A 0 for a user with no share left does not stretch its count's time.
    assert table.apply_shares(policy_shares(3, {"a": 0}, {}), limiter, 900 * MS)
    assert table.fleet.serving_until_ns == {"a": 3_500 * MS}
    assert table.expire_lease(limiter, 1_901 * MS)
    assert limiter.milli_rate_of("a") == 100_000  # 100 / 1: withdrawn 1.4 s ago
    assert table.expire_counts(limiter, 3_500 * MS) == []
    assert table.expire_counts(limiter, 3_501 * MS) == ["a"]
    assert limiter.milli_rate_of("a") == 25_000  # 100 / 4
    assert table.fleet.serving == {"b": 1}
    assert table.expire_counts(limiter, 10**6 * MS) == []
    assert limiter.milli_rate_of("b") == 10_000  # held when the lease ended: 10 / 1
    # A share given again makes the count current: no expiry.
    assert table.apply_shares(policy_shares(1, {"a": 0, "b": 1}, {"b": 2}, full=True), limiter, 0)
    assert table.fleet.serving_until_ns == {}


def test_a_count_kept_past_its_share_expires_in_the_lease_too() -> None:
    """Expired while the lease holds, the count is gone when the outage comes: the safe
    share; a share given again before that clears the expiry (its count is current)."""
    table, limiter = fleet_table(num_engines=4)
    assert table.apply_shares(policy_shares(1, {"a": 70_000}, {"a": 1}, full=True), limiter, 0)
    assert table.apply_shares(policy_shares(2, {"a": 0}, {}), limiter, 0)
    assert table.apply_shares(policy_shares(3, {"a": 60_000}, {"a": 2}), limiter, 0)
    assert table.fleet.serving_until_ns == {}
    assert table.apply_shares(policy_shares(4, {"a": 0}, {}), limiter, 0)
    for seq in range(5, 9):  # renewals every 0.9 s
        assert table.apply_shares(policy_shares(seq, {}, {}), limiter, (seq - 4) * 900 * MS)
        assert table.expire_counts(limiter, (seq - 4) * 900 * MS) == (["a"] if seq == 8 else [])
    assert table.expire_lease(limiter, 4_601 * MS)
    assert limiter.milli_rate_of("a") == 25_000


def test_keep_holds_the_last_shares_for_keep_s_past_the_lease_then_serving() -> None:
    table, limiter = fleet_table(num_engines=4)
    message = policy_shares(1, {"a": 70_000}, {"a": 2}, full=True, outage="keep", keep_ms=30_000)
    assert table.apply_shares(message, limiter, 0)
    assert not table.expire_lease(limiter, 1001 * MS)  # the lease ended: kept
    assert not table.expire_lease(limiter, 31_000 * MS)
    assert limiter.milli_rate_of("a") == 70_000
    assert table.expire_lease(limiter, 31_001 * MS)
    assert limiter.milli_rate_of("a") == 50_000
    assert limiter.milli_rate_of("b") == 2_500


def test_fraction_gives_every_fleet_user_that_part_of_its_limit_until_the_next_table() -> None:
    table, limiter = fleet_table(num_engines=4)
    message = policy_shares(1, {"a": 70_000}, {"a": 2}, full=True, outage="fraction", fraction=0.5)
    assert table.apply_shares(message, limiter, 0)
    assert limiter.milli_rate_of("b") == 2_500  # while the lease holds: the safe share
    assert table.expire_lease(limiter, 1001 * MS)
    assert limiter.milli_rate_of("a") == 50_000
    assert limiter.milli_rate_of("b") == 5_000  # held no share: the fraction all the same
    assert limiter.milli_rate_of("nobody") == 4_000  # the default too
    assert limiter.milli_rate_of("e") == 40_000
    # A reload (the limiter rebuilt from the table) gives the same.
    reloaded = OutputRateLimiter(None)
    table.load(reloaded)
    assert [reloaded.milli_rate_of(u) for u in ("a", "b", "nobody")] == [50_000, 5_000, 4_000]
    # The next table: shares, and safe shares for the rest again.
    assert table.apply_shares(policy_shares(1, {"a": 30_000}, {"a": 3}, full=True), limiter, 0)
    assert [limiter.milli_rate_of(u) for u in ("a", "b", "nobody")] == [30_000, 2_500, 2_000]


def test_a_snapshot_in_an_outage_keeps_the_outage_shares() -> None:
    """A snapshot is config only (adopt_fleet): what the outage rule gives stays."""
    table, limiter = fleet_table(num_engines=4)
    assert table.apply_shares(policy_shares(1, {"a": 70_000}, {"a": 2}, full=True), limiter, 0)
    assert table.expire_lease(limiter, 1001 * MS)
    fresh, _ = fleet_table(num_engines=4)
    fresh.adopt_fleet(table)
    reloaded = OutputRateLimiter(None)
    fresh.load(reloaded)
    assert reloaded.milli_rate_of("a") == 50_000 and reloaded.milli_rate_of("b") == 2_500


# ---- ceilings (borrowing) ------------------------------------------------------


def test_an_engine_ceiling_is_whole_and_a_fleet_one_scales_with_this_engines_part() -> None:
    snapshot = p.Snapshot(
        version=1,
        default_rate=8,
        tiers={"pro": 100, "solo": 40},
        users={"a": ("pro", None), "b": (None, 10), "e": ("solo", None), "u": (None, None)},
        tier_scopes={"solo": "engine"},
        default_ceiling=12,
        tier_ceilings={"pro": 150, "solo": 60},
        user_ceilings={"b": 10},
        num_engines=4,
    )
    table = LimitTable.from_snapshot(snapshot)
    limiter = OutputRateLimiter(None)
    table.load(limiter)
    assert table.ceiling_milli("e") == 60_000  # scope "engine": the whole ceiling
    # Fleet: the safe share (100 tok/s over 4 engines: 25,000) scaled by 150/100.
    assert table.ceiling_milli("a") == 37_500
    assert table.ceiling_milli("nobody") == 3_000  # the default's: 2,000 * 12/8
    assert table.ceiling_milli("b") is None  # its own ceiling equals its rate: none
    assert table.apply_shares(shares(1, {"a": 70_000, "nobody": 1}, full=True), limiter, 0)
    assert table.ceiling_milli("a") == 105_000  # its share 70,000 * 150/100
    assert table.ceiling_milli("nobody") is None  # 1 * 12 // 8 = 1: nothing above the share
    # The engines' ceilings sum to at most the fleet ceiling when the shares sum to the rate.
    parts = [70_000, 20_000, 9_999, 1]
    ceilings = [150 * part // 100 for part in parts]
    assert sum(ceilings) <= 150_000
    assert table.expire_lease(limiter, 2000 * MS)
    assert table.ceiling_milli("a") == 37_500


def test_ceilings_follow_every_op_and_the_precedence() -> None:
    limiter = OutputRateLimiter(None)
    table = LimitTable()
    table.apply(p.SetDefault(10, "engine", ceiling=20), limiter)
    assert table.ceiling_milli("x") == 20_000
    table.apply(p.SetTier("pro", 30, ceiling=None), limiter)
    table.apply(p.SetUser("x", "pro", None), limiter)
    # The tier's rate 30 is above the default's ceiling 20: nothing to borrow.
    assert table.ceiling_milli("x") is None
    table.apply(p.SetTier("pro", 30, ceiling=45), limiter)
    assert table.ceiling_milli("x") == 45_000
    table.apply(p.SetUser("x", "pro", None, ceiling=90), limiter)
    assert table.ceiling_milli("x") == 90_000
    table.apply(p.SetUser("x", "pro", 100), limiter)  # its own rate, above the tier's 45
    assert table.ceiling_milli("x") is None
    table.apply(p.SetTier("pro", None, ceiling=None), limiter)
    table.apply(p.SetUser("x", "pro", None), limiter)
    assert table.ceiling_milli("x") is None  # unlimited: nothing to borrow
    table.apply(p.DeleteUser("x"), limiter)
    table.apply(p.SetDefault(10, "engine"), limiter)
    assert table.ceiling_milli("x") is None  # the default's own null: no borrowing
