"""PushClient against a scripted server: a real ROUTER socket on 127.0.0.1 that
this test drives frame by frame, so every fault (a gap, a duplicate, garbage, a
lost tail, silence) is exact. The limiter is the real one."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from engine_ext import vllm_compat
from engine_ext.limit_table import LimitTable
from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import USAGE_MIN_SPACING_S, PushClient, usage_parts
from harness.scripted_server import WAIT_S, ScriptedServer
from output_rate_core import protocol as p

# What every HELLO of these clients says they run: the vLLM installed here.
INSTALLED_VLLM = vllm_compat.installed_vllm_version() or ""


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    srv = ScriptedServer()
    yield srv
    srv.close()


class Engine:
    def __init__(self, *endpoints: str, **kwargs: object) -> None:
        self.limiter = OutputRateLimiter(None, {"flag-user": 3})
        self.wakes = 0
        self.client = PushClient(
            endpoints=endpoints,
            engine_id="e1",
            model="tiny",
            server_public_key=None,
            wake=self._wake,
            **kwargs,
        )
        self.client.start()

    def _wake(self) -> None:
        self.wakes += 1

    def until(self, condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
        """Run the engine thread's part (apply_pending) until the condition holds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.client.apply_pending(self.limiter)
            if condition():
                return
            time.sleep(0.005)
        raise AssertionError("condition not reached")


@pytest.fixture
def engine(server: ScriptedServer) -> Iterator[Engine]:
    e = Engine(server.endpoint)
    server.pump = lambda: e.client.apply_pending(e.limiter)
    yield e
    e.client.close()


SNAP = p.Snapshot(
    version=5,
    default_rate=50,
    tiers={"free": 20, "pro": None},
    users={"a": ("free", None), "b": ("free", 7), "c": (None, 9), "d": ("pro", None)},
)


def connect(server: ScriptedServer, engine: Engine, snap: p.Snapshot = SNAP) -> bytes:
    identity, hello = server.recv(p.Hello)
    assert hello == p.Hello("e1", "tiny", 0, vllm_version=INSTALLED_VLLM)
    server.send(identity, snap)
    engine.until(lambda: engine.client.applied_version == snap.version)
    _, ack = server.recv(p.Ack)
    assert ack == p.Ack("e1", snap.version)
    return identity


def test_snapshot_replaces_the_flags_limits(server: ScriptedServer, engine: Engine) -> None:
    assert not engine.client.wait_for_snapshot(0.05)
    connect(server, engine)
    assert engine.client.wait_for_snapshot(0)
    assert engine.limiter.default_rate == 50
    # Users with neither tier nor override are not listed: they get the default.
    assert engine.limiter.user_rates() == {"a": 20, "b": 7, "c": 9, "d": None}
    assert engine.limiter.rate_of("flag-user") == 50
    assert engine.wakes >= 1


def test_deltas_in_order_update_every_affected_user(server: ScriptedServer, engine: Engine) -> None:
    identity = connect(server, engine)
    deltas = [
        p.Delta(6, [p.SetTier("free", 30)]),  # a follows its tier; b keeps its override
        p.Delta(7, [p.SetUser("b", "free", None), p.SetUser("e", None, 4)]),
        p.Delta(8, [p.DeleteUser("c"), p.SetDefault(None)]),
        p.Delta(9, [p.SetUser("d", None, None), p.DeleteTier("pro")]),
    ]
    for delta in deltas:
        server.send(identity, delta)
    engine.until(lambda: engine.client.applied_version == 9)
    assert engine.limiter.default_rate is None
    assert engine.limiter.user_rates() == {"a": 30, "b": 30, "e": 4}
    assert [server.recv(p.Ack)[1].version for _ in deltas] == [6, 7, 8, 9]  # type: ignore[union-attr]


def test_duplicates_are_not_applied_twice(server: ScriptedServer, engine: Engine) -> None:
    identity = connect(server, engine)
    server.send(identity, p.Delta(6, [p.SetUser("c", None, 1)]))
    engine.until(lambda: engine.client.applied_version == 6)
    server.send(identity, p.Delta(6, [p.SetUser("c", None, 2)]))  # same version, other content
    server.send(identity, p.Delta(5, [p.SetUser("c", None, 3)]))
    server.send(identity, p.Delta(7, [p.SetUser("z", None, 8)]))
    engine.until(lambda: engine.client.applied_version == 7)
    assert engine.limiter.rate_of("c") == 1
    assert engine.client.num_resyncs == 0


