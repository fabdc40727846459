"""The control plane's side of the outage policy (docs/fleet.md, "Outage, engine death,
partition"): every engine holding a share of a user is told how many engines serve it, so
that at lease end the engines' outage shares (output_rate_core.limits.outage_share) sum to
at most the limit; and a lapsing engine is accounted at the outage share it may fall to.

The only fake is the clock (and, in the simulation, the network: test_allocator.Sim)."""

from __future__ import annotations

import random

import pytest

from control_plane.config.follower import Catchup
from control_plane.fleet.allocator import FleetAllocator, ShareUpdate, min_gone_after_s
from control_plane.fleet.coordinator import FleetCoordinator, quiet_until
from output_rate_core import protocol as p
from output_rate_core.limits import outage_share
from output_rate_core.outage import DEFAULT_OUTAGE, OutagePolicy
from tests.control_plane.factories import FakeClock, ack, make_allocator
from tests.control_plane.fleet.test_allocator import Sim, SimEngine


def test_each_share_carries_the_number_of_engines_serving_the_user() -> None:
    alloc, _ = make_allocator("a", "b", "c")
    alloc.set_limit("u", 40)
    alloc.set_demand("a", {"u": 1}, full=False)
    first = alloc.step()
    assert (first["a"].shares, first["a"].serving) == ({"u": 40_000}, {"u": 1})
    ack(alloc, first)
    # B begins serving: A is lowered and told 2 at once; B gets its share (and 2) once
    # A's lowering is acknowledged.
    alloc.set_demand("b", {"u": 1}, full=False)
    lowered = alloc.step()
    assert (lowered["a"].shares, lowered["a"].serving) == ({"u": 20_000}, {"u": 2})
    assert "u" not in lowered.get("b", ShareUpdate(0, 3, 1.0, False, {}, {})).shares
    ack(alloc, lowered)
    raised = alloc.step()
    assert (raised["b"].shares, raised["b"].serving) == ({"u": 20_000}, {"u": 2})
    ack(alloc, raised)
    # B stops: its 0 carries no count; once B acknowledged it, A serves alone and is told so
    # (with its raise to the whole limit).
    alloc.set_demand("b", {"u": 0}, full=False)
    dropped = alloc.step()
    assert (dropped["b"].shares, dropped["b"].serving) == ({"u": 0}, {})
    ack(alloc, dropped)
    alone = alloc.step()
    assert (alone["a"].shares, alone["a"].serving) == ({"u": 40_000}, {"u": 1})
    # A full update restates the count with every share.
    full = alloc.full_update("a")
    assert (full.full, full.shares, full.serving) == (True, {"u": 40_000}, {"u": 1})


def test_a_count_that_changes_without_the_share_is_sent_alone() -> None:
    """A stalled engine keeps 1 milli whatever the others do; a third engine serving the
    user changes its count, not its share."""
    alloc, _ = make_allocator("a", "b", "c")
    alloc.set_limit("u", 40)
    alloc.set_demand("a", {"u": 2}, full=False, stalled=["u"])
    alloc.set_demand("b", {"u": 1}, full=False)
    for _ in range(3):
        ack(alloc, alloc.step())
    assert alloc.shares_of("u") == {"a": 1, "b": 39_999}
    alloc.set_demand("c", {"u": 1}, full=False)
    update = alloc.step()["a"]
    assert (update.shares, update.serving) == ({"u": 1}, {"u": 3})


@pytest.mark.parametrize(
    ("outage", "held_b"),
    [
        (DEFAULT_OUTAGE, 20_000),  # B may fall to 40 / 2 (2 engines serve the user)
        (OutagePolicy("keep", keep_s=30), 20_000),  # then, after the keep, to the same
        (OutagePolicy("fraction", fraction=0.75), 30_000),  # B may fall to 0.75 x 40
    ],
    ids=["serving", "keep", "fraction"],
)
def test_a_lapsing_engine_is_held_at_the_outage_share_it_may_fall_to(
    outage: OutagePolicy, held_b: int
) -> None:
    """3 streams on A, 1 on B: 30,000 and 10,000. B stops acknowledging: from one missed
    renewal on it is held at the larger of its share and its outage share, and A is
    lowered to what is left, before B may fall to it."""
    alloc, clock = make_allocator("a", "b", "c", outage=outage)
    alloc.set_limit("u", 40)
    alloc.set_demand("a", {"u": 3}, full=False)
    alloc.set_demand("b", {"u": 1}, full=False)
    for _ in range(3):
        ack(alloc, alloc.step())
    assert alloc.shares_of("u") == {"a": 30_000, "b": 10_000}
    while clock.now < 2.0:
        clock.now = round(clock.now + 0.1, 9)
        alloc.engine_heard("b")
        ack(alloc, alloc.step(), "a")
    assert alloc.shares_of("u") == {"a": 40_000 - held_b, "b": held_b}
    assert held_b == outage_share(40_000, 3, 2, outage)


