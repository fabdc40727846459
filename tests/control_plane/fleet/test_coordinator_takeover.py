"""A coordinator taking over from another replica's (docs/replicas.md): quiet until its
predecessor's leases have ended and the fleet's engines said their whole demand. The
only fake is the clock."""

from __future__ import annotations

from control_plane.config.follower import Catchup
from control_plane.fleet.coordinator import SEED_WAIT_S, FleetCoordinator, quiet_until
from output_rate_core import protocol as p

LEASE_S = 10.0


class Clock:
    """A fake clock: the test moves it."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def coordinator(clock: Clock, *, stopped_at: float) -> FleetCoordinator:
    fleet = FleetCoordinator(
        lease_s=LEASE_S, clock=clock, quiet_until=quiet_until(stopped_at, LEASE_S)
    )
    snapshot = p.Snapshot(version=1, default_rate=None, tiers={}, users={"u": (None, 40)})
    fleet.catch_up(Catchup(None, snapshot=snapshot))
    return fleet


def test_sends_nothing_until_the_predecessors_leases_ended_then_full_tables() -> None:
    clock = Clock()
    fleet = coordinator(clock, stopped_at=clock.now - 2.0)  # it stopped 2 s ago
    assert fleet.on_demand("e1", p.Demand("e1", True, {"u": 3})) == []
    assert fleet.on_demand("e2", p.Demand("e2", True, {"u": 1})) == []
    assert fleet.step() == []
    clock.now += LEASE_S - 2.0  # its last lease has just ended; the margin is left
    assert fleet.step() == []
    clock.now += 1.0
    frames = dict(fleet.step())
    # Both engines get a full table of this coordinator's epochs, told the fleet is 2.
    assert set(frames) == {"e1", "e2"}
    assert all(f.full and f.num_engines == 2 for f in frames.values())


def test_waits_for_the_whole_demand_of_every_engine_the_fleet_had() -> None:
    clock = Clock()
    fleet = coordinator(clock, stopped_at=-1e9)  # no predecessor's lease to wait out
    fleet.await_engines(["e1", "e2", "e3"])
    assert fleet.num_engines == 3  # counted at once: safe shares stay small
    fleet.on_demand("e1", p.Demand("e1", True, {"u": 1}))
    fleet.on_demand("e2", p.Demand("e2", False, {"u": 1}))  # not its whole demand
    assert fleet.step() == []
    fleet.on_demand("e2", p.Demand("e2", True, {"u": 1}))
    assert fleet.step() == []  # e3 not heard yet
    # The last one's whole demand ends the quiet start: full tables answer it at once.
    frames = fleet.on_demand("e3", p.Demand("e3", True, {}))
    assert {engine for engine, message in frames if message.full} == {"e1", "e2", "e3"}


def test_an_engine_that_never_comes_back_holds_it_up_for_the_seed_wait_only() -> None:
    clock = Clock()
    fleet = coordinator(clock, stopped_at=-1e9)
    fleet.await_engines(["e1", "gone"])
    fleet.on_demand("e1", p.Demand("e1", True, {"u": 1}))
    clock.now += SEED_WAIT_S - 0.1
    assert fleet.step() == []
    clock.now += 0.2
    fleet.heard("e1")  # (a live engine is heard every second)
    assert "e1" in dict(fleet.step())


def test_a_coordinator_without_a_predecessor_starts_at_once() -> None:
    clock = Clock()
    fleet = coordinator(clock, stopped_at=float("-inf"))
    assert not fleet.quiet
    assert [engine for engine, _ in fleet.on_demand("e1", p.Demand("e1", True, {"u": 1}))]