def test_a_gap_asks_for_a_snapshot_and_ignores_deltas_until_it_comes(
    server: ScriptedServer, engine: Engine
) -> None:
    identity = connect(server, engine)
    server.send(identity, p.Delta(7, [p.SetUser("c", None, 1)]))  # 6 was lost
    _, resync = server.recv(p.Resync)
    assert resync == p.Resync("e1", 5)
    server.send(identity, p.Delta(6, [p.SetUser("c", None, 2)]))  # late, still resyncing
    server.send(identity, p.Delta(8, [p.SetUser("c", None, 3)]))
    fresh = p.Snapshot(8, 50, {"free": 20}, {"c": (None, 3), "a": ("free", None)})
    server.send(identity, fresh)
    engine.until(lambda: engine.client.applied_version == 8)
    assert engine.limiter.user_rates() == {"a": 20, "c": 3}
    server.send(identity, p.Delta(9, [p.SetTier("free", 21)]))
    engine.until(lambda: engine.client.applied_version == 9)
    assert engine.limiter.rate_of("a") == 21


def test_a_lost_last_delta_is_found_by_the_server_heartbeat(
    server: ScriptedServer, engine: Engine
) -> None:
    identity = connect(server, engine)
    server.send(identity, p.Heartbeat(6))  # the server sent 6; it never arrived
    _, resync = server.recv(p.Resync)
    assert resync.version == 5  # type: ignore[union-attr]


def test_a_database_restored_to_an_older_version_is_followed(
    server: ScriptedServer, engine: Engine
) -> None:
    identity = connect(server, engine)
    server.send(identity, p.Heartbeat(2))  # the server's state went back to version 2
    _, resync = server.recv(p.Resync)
    assert resync.version == 5  # type: ignore[union-attr]
    server.send(identity, p.Snapshot(2, None, {}, {"a": (None, 1)}))
    engine.until(lambda: engine.client.applied_version == 2)
    assert engine.limiter.user_rates() == {"a": 1}
    assert engine.limiter.default_rate is None


def test_garbage_is_dropped_counted_and_followed_by_a_resync(
    server: ScriptedServer, engine: Engine
) -> None:
    identity = connect(server, engine)
    for frame in (b"\xff", bytes([p.DELTA]) + b"\xc1", p.encode(p.Hello("x", "y", 1))):
        server.send(identity, frame)
    server.recv(p.Resync)
    engine.until(lambda: engine.client.num_dropped == 3)
    assert engine.limiter.user_rates() == {"a": 20, "b": 7, "c": 9, "d": None}
    server.send(identity, SNAP)
    engine.until(lambda: not engine.client._resyncing)
    server.send(identity, p.Delta(6, [p.SetDefault(1)]))
    engine.until(lambda: engine.limiter.default_rate == 1)


def test_an_unanswered_resync_is_asked_again(server: ScriptedServer) -> None:
    engine = Engine(server.endpoint, resync_retry_s=0.2)
    server.pump = lambda: engine.client.apply_pending(engine.limiter)
    try:
        identity = connect(server, engine)
        server.send(identity, p.Delta(9, []))  # a gap; the snapshot never comes
        server.recv(p.Resync)
        engine.until(lambda: engine.client.num_resyncs >= 3)
        assert engine.client.applied_version == 5
    finally:
        engine.client.close()


def test_a_silent_server_gets_a_resync_then_a_new_connection(server: ScriptedServer) -> None:
    engine = Engine(server.endpoint, silence_s=0.4, reconnect_after_s=1.5, heartbeat_interval_s=0.1)
    server.pump = lambda: engine.client.apply_pending(engine.limiter)
    try:
        first = connect(server, engine)
        # Say nothing: first the engine asks this connection for a snapshot...
        identity, resync = server.recv(p.Resync)
        assert identity == first
        assert resync == p.Resync("e1", 5)
        # ...then, still unanswered, it dials again with the version it holds.
        identity, hello = server.recv(p.Hello)
        assert identity != first
        assert hello == p.Hello("e1", "tiny", 5, vllm_version=INSTALLED_VLLM)
        assert engine.client.num_reconnects >= 1 and engine.client.num_silences >= 1
        # Meanwhile it kept the last limits.
        assert engine.limiter.user_rates() == {"a": 20, "b": 7, "c": 9, "d": None}
        server.send(identity, p.Snapshot(6, 50, {}, {"c": (None, 2)}))
        engine.until(lambda: engine.client.applied_version == 6)
        assert engine.limiter.user_rates() == {"c": 2}
    finally:
        engine.client.close()