def test_keep_grows_the_least_gone_after_by_the_keep_time() -> None:
    assert min_gone_after_s(10.0, 30.0) == min_gone_after_s(10.0) + 30.0 == 51.0
    with pytest.raises(ValueError, match="gone_after_s"):
        FleetAllocator(lease_s=10.0, gone_after_s=30.0, outage=OutagePolicy("keep", keep_s=30))
    FleetAllocator(lease_s=10.0, gone_after_s=51.0, outage=OutagePolicy("keep", keep_s=30))


# ---- the simulated fleet: the control plane stops at any moment ---------------------------


class OutageSim(Sim):
    """Sim whose engines also keep the serving count sent with each share."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        # engine -> user -> the serving count it holds with its share
        self.counts: dict[str, dict[str, int]] = {e: {} for e in self.engines}

    def _apply(self, engine: SimEngine, message: ShareUpdate) -> None:
        super()._apply(engine, message)
        if engine.applied_seq != message.seq:
            return  # dropped: a gap or a duplicate
        self.counts[engine.engine_id] = _counts_after(
            self.counts.get(engine.engine_id, {}), message
        )

    def outage_sums(self) -> dict[str, int]:
        """user -> what the engines holding a share of it enforce once the control plane
        stopped now, every message in flight has landed and the lease ended (serving)."""
        sums: dict[str, int] = {}
        for engine in self.engines.values():
            counts = self.counts.get(engine.engine_id, {})
            for _, message, _ in engine.inbox:
                counts = _counts_after(counts, message)
            num_engines = self.least_num_engines(engine)
            for user, count in counts.items():
                limit = self.limits.get(user)
                if limit is not None:
                    share = outage_share(limit, num_engines, count, DEFAULT_OUTAGE)
                    sums[user] = sums.get(user, 0) + share
        return sums


def _counts_after(counts: dict[str, int], message: ShareUpdate) -> dict[str, int]:
    after = {} if message.full else dict(counts)
    for user, value in message.shares.items():
        if value:
            after[user] = message.serving[user]
        else:
            after.pop(user, None)
    return after


def test_simulated_fleet_stopped_at_any_tick_stays_within_every_limit_on_serving() -> None:
    """20 engines, 400 users on 1-4 engines each, streams moving every tick, lossless: at
    every tick, were the control plane to stop, the outage shares of the engines holding a
    share of a user (L / the count each was told) sum to at most L; and each engine holding
    one was told a count (a share without one would fall to L / 20)."""
    sim = OutageSim(num_engines=20, seed=3)
    rng = random.Random(5)
    users = [f"u{i:03d}" for i in range(400)]
    for user in users:
        sim.set_limit(user, rng.choice([1, 3, 10, 40, 250]))
    engine_ids = list(sim.engines)
    homes = {user: rng.sample(engine_ids, rng.randint(1, 4)) for user in users}

    def churn(sim: Sim) -> None:
        for user in rng.sample(users, 20):
            home = homes[user]
            if rng.random() < 0.3:
                home[rng.randrange(len(home))] = rng.choice(engine_ids)
            sim.place_streams(user, home, rng)

    for _ in range(5):
        sim.tick()
    num_checked = 0
    for _ in range(300):
        sim.tick(churn)
        for user, total in sim.outage_sums().items():
            limit = sim.limits[user]
            assert limit is not None and total <= limit, (user, total, limit, sim.clock.now)
            num_checked += 1
        for engine_id, engine in sim.engines.items():
            assert set(sim.counts[engine_id]) == set(engine.shares), engine_id
    sim.settle()
    # At rest every user's engines were told exactly how many serve it: the outage shares
    # are L / n each.
    for user in users:
        holders = [e for e in engine_ids if user in sim.counts[e]]
        assert all(sim.counts[e][user] == len(holders) for e in holders), user
    assert num_checked > 300 * 300


# ---- the coordinator: the policy in every Shares frame ------------------------------------


def test_every_shares_frame_carries_the_policy_and_the_counts() -> None:
    clock = FakeClock(0.0)
    keep = OutagePolicy("keep", keep_s=30)
    fleet = FleetCoordinator(lease_s=10.0, clock=clock, outage=keep)
    fleet.heard("a")
    (_, first), *_ = fleet.step()
    assert (first.outage, first.outage_keep_ms, first.outage_fraction) == ("keep", 30_000, 0.0)
    assert first.outage_policy == keep
    fleet.on_ack("a", p.ShareAck("a", first.epoch, first.seq))
    fleet.catch_up(Catchup(None, snapshot=p.Snapshot(1, 40, {}, {})))
    frames = dict(fleet.on_demand("a", p.Demand("a", False, {"u": 1})))
    assert (frames["a"].shares, frames["a"].serving) == ({"u": 40_000}, {"u": 1})
    # A successor waits out the keep too: engines may hold their shares that long.
    assert quiet_until(100.0, 10.0, keep.kept_s) == quiet_until(100.0, 10.0) + 30.0


@pytest.mark.parametrize("broken", [False, True])
def test_a_count_kept_past_its_share_is_held_for_a_lapsing_engine_until_it_expires(
    broken: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A served the user alone (count 1), then its share was withdrawn: its cell goes, but
    it keeps the count 2 x lease + 1 s (7 s here). B serves the user meanwhile. A stops
    hearing renewals (it still reports) and begins serving the user again: past its lease
    it may enforce 40 / 1, so it is held at the whole limit and B lowered to the least, not
    at 40 / 3 (the count it never had, the rule broken: B keeps 26,667). Once the count
    expired, A is held at its safe share again; a full table A acknowledged forgets the
    count (the engine drops it)."""
    if broken:
        monkeypatch.setattr(
            "control_plane.fleet.allocator.min_gone_after_s", lambda lease, keep_s=0.0: -1.0
        )
    alloc, clock = make_allocator("a", "b", "c")
    alloc.set_limit("u", 40)
    alloc.set_demand("a", {"u": 1}, full=False)
    for _ in range(2):
        ack(alloc, alloc.step())
    assert alloc.shares_of("u") == {"a": 40_000}
    alloc.set_demand("a", {"u": 0}, full=False)
    ack(alloc, alloc.step())
    alloc.set_demand("b", {"u": 1}, full=False)
    for _ in range(2):
        ack(alloc, alloc.step())
    assert alloc.shares_of("u") == {"b": 40_000}
    # A hears nothing from here on (its acks stop), it still reports.
    while clock.now < 2.5:
        clock.now = round(clock.now + 0.1, 9)
        alloc.engine_heard("a")
        ack(alloc, alloc.step(), "b", "c")
    alloc.set_demand("a", {"u": 1}, full=False)
    ack(alloc, alloc.step(), "b", "c")
    if broken:
        assert alloc.shares_of("u") == {"a": 13_333, "b": 26_667}
        return
    assert alloc.shares_of("u") == {"a": 40_000, "b": 1}
    while clock.now < 7.2:  # the count's 7 s have passed
        clock.now = round(clock.now + 0.1, 9)
        alloc.engine_heard("a")
        ack(alloc, alloc.step(), "b", "c")
    assert alloc.shares_of("u") == {"a": 13_333, "b": 26_667}


def test_a_full_table_acknowledged_forgets_the_kept_counts() -> None:
    alloc, clock = make_allocator("a", "b")
    alloc.set_limit("u", 40)
    alloc.set_demand("a", {"u": 1}, full=False)
    for _ in range(2):
        ack(alloc, alloc.step())
    alloc.set_demand("a", {"u": 0}, full=False)
    ack(alloc, alloc.step())
    alloc.acked("a", alloc.full_update("a").seq)
    # A reconnects lapsing (its lease ran out) and serves the user: its full table was
    # acknowledged, so its count of 1 is gone (the engine dropped it too).
    clock.now = 3.5
    alloc.set_demand("a", {"u": 1}, full=True)
    assert alloc.shares_of("u") == {"a": 20_000}
