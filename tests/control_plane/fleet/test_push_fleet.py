"""Fleet shares over real ZMQ sockets on 127.0.0.1: the real push server with its
allocator, a real SQLite database, and engines that are the real push client and
limiter (driven here the way the scheduler drives them between steps)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from control_plane.db import Database
from control_plane.fleet.coordinator import FleetCoordinator
from control_plane.limits import service as limits
from control_plane.push.server import PushServer
from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import PushClient
from output_rate_core import protocol as p
from tests.control_plane.push.test_push import db, write  # noqa: F401 (the db fixture)

WAIT_S = 20.0
LEASE_S = 1.5


class Engine:
    def __init__(self, endpoint: str, name: str) -> None:
        self.limiter = OutputRateLimiter(None)
        self.streams: dict[str, int] = {}
        self.stalled: frozenset[str] = frozenset()
        self.client = PushClient(
            endpoints=[endpoint], engine_id=name, model="tiny", server_public_key=None
        )
        self.client.start()

    def pump(self) -> None:
        """One scheduler step's worth: apply what came, say the demand."""
        self.client.apply_pending(self.limiter)
        self.client.report_demand(dict(self.streams), self.stalled)

    def share(self, user: str) -> int | None:
        return self.limiter.milli_rate_of(user)


def until(engines: list[Engine], condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for engine in engines:
            engine.pump()
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"not reached: {[(e.client.engine_id, e.share('u')) for e in engines]}")


@pytest.fixture
def fleet_server(db: Database) -> Iterator[PushServer]:  # noqa: F811
    server = PushServer(
        endpoint="tcp://127.0.0.1:0", db=db, fleet=FleetCoordinator(lease_s=LEASE_S)
    )
    server.start()
    yield server
    server.close()


@pytest.fixture
def engines(fleet_server: PushServer) -> Iterator[list[Engine]]:
    made = [Engine(fleet_server.endpoint, f"e{i}") for i in range(2)]
    yield made
    for engine in made:
        engine.client.close()


def test_one_limit_is_split_by_streams_and_follows_them(
    db: Database,  # noqa: F811
    fleet_server: PushServer,
    engines: list[Engine],
) -> None:
    write(db, fleet_server, limits.put_limit, user="u", rate=40, tier=None)
    a, b = engines
    until(engines, lambda: a.client.applied_version > 0 and b.client.applied_version > 0)
    a.streams, b.streams = {"u": 3}, {"u": 1}
    until(engines, lambda: (a.share("u"), b.share("u")) == (30_000, 10_000))
    # All the user's traffic moves to b: b gets the whole limit, a none.
    a.streams, b.streams = {}, {"u": 2}
    until(engines, lambda: b.share("u") == 40_000)
    assert a.share("u") == 20_000  # no share: the safe share, 40 over 2 engines
    # What the REST API shows (FleetView).
    assert fleet_server.fleet is not None
    assert fleet_server.fleet.shares_of("u") == {"e1": 40_000}
    assert fleet_server.fleet.num_shared_users("e1") == 1
    # A lower limit reaches b's share; without a limit nothing is split any more.
    write(db, fleet_server, limits.put_limit, user="u", rate=10, tier=None)
    until(engines, lambda: b.share("u") == 10_000)
    write(db, fleet_server, limits.delete_limit, user="u")
    until(engines, lambda: a.share("u") is None and b.share("u") is None)
    until(engines, lambda: fleet_server.fleet is not None and not fleet_server.fleet.shares_of("u"))


def _split_evenly(
    db: Database,  # noqa: F811
    fleet_server: PushServer,
    engines: list[Engine],
) -> tuple[Engine, Engine]:
    """User u at 40 tok/s with one stream on each engine: both hold half of it."""
    write(db, fleet_server, limits.put_limit, user="u", rate=40, tier=None)
    a, b = engines
    a.streams, b.streams = {"u": 1}, {"u": 1}
    until(engines, lambda: (a.share("u"), b.share("u")) == (20_000, 20_000))
    return a, b


def test_a_silent_engine_falls_back_to_its_safe_share_and_the_other_takes_the_limit(
    db: Database,  # noqa: F811
    fleet_server: PushServer,
    engines: list[Engine],
) -> None:
    a, b = _split_evenly(db, fleet_server, engines)
    until(engines, lambda: a.client.table.fleet.lease_expires_ns is not None)
    b.client.close()  # b dies: it says nothing any more
    # a keeps its share meanwhile (never more than the limit in total), then takes all
    # of it once b is gone (3 leases of silence).
    started = time.monotonic()
    until([a], lambda: a.share("u") == 40_000, timeout_s=5 * LEASE_S + 5)
    assert time.monotonic() - started >= 2 * LEASE_S