# ---- replicas (--control-plane-endpoint a,b) -------------------------------------

SNAP_RATES = {"a": 20, "b": 7, "c": 9, "d": None}


@pytest.fixture
def replicas() -> Iterator[list[ScriptedServer]]:
    servers = [ScriptedServer(), ScriptedServer()]
    yield servers
    for srv in servers:
        srv.close()


def test_a_silent_replica_is_left_for_the_next_round_robin(
    replicas: list[ScriptedServer], caplog: pytest.LogCaptureFixture
) -> None:
    first, second = replicas
    reconnect_after_s = 1.5
    engine = Engine(
        first.endpoint,
        second.endpoint,
        silence_s=0.4,
        reconnect_after_s=reconnect_after_s,
        heartbeat_interval_s=0.1,
    )
    try:
        first.pump = second.pump = lambda: engine.client.apply_pending(engine.limiter)
        before_snapshot = time.monotonic()
        old = connect(first, engine)
        assert engine.client.endpoint == first.endpoint
        # The first says nothing more: past one silence (not reconnect_after_s, which is
        # for a lone endpoint) the client says HELLO to the second with the version it
        # holds, and kept the first's limits meanwhile.
        identity, hello = second.recv(p.Hello)
        assert 0.4 <= time.monotonic() - before_snapshot < reconnect_after_s
        assert hello == p.Hello("e1", "tiny", 5, vllm_version=INSTALLED_VLLM)
        assert (engine.client.endpoint_index, engine.client.endpoint) == (1, second.endpoint)
        assert engine.limiter.user_rates() == SNAP_RATES
        assert f"moving to replica 2 of 2 at {second.endpoint}" in caplog.text
        second.send(identity, p.Snapshot(7, 50, {}, {"c": (None, 2)}))
        engine.until(lambda: engine.client.applied_version == 7)
        assert engine.limiter.user_rates() == {"c": 2}
        assert second.recv(p.Ack)[1] == p.Ack("e1", 7)
        # The second goes silent too: round robin, back to the first on a new connection.
        identity, hello = first.recv(p.Hello)
        assert identity != old
        assert hello == p.Hello("e1", "tiny", 7, vllm_version=INSTALLED_VLLM)
        assert engine.client.endpoint_index == 0
        assert engine.limiter.user_rates() == {"c": 2}
    finally:
        engine.client.close()


def test_a_replica_down_at_start_is_passed_within_the_silence_timeout(
    server: ScriptedServer,
) -> None:
    dead = ScriptedServer()
    dead_endpoint = dead.endpoint
    dead.close()  # nothing listens there now
    # A long reconnect timeout: only the rule for a replica that never answered can pass
    # the dead one this soon (and within the default snapshot timeout).
    engine = Engine(dead_endpoint, server.endpoint, silence_s=0.5, reconnect_after_s=30.0)
    try:
        started = time.monotonic()
        server.pump = lambda: engine.client.apply_pending(engine.limiter)
        connect(server, engine)
        assert time.monotonic() - started < 0.5 + WAIT_S / 3
        assert engine.client.endpoint_index == 1
        assert engine.limiter.user_rates() == SNAP_RATES
        # With several replicas one silence is enough to move on, answered or not (the
        # long reconnect timeout is for a lone endpoint): back to the first.
        silent_from = time.monotonic()
        while engine.client.endpoint_index != 0:
            assert time.monotonic() - silent_from < 0.5 + WAIT_S / 3, "never moved on"
            time.sleep(0.01)
    finally:
        engine.client.close()


