"""Live push over real ZMQ sockets on 127.0.0.1, against a real SQLite database.

The server runs in-process (its own thread, as in `output-rate serve`); the
engines are protocol clients (``PushClient``) feeding real limiters, driven
here the way the scheduler drives them between steps.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from control_plane.config import service as config
from control_plane.db import Database, make_engine
from control_plane.engines.service import list_engines
from control_plane.limits import service as limits
from control_plane.push.drops import DropLog
from control_plane.push.outbox import Outbox
from control_plane.push.peers import PeerTable
from control_plane.push.server import PushServer
from control_plane.push.status import StatusWriter
from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import LimitTable, PushClient
from harness.control_plane import fresh_database
from output_rate_core import protocol as p

WAIT_S = 20.0


@pytest.fixture
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    # SQLite unless a test asks for more (indirect parametrization).
    with fresh_database(getattr(request, "param", "sqlite"), tmp_path) as url:
        database = Database(make_engine(url))
        yield database
        database.dispose()


def write(db: Database, server: PushServer | None, fn: Callable, **kw) -> None:
    db.write_now(fn, actor="test", **kw)
    if server is not None:
        server.notify(db.read_now(config.current_version))


def expected(db: Database) -> tuple[int, int | None, dict[str, int | None]]:
    snap = db.read_now(config.load_snapshot)
    limiter = OutputRateLimiter(None)
    LimitTable.from_snapshot(snap).load(limiter)
    return snap.version, limiter.default_rate, limiter.user_rates()


class Engine:
    """A protocol client and the limiter it feeds."""

    def __init__(
        self,
        endpoint: str,
        name: str,
        public_key: str | None = None,
        secret_key: str | None = None,
    ) -> None:
        self.limiter = OutputRateLimiter(None)
        self.client = PushClient(
            endpoints=[endpoint],
            engine_id=name,
            model="tiny",
            server_public_key=public_key,
            client_secret_key=secret_key,
        )
        self.client.start()

    def state(self) -> tuple[int, int | None, dict[str, int | None]]:
        self.client.apply_pending(self.limiter)
        return self.client.applied_version, self.limiter.default_rate, self.limiter.user_rates()


def converge(engines: list[Engine], db: Database, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    want = expected(db)
    while time.monotonic() < deadline:
        if all(e.state() == want for e in engines):
            return want
        time.sleep(0.02)
    raise AssertionError(f"not converged to {want[0]}: {[e.state()[0] for e in engines]}")


@pytest.fixture
def server(db: Database) -> Iterator[PushServer]:
    srv = PushServer(endpoint="tcp://127.0.0.1:0", db=db)
    srv.start()
    yield srv
    srv.close()


def seed(db: Database) -> None:
    write(db, None, limits.put_tier, name="free", rate=20, description=None)
    write(db, None, limits.put_default, rate=50)
    write(db, None, limits.put_limit, user="a", rate=None, tier="free")
    write(db, None, limits.put_limit, user="b", rate=7, tier="free")


@pytest.mark.parametrize(
    "db",
    ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_snapshot_then_deltas_then_acks(db, server: PushServer) -> None:
    seed(db)
    engine = Engine(server.endpoint, "e1")
    try:
        version, default, rates = converge([engine], db)
        assert (default, rates) == (50, {"a": 20, "b": 7})
        write(db, server, limits.put_tier, name="free", rate=99, description=None)
        version, _, rates = converge([engine], db)
        assert rates == {"a": 99, "b": 7}
        assert engine.limiter.rate_of("nobody") == 50
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            engines = db.read_now(list_engines, timeout_s=5).model_dump()["items"]
            if engines and engines[0]["applied_version"] == version:
                break
            time.sleep(0.05)
        assert engines[0]["engine_id"] == "e1"
        assert engines[0]["connected"] is True
        assert engines[0]["applied_version"] == version
    finally:
        engine.client.close()


class FaultyOutbox(Outbox):
    """Drops and reorders deltas at the send seam."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(3)
        self.held: list[tuple[bytes, bytes]] = []
        self.num_faults = 0

    def send(self, identity: bytes, frame: bytes) -> bool:
        if p.peek_type(frame) == p.DELTA and self.rng.random() < 0.3:
            self.num_faults += 1
            if self.rng.random() < 0.5:
                return True  # dropped on the way
            self.held.append((identity, frame))  # delivered later, out of order
            return True
        queued = super().send(identity, frame)
        while self.held and self.rng.random() < 0.5:
            super().send(*self.held.pop())
        return queued