def test_an_engine_that_leaves_hands_its_share_to_the_other_at_once(
    db: Database,  # noqa: F811
    fleet_server: PushServer,
    engines: list[Engine],
) -> None:
    a, b = _split_evenly(db, fleet_server, engines)
    fleet = fleet_server.fleet
    assert fleet is not None and fleet.num_engines == 2
    left_at = time.monotonic()
    b.client.close(leave=True)  # b stops cleanly (SIGTERM): its last frame says so
    # a holds the whole limit well within one lease (the silent path takes three).
    until([a], lambda: a.share("u") == 40_000, timeout_s=LEASE_S)
    took_s = time.monotonic() - left_at
    assert fleet.shares_of("u") == {"e0": 40_000}
    assert fleet.num_engines == 1
    assert a.client.table.num_engines == 1  # every safe share follows the smaller fleet
    print(f"the whole limit on the survivor {1000 * took_s:.0f} ms after the leave")
    # b's id is free at once: the engine that replaces it binds without a refusal.
    again = Engine(fleet_server.endpoint, "e1")
    try:
        again.streams = {"u": 1}
        until([a, again], lambda: (a.share("u"), again.share("u")) == (20_000, 20_000))
        assert again.client.refusals == {}
    finally:
        again.client.close()


def test_share_frames_from_an_engine_or_an_unbound_connection_count_for_nothing(
    fleet_server: PushServer,
) -> None:
    import zmq

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(fleet_server.endpoint)
    try:
        before = fleet_server.drops.total
        sock.send(p.encode(p.Demand("ghost", True, {"u": 3})))  # no HELLO first
        sock.send(p.encode(p.ShareAck("ghost", 1, 1)))
        sock.send(p.encode(p.Shares(1, 1, 1000, 1, True, {"u": 1})))  # server-only
        deadline = time.monotonic() + WAIT_S
        while fleet_server.drops.total < before + 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fleet_server.drops.total == before + 3
        assert fleet_server.fleet is not None
        assert fleet_server.fleet.shares_of("u") == {}
    finally:
        sock.close()
        context.term()


def test_a_joining_engine_counts_itself_in_its_snapshots_fleet_size(
    db: Database,  # noqa: F811
    fleet_server: PushServer,
) -> None:
    """The second engine of a fleet starts at L / 2, not L: the snapshot it gets counts it
    (docs/fleet.md, "The bound"). A raw socket reads the snapshot frame itself, before any
    share message could restate the size."""
    import zmq

    write(db, fleet_server, limits.put_limit, user="u", rate=40, tier=None)
    first = Engine(fleet_server.endpoint, "first")
    fleet = fleet_server.fleet
    assert fleet is not None
    try:
        until([first], lambda: first.client.applied_version > 0 and fleet.size_with(["x"]) == 2)
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        try:
            sock.connect(fleet_server.endpoint)
            sock.send(p.encode(p.Hello("second", "tiny", 0)))
            assert sock.poll(int(WAIT_S * 1000))
            snapshot = p.decode(sock.recv())
            assert isinstance(snapshot, p.Snapshot)
            assert snapshot.num_engines == 2
            # One that is already in the fleet (a RESYNC, a repeated HELLO) counts once.
            assert fleet.size_with(["first"]) == 1
        finally:
            sock.close(linger=0)
            context.term()
    finally:
        first.client.close()


def test_a_saturated_engine_reports_stalled_and_the_other_takes_the_limit(
    db: Database,  # noqa: F811
    fleet_server: PushServer,
    engines: list[Engine],
) -> None:
    """The goal of demand by consumption (docs/fleet.md, "Demand"): a user with streams on
    a saturated engine and an idle one receives over 95 % of its limit where it runs."""
    write(db, fleet_server, limits.put_limit, user="u", rate=40, tier=None)
    saturated, idle = engines
    saturated.streams, idle.streams = {"u": 1}, {"u": 1}
    until(engines, lambda: (saturated.share("u"), idle.share("u")) == (20_000, 20_000))
    saturated.stalled = frozenset({"u"})
    until(engines, lambda: idle.share("u") == 39_999)
    assert saturated.share("u") == 1
    # Slots free again: the even split by streams comes back.
    saturated.stalled = frozenset()
    until(engines, lambda: (saturated.share("u"), idle.share("u")) == (20_000, 20_000))


def test_a_user_served_by_one_engine_keeps_its_whole_limit_when_the_control_plane_stops(
    db: Database,  # noqa: F811
    fleet_server: PushServer,
    engines: list[Engine],
) -> None:
    """The default outage policy ("serving", docs/fleet.md): at lease end a user falls to
    its limit over the engines serving it (1 here), not over the fleet (2)."""
    write(db, fleet_server, limits.put_limit, user="u", rate=40, tier=None)
    a, b = engines
    until(engines, lambda: a.client.applied_version > 0 and b.client.applied_version > 0)
    a.streams = {"u": 1}
    until(engines, lambda: a.share("u") == 40_000 and a.client.table.fleet.serving == {"u": 1})
    fleet_server.close()  # the control plane stops
    until(engines, lambda: a.client.table.fleet.in_outage, timeout_s=3 * LEASE_S)
    assert a.share("u") == 40_000
    assert b.share("u") == 20_000  # never served it: the safe share, 40 over 2 engines