def test_an_ipv6_replica_is_dialled() -> None:
    try:
        srv = ScriptedServer(address="tcp://[::1]:0")
    except zmq.ZMQError:
        pytest.skip("no IPv6 loopback here")
    engine = Engine(srv.endpoint)
    try:
        assert srv.endpoint.startswith("tcp://[::1]:")
        srv.pump = lambda: engine.client.apply_pending(engine.limiter)
        connect(srv, engine)
        assert engine.limiter.user_rates() == SNAP_RATES
    finally:
        engine.client.close()
        srv.close()


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("0.34.0", "0.34.0"),
        ("0.33.0rc1.dev2+g5f3e1a.cpu", "0.33.0rc1.dev2+g5f3e1a.cpu"),
        ("0.32.0 (patched)", ""),
        ("1" * 65, ""),
    ],
)
def test_hello_says_the_vllm_version_or_nothing_the_wire_refuses(
    server: ScriptedServer, given: str, said: str
) -> None:
    client = PushClient(
        endpoints=[server.endpoint],
        engine_id="e1",
        model="tiny",
        server_public_key=None,
        vllm_version=given,
    )
    client.start()
    try:
        _, hello = server.recv(p.Hello)
        assert hello == p.Hello("e1", "tiny", 0, vllm_version=said)
    finally:
        client.close()


def test_a_client_needs_an_endpoint() -> None:
    with pytest.raises(ValueError, match="at least one endpoint"):
        PushClient(endpoints=[], engine_id="e1", model="m", server_public_key=None)


def test_usage_and_heartbeats_reach_the_server(server: ScriptedServer, engine: Engine) -> None:
    connect(server, engine)
    # The engine's heartbeat restates what it applied (the first may predate the snapshot).
    beats = [server.recv(p.Heartbeat)[1] for _ in range(3)]
    assert beats[-1] == p.Heartbeat(5, "e1", "tiny")
    engine.client.report_usage(granted={"a": 10}, throttled={"a": 4, "b": 1})
    _, usage = server.recv(p.Usage)
    assert isinstance(usage, p.Usage)
    assert (usage.engine_id, usage.granted, usage.throttled) == ("e1", {"a": 10}, {"a": 4, "b": 1})
    assert usage.interval_s > 0


def test_apply_pending_is_cheap_when_nothing_arrived(
    server: ScriptedServer, engine: Engine
) -> None:
    connect(server, engine)
    engine.client.apply_pending(engine.limiter)
    start = time.perf_counter()
    for _ in range(10_000):
        engine.client.apply_pending(engine.limiter)
    per_call = (time.perf_counter() - start) / 10_000
    assert per_call < 50e-6  # a queue emptiness check; generous for a loaded machine


def test_wrong_server_key_reads_nothing() -> None:
    _, secret = zmq.curve_keypair()
    wrong, _ = zmq.curve_keypair()
    srv = ScriptedServer(secret_key=secret.decode())
    bad = PushClient(
        endpoints=[srv.endpoint], engine_id="bad", model="m", server_public_key=wrong.decode()
    )
    bad.start()
    try:
        # The handshake never completes: the server socket receives nothing from it.
        assert not srv.sock.poll(1500)
        assert not bad.wait_for_snapshot(0.1)
    finally:
        bad.close()
        srv.close()


def test_limit_table_flattens_like_the_control_plane() -> None:
    table = LimitTable.from_snapshot(SNAP)
    limiter = OutputRateLimiter(None)
    table.load(limiter)
    assert table.user_millis() == {"a": 20_000, "b": 7_000, "c": 9_000, "d": None}
    assert table.model.members == {"free": {"a", "b"}, "pro": {"d"}}
    table.apply(p.SetUser("a", "pro", None), limiter)
    assert table.model.members == {"free": {"b"}, "pro": {"a", "d"}}
    assert limiter.rate_of("a") is None


def test_ceilings_arrive_with_the_snapshot_and_each_delta(
    server: ScriptedServer, engine: Engine
) -> None:
    snap = msgspec.structs.replace(
        SNAP, tier_ceilings={"free": 25}, user_ceilings={"c": 12}, default_ceiling=60
    )
    identity = connect(server, engine, snap)
    table = engine.client.table
    assert [table.ceiling_milli(u) for u in ("a", "b", "c", "d", "nobody")] == [
        25_000,
        25_000,
        12_000,
        None,  # an unlimited tier: nothing to borrow
        60_000,
    ]
    server.send(identity, p.Delta(6, [p.SetTier("free", 20), p.SetUser("c", None, 9, ceiling=30)]))
    engine.until(lambda: engine.client.applied_version == 6)
    table = engine.client.table
    # The tier's ceiling is gone: a and b inherit the default's.
    assert [table.ceiling_milli(u) for u in ("a", "b", "c")] == [60_000, 60_000, 30_000]
    server.send(identity, p.Delta(7, [p.SetDefault(50)]))
    engine.until(lambda: engine.client.applied_version == 7)
    assert engine.client.table.ceiling_milli("a") is None