def test_dropped_and_reordered_deltas_resync_to_the_database(db) -> None:
    faults = FaultyOutbox()
    server = PushServer(endpoint="tcp://127.0.0.1:0", db=db, outbox=faults)
    server.start()
    engine = Engine(server.endpoint, "e1")
    try:
        # An empty database looks like a fresh engine: wait for the snapshot itself, or
        # a loaded server may answer the HELLO after all 60 writes (no delta at all).
        assert engine.client.wait_for_snapshot(WAIT_S)
        converge([engine], db)
        # Until some deltas were dropped or reordered (a loaded machine can let the server
        # answer a burst with a snapshot instead, which injects nothing).
        for i in range(600):
            write(db, server, limits.put_limit, user=f"u{i % 7}", rate=i + 1, tier=None)
            engine.state()
            if i >= 60 and faults.num_faults > 0:
                break
        assert faults.num_faults > 0
        converge([engine], db)
        assert engine.client.num_resyncs > 0
    finally:
        engine.client.close()
        server.close()


@pytest.mark.parametrize(
    "db",
    ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_twenty_engines_converge_after_a_burst_of_1000_changes(db, server: PushServer) -> None:
    seed(db)
    engines = [Engine(server.endpoint, f"e{i}") for i in range(20)]
    try:
        converge(engines, db)
        rng = random.Random(1)
        for _ in range(1000):
            kind = rng.random()
            if kind < 0.7:
                tier = rng.choice([None, "free"])
                rate = rng.choice([None, rng.randint(1, 1000)])
                write(
                    db,
                    server,
                    limits.put_limit,
                    user=f"u{rng.randrange(200)}",
                    rate=rate,
                    tier=tier,
                )
            elif kind < 0.75:
                write(db, server, limits.delete_limit, user=f"u{rng.randrange(200)}")
            elif kind < 0.85:
                write(
                    db,
                    server,
                    limits.put_tier,
                    name="free",
                    rate=rng.randint(1, 500),
                    description=None,
                )
            else:
                write(
                    db,
                    server,
                    limits.put_default,
                    rate=rng.choice([None, rng.randint(1, 100)]),
                )
        version, _, _ = converge(engines, db, timeout_s=60)
        assert version > 900
    finally:
        for e in engines:
            e.client.close()


def test_wrong_server_key_gets_nothing(db) -> None:
    public, secret = zmq.curve_keypair()
    wrong_public, _ = zmq.curve_keypair()
    server = PushServer(endpoint="tcp://127.0.0.1:0", db=db, secret_key=secret.decode())
    server.start()
    seed(db)
    good = Engine(server.endpoint, "good", public.decode())
    bad = Engine(server.endpoint, "bad", wrong_public.decode())
    plain = Engine(server.endpoint, "plain", None)
    try:
        converge([good], db)
        time.sleep(1.0)
        for engine in (bad, plain):
            assert engine.state() == (0, None, {})
            assert not engine.client.has_snapshot
    finally:
        for e in (good, bad, plain):
            e.client.close()
        server.close()


def test_garbage_and_oversized_frames_are_dropped_and_counted(db, server: PushServer) -> None:
    seed(db)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    garbage = [
        b"",
        b"\xff",
        bytes([p.HELLO]) + b"\x00garbage",
        bytes([p.ACK]) + b"\x93",
        p.encode(p.Delta(1, [])),  # a server-only message from an engine
    ]
    for frame in garbage:
        sock.send(frame)
    sock.send_multipart([b"a", b"b", b"c"])
    # Over the engine-message limit: ZMQ drops that connection, the server lives on.
    sock.send(bytes([p.USAGE]) + b"\x00" * p.MAX_ENGINE_MESSAGE_BYTES)
    engine = Engine(server.endpoint, "e1")
    try:
        deadline = time.monotonic() + WAIT_S
        while server.drops.total < len(garbage) + 1:
            assert time.monotonic() < deadline, server.drops.total
            time.sleep(0.02)
        converge([engine], db)
        write(db, server, limits.put_default, rate=9)
        assert converge([engine], db)[1] == 9
        assert {peer.engine_id for peer in server.peers.all()} == {"e1"}
    finally:
        engine.client.close()
        sock.close()
        context.term()


def test_only_listed_engine_keys_are_admitted(db) -> None:
    server_public, server_secret = zmq.curve_keypair()
    allowed_public, allowed_secret = zmq.curve_keypair()
    _, stranger_secret = zmq.curve_keypair()
    server = PushServer(
        endpoint="tcp://127.0.0.1:0",
        db=db,
        secret_key=server_secret.decode(),
        client_public_keys=[allowed_public.decode()],
    )
    server.start()
    seed(db)
    key = server_public.decode()
    good = Engine(server.endpoint, "good", key, allowed_secret.decode())
    stranger = Engine(server.endpoint, "stranger", key, stranger_secret.decode())
    try:
        converge([good], db)
        write(db, server, limits.put_default, rate=3)
        converge([good], db)
        time.sleep(1.0)
        assert stranger.state() == (0, None, {})
        assert not stranger.client.has_snapshot
        # The server never heard from it either: no hello, no heartbeat, no usage.
        assert {peer.engine_id for peer in server.peers.all()} == {"good"}
    finally:
        for e in (good, stranger):
            e.client.close()
        server.close()


def test_usage_engines_and_metrics_through_the_api(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from control_plane.app import create_served_app
    from harness.control_plane import ADMIN_TOKEN
    from tests.control_plane.factories import make_settings

    with fresh_database("sqlite", tmp_path) as url:
        settings = make_settings(url, zmq_endpoint="tcp://127.0.0.1:0", engine_timeout_s=1.5)
        served = create_served_app(settings)
        app, server = served.app, served.push
        server.start()
        api = TestClient(app, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        engine = Engine(server.endpoint, "e1")
        try:
            assert api.put("/tiers/free", json={"output_tokens_per_second": 20}).status_code == 200
            put = api.put("/limits/a", json={"tier": "free"})
            assert put.status_code == 200
            version = put.json()["version"]
            deadline = time.monotonic() + WAIT_S
            while engine.state()[0] < version and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.limiter.rate_of("a") == 20
            # Half of user a's request-steps were throttled in the reported interval.
            engine.client.report_usage(granted={"a": 20}, throttled={"a": 20})
            deadline = time.monotonic() + WAIT_S
            while not (items := api.get("/usage").json()["items"]):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            (row,) = items
            assert row["user"] == "a" and row["limit"] == 20
            assert row["throttled_fraction"] == 0.5
            assert row["output_tokens_per_second_10s"] > 0
            while True:
                # Its row is written once it acknowledged its snapshot (a proven engine).
                items = api.get("/engines").json()["items"]
                if items and items[0]["applied_version"] == version:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.05)
            (listed,) = items
            assert listed["engine_id"] == "e1" and listed["connected"] is True
            assert listed["applied_version"] == version
            metrics = api.get("/metrics").text
            assert "output_rate_engines_connected 1.0" in metrics
            assert 'output_rate_user_output_tokens_per_second{user="a"}' in metrics
            engine.client.close()
            while api.get("/engines").json()["items"][0]["connected"]:
                assert time.monotonic() < deadline + WAIT_S
                time.sleep(0.1)
        finally:
            engine.client.close()
            server.close()
            served.db.dispose()


def test_borrowed_tokens_two_engines_report_are_summed_on_get_usage(tmp_path: Path) -> None:
    """Real engine-side clients, a real push server and the REST app: what each engine
    reports as borrowed reaches GET /usage, summed over the engines, beside the limit and
    the ceiling it was borrowed under."""
    from fastapi.testclient import TestClient

    from control_plane.app import create_served_app
    from harness.control_plane import ADMIN_TOKEN
    from tests.control_plane.factories import make_settings

    with fresh_database("sqlite", tmp_path) as url:
        settings = make_settings(url, zmq_endpoint="tcp://127.0.0.1:0")
        served = create_served_app(settings)
        app, server = served.app, served.push
        server.start()
        api = TestClient(app, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        engines = [Engine(server.endpoint, "e1"), Engine(server.endpoint, "e2")]
        try:
            tier = {"output_tokens_per_second": 20, "ceiling_output_tokens_per_second": 60}
            assert api.put("/tiers/free", json=tier).status_code == 200
            put = api.put("/limits/a", json={"tier": "free"})
            version = put.json()["version"]
            deadline = time.monotonic() + WAIT_S
            while any(e.state()[0] < version for e in engines):
                assert time.monotonic() < deadline
                time.sleep(0.01)

            def usage_of_a(since_total: float) -> dict:
                while True:
                    items = api.get("/usage").json()["items"]
                    if items and items[0]["output_tokens_per_second_10s"] > since_total:
                        return items[0]
                    assert time.monotonic() < deadline
                    time.sleep(0.02)

            # e1: 12 of its 30 tokens lent beyond the rate.
            engines[0].client.report_usage(granted={"a": 30}, throttled={}, borrowed={"a": 12})
            first = usage_of_a(0.0)
            assert (first["user"], first["limit"], first["ceiling"]) == ("a", 20, 60)
            total_1 = first["output_tokens_per_second_10s"]
            assert first["borrowed_output_tokens_per_second_10s"] == pytest.approx(
                0.4 * total_1, abs=0.002
            )
            assert first["borrowed_output_tokens_per_second_1s"] == pytest.approx(
                0.4 * first["output_tokens_per_second_1s"], abs=0.002
            )
            # e2: 6 of its 30. Each engine's rate is over the interval it measured: the
            # view adds e2's share of borrowed to e1's.
            engines[1].client.report_usage(granted={"a": 30}, throttled={}, borrowed={"a": 6})
            both = usage_of_a(total_1)
            added = both["output_tokens_per_second_10s"] - total_1
            assert both["borrowed_output_tokens_per_second_10s"] == pytest.approx(
                0.4 * total_1 + 0.2 * added, abs=0.004
            )
            assert (
                both["borrowed_output_tokens_per_second_10s"]
                > (first["borrowed_output_tokens_per_second_10s"])
            )
        finally:
            for engine in engines:
                engine.client.close()
            server.close()
            served.db.dispose()


def test_malformed_frames_are_logged_once_then_summarised(
    db, server: PushServer, caplog: pytest.LogCaptureFixture
) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        with caplog.at_level("WARNING", logger="control_plane.push.drops"):
            for _ in range(500):
                sock.send(b"\xff")
            deadline = time.monotonic() + WAIT_S
            while server.drops.total < 500:
                assert time.monotonic() < deadline, server.drops.total
                time.sleep(0.02)
        lines = [r for r in caplog.records if "dropped" in r.getMessage()]
        assert 1 <= len(lines) <= 2  # the first one, and at most one summary
    finally:
        sock.close()
        context.term()
    log = DropLog(interval_s=10.0)
    with caplog.at_level("WARNING", logger="control_plane.push.drops"):
        caplog.clear()
        for _ in range(1000):
            log.note("malformed", "x")
        log.flush(0.0)
        log.flush(5.0)  # within the interval: nothing new
        log.flush(11.0)  # nothing pending since the last summary
    assert log.total == 1000
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "999 malformed" in messages[1]


@pytest.mark.parametrize(
    "db", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_a_row_the_database_refuses_does_not_keep_the_others_stale(db) -> None:
    drops = DropLog()
    peers = PeerTable(drops, client_keys=None, engine_timeout_s=5.0)
    status = StatusWriter(
        db,
        peers=peers,
        drops=drops,
        wake=lambda: None,
        replica_id=None,
        engine_timeout_s=5.0,
        engine_retention_s=60.0,
        term=None,
    )
    status.start()
    now = time.monotonic()
    # Such an id can no longer come off the wire; the database is the last line.
    for identity, engine_id in ((b"good", "good"), (b"bad", "bad\x00id")):
        peers.prove(peers.bind(identity, engine_id, p.ENGINE_ROLE, "m", None, now))
        status.touch(identity)
    status.flush(now)
    status.close([])  # after the batch was written
    status.deliver()
    rows = db.read_now(list_engines, timeout_s=5).model_dump()["items"]
    assert [(r["engine_id"], r["connected"]) for r in rows] == [("good", True)]
    assert [peer.engine_id for peer in peers.all()] == ["good"]
    assert drops.total == 1


def test_an_engine_id_moves_to_a_new_connection_only_once_the_old_one_is_silent(db) -> None:
    server = PushServer(endpoint="tcp://127.0.0.1:0", db=db, engine_timeout_s=1.5)
    server.start()
    seed(db)
    context = zmq.Context()
    holder = context.socket(zmq.DEALER)
    holder.setsockopt(zmq.LINGER, 0)
    holder.connect(server.endpoint)
    holder.send(p.encode(p.Hello("e1", "old", 0)))
    assert holder.poll(int(WAIT_S * 1000)) and p.peek_type(holder.recv()) == p.SNAPSHOT
    engine = Engine(server.endpoint, "e1")
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # the holder is alive: e1 stays with it
            holder.send(p.encode(p.Heartbeat(0, "e1", "old")))
            assert engine.state()[0] == 0 and not engine.client.has_snapshot
            time.sleep(0.2)
        holder.close()  # silent now: after engine_timeout_s the real engine gets e1
        converge([engine], db)
        assert [peer.model for peer in server.peers.all()] == ["tiny"]
    finally:
        engine.client.close()
        context.term()
        server.close()