# ---- fleet shares (docs/fleet.md) ----------------------------------------------

FLEET_SNAP = p.Snapshot(
    version=5, default_rate=None, tiers={}, users={"a": (None, 40), "b": (None, 10)}, num_engines=2
)


def test_demand_goes_whole_after_a_snapshot_then_as_changes(
    server: ScriptedServer, engine: Engine
) -> None:
    connect(server, engine, FLEET_SNAP)
    assert engine.client.demand_due
    engine.client.report_demand({"a": 2})
    _, demand = server.recv(p.Demand)
    assert demand == p.Demand("e1", True, {"a": 2})
    assert not engine.client.demand_due
    engine.client.report_demand({"a": 2, "b": 1})
    assert server.recv(p.Demand)[1] == p.Demand("e1", False, {"b": 1})
    engine.client.report_demand({"a": 2, "b": 1})  # nothing changed: nothing sent
    engine.client.report_demand({"b": 3})
    assert server.recv(p.Demand)[1] == p.Demand("e1", False, {"b": 3, "a": 0})


def test_shares_are_applied_acknowledged_and_a_gap_asks_for_the_whole_table(
    server: ScriptedServer, engine: Engine
) -> None:
    identity = connect(server, engine, FLEET_SNAP)
    assert engine.limiter.milli_rate_of("a") == 20_000  # safe: 40 tok/s over 2 engines
    engine.client.report_demand({"a": 1})
    server.recv(p.Demand)
    server.send(identity, p.Shares(3, 1, 5_000, 2, True, {"a": 35_000}))
    engine.until(lambda: engine.limiter.milli_rate_of("a") == 35_000)
    assert server.recv(p.ShareAck)[1] == p.ShareAck("e1", 3, 1)
    server.send(identity, p.Shares(3, 3, 5_000, 2, False, {"a": 1_000}))  # seq 2 was lost
    engine.until(lambda: engine.client.demand_due)
    assert engine.limiter.milli_rate_of("a") == 35_000
    engine.client.report_demand({"a": 1})
    assert server.recv(p.Demand)[1] == p.Demand("e1", True, {"a": 1})


def test_shares_fall_back_to_the_safe_share_when_the_lease_ends(
    server: ScriptedServer, engine: Engine
) -> None:
    identity = connect(server, engine, FLEET_SNAP)
    server.send(identity, p.Shares(3, 1, 300, 2, True, {"a": 35_000}))
    engine.until(lambda: engine.limiter.milli_rate_of("a") == 35_000)
    engine.until(lambda: engine.limiter.milli_rate_of("a") == 20_000, timeout_s=3)


def _old_shares_frame(lease_ms: int, shares: dict[str, int]) -> bytes:
    """A Shares frame as a control plane from before outage policies sends it."""
    fields = {"epoch": 3, "seq": 1, "lease_ms": lease_ms, "num_engines": 2, "full": True}
    return bytes([p.SHARES]) + msgspec.msgpack.encode({**fields, "shares": shares})


@pytest.mark.parametrize(
    ("frame", "after_lease"),
    [
        # An older control plane: no policy, no count: the safe share (40 over 2 engines).
        (_old_shares_frame(300, {"a": 35_000}), 20_000),
        # The user served by this engine alone: its whole limit.
        (p.encode(p.Shares(3, 1, 300, 2, True, {"a": 35_000}, serving={"a": 1})), 40_000),
        (
            p.encode(p.Shares(3, 1, 300, 2, True, {"a": 35_000}, "fraction", 0, 0.25)),
            10_000,
        ),
    ],
    ids=["old-frame", "serving", "fraction"],
)
def test_the_outage_policy_sent_with_the_shares_applies_when_the_lease_ends(
    server: ScriptedServer, engine: Engine, frame: bytes, after_lease: int
) -> None:
    identity = connect(server, engine, FLEET_SNAP)
    server.send(identity, frame)
    engine.until(lambda: engine.limiter.milli_rate_of("a") == 35_000)
    assert server.recv(p.ShareAck)[1] == p.ShareAck("e1", 3, 1)
    engine.until(lambda: engine.client.table.fleet.in_outage, timeout_s=3)
    assert engine.limiter.milli_rate_of("a") == after_lease


def test_a_snapshot_in_an_outage_keeps_each_users_outage_share(
    server: ScriptedServer, engine: Engine
) -> None:
    identity = connect(server, engine, FLEET_SNAP)
    server.send(identity, p.Shares(3, 1, 300, 2, True, {"a": 35_000}, serving={"a": 1}))
    engine.until(lambda: engine.client.table.fleet.in_outage, timeout_s=3)
    assert engine.limiter.milli_rate_of("a") == 40_000
    # Another replica's snapshot (the engine moved) while no allocator sends shares.
    server.send(identity, msgspec.structs.replace(FLEET_SNAP, version=6))
    engine.until(lambda: engine.client.applied_version == 6)
    assert engine.limiter.milli_rate_of("a") == 40_000
    assert engine.limiter.milli_rate_of("b") == 5_000  # never shared: 10 over 2 engines


# A user id as long as allowed, of four-byte UTF-8 characters (U+1D11E).
def _long_id(i: int) -> str:
    return f"{i:06d}" + "\U0001d11e" * (256 - 6)


def test_the_largest_report_goes_in_parts_that_each_fit_a_frame() -> None:
    users = [_long_id(i) for i in range(p.MAX_USAGE_USERS)]
    granted = {u: 2**40 + i for i, u in enumerate(users)}  # 9-byte counts, the largest
    throttled = {u: 2**41 for u in users}
    would = {u: 2**42 for u in users}
    borrowed = {u: 2**40 for u in users}
    parts = usage_parts("e" * 256, 3600.0, granted, throttled, would, borrowed)
    frames = [p.encode(part) for part in parts]
    # Before: one ~41 MB frame, which the control plane refuses (and drops the connection).
    assert 1 < len(parts) <= p.MAX_USAGE_PARTS
    assert max(map(len, frames)) <= p.MAX_ENGINE_MESSAGE_BYTES
    assert [(part.part, part.num_parts) for part in parts] == [
        (i, len(parts)) for i in range(len(parts))
    ]
    assert {u: n for part in parts for u, n in part.granted.items()} == granted
    assert {u: n for part in parts for u, n in part.throttled.items()} == throttled
    assert {u: n for part in parts for u, n in part.would_throttle.items()} == would
    assert {u: n for part in parts for u, n in part.borrowed_counts.items()} == borrowed
    # Each user's counts travel together.
    assert all(
        part.granted.keys()
        == part.throttled.keys()
        == part.would_throttle.keys()
        == part.borrowed_counts.keys()
        for part in parts
    )
    assert sum(len(part.granted) for part in parts) == len(granted)


def test_a_report_that_fits_one_frame_goes_whole() -> None:
    granted = {f"user-{i}": 5 for i in range(20_000)}  # 40,000 entries of short ids
    (whole,) = usage_parts("e1", 1.0, granted, dict(granted))
    assert (whole.part, whole.num_parts, whole.granted) == (0, 1, granted)


def test_an_oversized_report_reaches_the_server_in_parts(
    server: ScriptedServer, engine: Engine
) -> None:
    connect(server, engine)
    granted = {_long_id(i): i + 1 for i in range(4500)}  # ~4.7 MB
    engine.client.report_usage(granted=granted, throttled={_long_id(0): 7})
    received: list[p.Usage] = []
    deadline = time.monotonic() + WAIT_S
    while not received or len(received) < received[0].num_parts:
        assert time.monotonic() < deadline, f"{len(received)} parts"
        if not server.sock.poll(20):
            continue
        _, frame = server.sock.recv_multipart()
        if p.peek_type(frame) == p.USAGE:
            # What the control plane's socket and decoder take from an engine.
            usage = p.decode(frame, max_bytes=p.MAX_ENGINE_MESSAGE_BYTES)
            assert isinstance(usage, p.Usage)
            received.append(usage)
    assert [u.part for u in received] == list(range(received[0].num_parts))
    assert len(received) > 1 and len({u.interval_s for u in received}) == 1
    assert {k: n for u in received for k, n in u.granted.items()} == granted
    assert {k: n for u in received for k, n in u.throttled.items()} == {_long_id(0): 7}


def test_reports_sooner_than_the_spacing_are_held_merged_and_sent_when_due(
    server: ScriptedServer, engine: Engine
) -> None:
    # An engine that goes idle after every short request reports each time: before, as
    # often as that (the control plane takes at most 4 a second from one engine).
    connect(server, engine)
    began = time.monotonic()
    engine.client.report_usage(granted={"a": 1}, throttled={})
    time.sleep(0.01)
    engine.client.report_usage(
        granted={"a": 2, "b": 5}, throttled={"b": 1}, would_throttle={"a": 1}, borrowed={"a": 1}
    )
    time.sleep(0.01)
    engine.client.report_usage(
        granted={"a": 4}, throttled={}, would_throttle={"a": 3}, borrowed={"a": 2}
    )
    _, first = server.recv(p.Usage)
    _, second = server.recv(p.Usage)
    arrived = time.monotonic() - began
    assert isinstance(first, p.Usage) and isinstance(second, p.Usage)
    assert (first.granted, first.throttled) == ({"a": 1}, {})
    # The two later intervals in one report, sent by the IO thread once due.
    assert (second.granted, second.throttled) == ({"a": 6, "b": 5}, {"b": 1})
    assert (first.would_throttle, second.would_throttle) == ({}, {"a": 4})
    assert (first.borrowed_counts, second.borrowed_counts) == ({}, {"a": 3})
    assert arrived >= USAGE_MIN_SPACING_S
    assert second.interval_s >= 0.02
    with pytest.raises(AssertionError):
        server.recv(p.Usage, timeout_s=1.0)  # nothing else: no report was sent twice


def test_the_lease_counts_from_the_arrival_of_the_shares_not_their_apply(
    server: ScriptedServer, engine: Engine
) -> None:
    """The allocator accounts a lease from when its message could arrive: an engine thread
    busy for a while after the frame came must not stretch it (docs/fleet.md, "Bound
    holes")."""
    identity = connect(server, engine, FLEET_SNAP)
    lease_ms, busy_s = 1_000, 0.6
    sent_at = time.monotonic_ns()
    server.send(identity, p.Shares(3, 1, lease_ms, 2, True, {"a": 35_000}))
    # The frame arrives while the engine thread is busy elsewhere (it applies nothing).
    time.sleep(busy_s)
    engine.client.apply_pending(engine.limiter)
    assert engine.limiter.milli_rate_of("a") == 35_000
    expires = engine.client.table.fleet.lease_expires_ns
    assert expires is not None
    # From the arrival (after the send), not from the apply (busy_s later).
    assert sent_at + lease_ms * 1_000_000 <= expires < sent_at + (lease_ms + 300) * 1_000_000


def test_leaving_is_the_last_frame_and_nothing_follows_it(
    server: ScriptedServer, engine: Engine
) -> None:
    connect(server, engine)
    engine.client.leave()  # as from a signal handler: returns at once
    _, leaving = server.recv(p.Leaving)
    assert leaving == p.Leaving("e1", p.ENGINE_ROLE)
    # Not even a heartbeat after it (one would bind the connection again).
    engine.client.report_usage(granted={"a": 1}, throttled={})
    assert server.sock.poll(int(2.5 * p.HEARTBEAT_INTERVAL_S * 1000)) == 0
    engine.client.close()


def test_a_snapshot_never_shrinks_the_fleet_only_shares_do(
    server: ScriptedServer, engine: Engine
) -> None:
    identity = connect(server, engine, FLEET_SNAP)
    assert engine.limiter.milli_rate_of("a") == 20_000  # safe: 40 tok/s over 2 engines
    # A restarted control plane: its first snapshot counts only the engines back so far.
    alone = msgspec.structs.replace(FLEET_SNAP, version=6, num_engines=1)
    server.send(identity, alone)
    engine.until(lambda: engine.client.applied_version == 6)
    assert engine.client.table.num_engines == 2
    assert engine.limiter.milli_rate_of("a") == 20_000
    # Its allocator, once it heard the fleet, says one engine: the whole limit.
    server.send(identity, p.Shares(9, 1, 5_000, 1, True, {}))
    engine.until(lambda: engine.limiter.milli_rate_of("a") == 40_000)
    # A larger fleet from a snapshot counts at once (an engine joining: "Bound holes").
    server.send(identity, msgspec.structs.replace(FLEET_SNAP, version=7, num_engines=4))
    engine.until(lambda: engine.client.applied_version == 7)
    assert engine.limiter.milli_rate_of("a") == 10_000
