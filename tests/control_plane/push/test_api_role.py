"""The "api" role on the push channel, over real ZMQ sockets against a real database: an
engine's API server gets the keys only (a key snapshot, key-only deltas with every
version), its engine core the limits only; both bind under one engine id, a second API
server for that id is refused; key-use reports set last_used_at, at most once a minute
per key; GET /engines shows what each engine's API server applied."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import zmq
from fastapi.testclient import TestClient
from sqlalchemy import event

from control_plane.app import create_app
from control_plane.config import service as config
from control_plane.db import Database, make_engine
from control_plane.engines.service import list_engines
from control_plane.fleet.coordinator import FleetCoordinator
from control_plane.keys import service as keys
from control_plane.keys.bucket import TokenBucket
from control_plane.keys.last_used import KeyUseRecorder
from control_plane.limits import service as limits
from control_plane.push.server import PushServer
from control_plane.usage.book import UsageBook
from harness.control_plane import ADMIN_TOKEN, fresh_database, serve
from output_rate_core import keys as key_format
from output_rate_core import protocol as p
from tests.control_plane.factories import make_settings

WAIT_S = 20.0
BUCKET = TokenBucket(per_minute=1_000_000, burst=1_000_000)


@pytest.fixture
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    with fresh_database(getattr(request, "param", "sqlite"), tmp_path) as url:
        database = Database(make_engine(url))
        yield database
        database.dispose()


@pytest.fixture
def book() -> UsageBook:
    return UsageBook()


@pytest.fixture
def recorder(db: Database) -> Iterator[KeyUseRecorder]:
    rec = KeyUseRecorder(db, flush_interval_s=0.05)
    rec.start()
    yield rec
    rec.close()


@pytest.fixture
def server(db: Database, book: UsageBook, recorder: KeyUseRecorder) -> Iterator[PushServer]:
    srv = PushServer(
        endpoint="tcp://127.0.0.1:0",
        db=db,
        usage=book,
        fleet=FleetCoordinator(lease_s=10.0),
        key_uses=recorder.add,
    )
    db.on_commit.append(srv.committed)
    srv.start()
    yield srv
    srv.close()


class Peer:
    """A hand-driven DEALER speaking the protocol."""

    def __init__(self, endpoint: str, *, server_public: str | None = None, secret: str = ""):
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if server_public is not None:
            self.sock.curve_secretkey = secret.encode()
            self.sock.curve_publickey = zmq.curve_public(secret.encode())
            self.sock.curve_serverkey = server_public.encode()
        self.sock.connect(endpoint)

    def send(self, message: p.Message) -> None:
        self.sock.send(p.encode(message))

    def next(self, kind: type[p.Message], timeout_s: float = WAIT_S) -> Any:
        """The next message of this kind (others, e.g. heartbeats, are skipped)."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(left * 1000)):
                message = p.decode(self.sock.recv())
                if isinstance(message, kind):
                    return message
        raise AssertionError(f"no {kind.__name__} within {timeout_s} s")

    def kinds(self, wait_s: float) -> list[type[p.Message]]:
        """Types of what arrives within wait_s."""
        got: list[type[p.Message]] = []
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(left * 1000)):
                got.append(type(p.decode(self.sock.recv())))
        return got

    def close(self) -> None:
        self.sock.close()
        self.context.term()


@pytest.fixture
def peers(server: PushServer) -> Iterator[Callable[[], Peer]]:
    made: list[Peer] = []

    def make() -> Peer:
        made.append(Peer(server.endpoint))
        return made[-1]

    yield make
    for peer in made:
        peer.close()


def create_key(db: Database, user: str) -> tuple[str, str]:
    created = db.write_now(
        keys.create_key, actor="test", user=user, max_keys_per_user=20, bucket=BUCKET
    ).result
    return created.id, created.key


def current(db: Database) -> int:
    return db.read_now(config.current_version)


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def engine_row(db: Database, engine_id: str) -> dict[str, Any] | None:
    rows = db.read_now(list_engines, timeout_s=5).model_dump()["items"]
    return next((r for r in rows if r["engine_id"] == engine_id), None)


@pytest.mark.parametrize(
    "db", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_the_api_server_gets_keys_only_and_the_engine_core_limits_only(
    db: Database, server: PushServer, peers: Callable[[], Peer]
) -> None:
    db.write_now(limits.put_tier, actor="test", name="free", rate=20, description=None)
    db.write_now(limits.put_limit, actor="test", user="alice", rate=None, tier="free")
    key_id, key = create_key(db, "alice")
    api, core = peers(), peers()
    api.send(p.Hello("e1", "", 0, role=p.API_ROLE))
    core.send(p.Hello("e1", "tiny", 0))
    snap = api.next(p.Snapshot)
    assert snap == p.Snapshot(
        version=3,
        default_rate=None,
        tiers={},
        users={},
        keys={key_id: ("alice", key_format.hash_key(key))},
    )
    engine_snap = core.next(p.Snapshot)
    assert (engine_snap.version, engine_snap.keys) == (3, {})
    assert engine_snap.users == {"alice": ("free", None)} and engine_snap.tiers == {"free": 20}

    # A limit change: the API server gets the version with no ops, the core the op.
    db.write_now(limits.put_default, actor="test", rate=9)
    assert api.next(p.Delta) == p.Delta(4, [])
    assert core.next(p.Delta) == p.Delta(4, [p.SetDefault(9)])
    # A key: the other way round.
    other_id, other = create_key(db, "bob")
    assert api.next(p.Delta) == p.Delta(5, [p.SetKey(other_id, "bob", key_format.hash_key(other))])
    assert core.next(p.Delta) == p.Delta(5, [])
    db.write_now(keys.revoke_key, actor="test", key_id=key_id)
    assert api.next(p.Delta) == p.Delta(6, [p.DeleteKey(key_id)])
    assert core.next(p.Delta) == p.Delta(6, [])
    # Server heartbeats carry the last version to each: no gap for either.
    assert api.next(p.Heartbeat).version == 6
    assert core.next(p.Heartbeat).version == 6

    # Both bound under one id; only the core is a fleet member.
    assert sorted(peer.role for peer in server.peers.all()) == ["api", "engine"]
    assert server.fleet is not None and server.fleet.num_engines == 1

    # Each role's applied version lands in its column of the one row.
    api.send(p.Ack("e1", 6))
    core.send(p.Ack("e1", 5))
    row = wait_for(
        lambda: (
            (r := engine_row(db, "e1"))
            and (r["api_applied_version"], r["applied_version"]) == (6, 5)
            and r
        ),
        "both applied versions",
    )
    assert (row["model"], row["connected"]) == ("tiny", True)


def test_a_second_api_server_for_one_engine_id_is_refused(
    db: Database, server: PushServer, peers: Callable[[], Peer]
) -> None:
    create_key(db, "alice")
    first, second, core = peers(), peers(), peers()
    first.send(p.Hello("e1", "", 0, role=p.API_ROLE))
    first.next(p.Snapshot)
    core.send(p.Hello("e1", "tiny", 0))
    core.next(p.Snapshot)
    dropped = server.drops.total
    second.send(p.Hello("e1", "", 0, role=p.API_ROLE))
    for _ in range(3):  # the first stays alive, so e1's API server role stays its own
        first.send(p.Heartbeat(1, "e1", "", role=p.API_ROLE))
        assert p.Snapshot not in second.kinds(0.3)
    assert server.drops.total == dropped + 1
    # Another engine id's API server binds.
    second_id = peers()
    second_id.send(p.Hello("e2", "", 0, role=p.API_ROLE))
    assert second_id.next(p.Snapshot).keys


def test_a_redialled_api_server_binds_by_its_heartbeat_as_api(
    db: Database, server: PushServer, peers: Callable[[], Peer]
) -> None:
    # After a control-plane restart a peer's first frame may be a HEARTBEAT or RESYNC.
    key_id, _ = create_key(db, "alice")
    beat, resync, core = peers(), peers(), peers()
    beat.send(p.Heartbeat(1, "e1", "", role=p.API_ROLE))
    assert key_id in beat.next(p.Snapshot).keys
    resync.send(p.Resync("e2", 1, role=p.API_ROLE))
    assert key_id in resync.next(p.Snapshot).keys
    core.send(p.Heartbeat(1, "e1", "tiny"))
    assert core.next(p.Snapshot).keys == {}
    # A bound connection cannot change its role.
    dropped = server.drops.total
    beat.send(p.Heartbeat(1, "e1", ""))
    beat.send(p.Resync("e1", 1))
    wait_for(lambda: server.drops.total == dropped + 2, "both refused")
    assert sorted(peer.role for peer in server.peers.all()) == ["api", "api", "engine"]


def test_an_api_server_is_no_fleet_member_and_its_usage_is_dropped(
    db: Database, server: PushServer, book: UsageBook, peers: Callable[[], Peer]
) -> None:
    db.write_now(limits.put_default, actor="test", rate=10)
    api = peers()
    api.send(p.Hello("e1", "", 0, role=p.API_ROLE))
    api.next(p.Snapshot)
    dropped = server.drops.total
    api.send(p.Usage("e1", 1.0, {"alice": 50}, {}))
    api.send(p.Demand("e1", True, {"alice": 3}))
    api.send(p.ShareAck("e1", 1, 1))
    wait_for(lambda: server.drops.total == dropped + 3, "three refused messages")
    assert book.rate_1s("alice") is None
    assert server.fleet is not None and server.fleet.num_engines == 1
    assert not server.fleet.shares_of("alice")
    assert p.Shares not in api.kinds(0.5)


def test_key_use_sets_last_used_at_and_a_flood_writes_once_a_minute(
    db: Database, server: PushServer, recorder: KeyUseRecorder, peers: Callable[[], Peer]
) -> None:
    key_id, _ = create_key(db, "alice")
    unused_id, _ = create_key(db, "alice")
    # Every row the database is asked to touch, counted at the driver.
    touched: list[str] = []

    def count(_conn, _cursor, statement, _parameters, context, _executemany) -> None:  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith("UPDATE API_KEYS"):
            touched.extend(str(row["key_id"]) for row in context.compiled_parameters)

    event.listen(db.engine, "before_cursor_execute", count)
    api, core = peers(), peers()
    api.send(p.Hello("e1", "", 0, role=p.API_ROLE))
    api.next(p.Snapshot)
    core.send(p.Hello("e1", "tiny", 0))
    core.next(p.Snapshot)

    def last_used(kid: str) -> datetime | None:
        items = db.read_now(keys.list_keys, user="alice").items
        return next(k.last_used_at for k in items if k.id == kid)

    first_use = time.time() - 30
    api.send(p.KeyUse("e1", {key_id: first_use, "zzzzzzzzzzzz": first_use}))
    used = wait_for(lambda: last_used(key_id), "last_used_at")
    assert abs(used.timestamp() - first_use) < 0.01
    # A flood within the minute: kept in memory, not written.
    latest = first_use
    for i in range(500):
        latest = first_use + 1 + i * 0.01
        api.send(p.KeyUse("e1", {key_id: latest, "zzzzzzzzzzzz": latest}))
    # An engine core may not report key use.
    dropped = server.drops.total
    core.send(p.KeyUse("e1", {unused_id: latest}))
    wait_for(lambda: server.drops.total == dropped + 1, "the core's report refused")
    time.sleep(0.5)  # ten flush intervals
    assert touched.count(key_id) == 1
    assert abs(last_used(key_id).timestamp() - first_use) < 0.01  # type: ignore[union-attr]
    assert last_used(unused_id) is None
    # An unknown id makes no row; the first report's write named it, nothing since.
    assert touched.count("zzzzzzzzzzzz") == 1
    assert len(db.read_now(keys.list_keys, user="alice").items) == 2
    # At shutdown what is pending is written: the newest use.
    recorder.close()
    assert touched.count(key_id) == 2
    assert abs(last_used(key_id).timestamp() - latest) < 0.01  # type: ignore[union-attr]
    event.remove(db.engine, "before_cursor_execute", count)


def test_the_coalescing_bound_is_one_write_per_key_per_interval(db: Database) -> None:
    key_id, _ = create_key(db, "alice")
    # A fake monotonic clock: the one seam, so that minutes pass at once.
    now = [0.0]
    recorder = KeyUseRecorder(db, write_interval_s=60.0, clock=lambda: now[0])
    writes = []
    for second in range(0, 600, 5):  # ten minutes of a report every 5 s
        now[0] = float(second)
        recorder.add({key_id: 1_700_000_000.0 + second})
        before = recorder.num_writes
        recorder.flush()
        writes.extend([second] * (recorder.num_writes - before))
    assert writes == list(range(0, 600, 60))
    # A use reported in the future is stored as now at the latest.
    recorder.add({key_id: time.time() + 86_400})
    recorder.flush(everything=True)
    stored = db.read_now(keys.list_keys, user="alice").items[0].last_used_at
    assert stored is not None and stored <= datetime.now(UTC)


def test_get_engines_shows_what_each_api_server_applied(
    db: Database, server: PushServer, peers: Callable[[], Peer]
) -> None:
    app = create_app(make_settings(str(db.engine.url)), db=db)
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        core = peers()
        core.send(p.Hello("e1", "tiny", 0))
        core.next(p.Snapshot)
        core.send(p.Ack("e1", 0))
        wait_for(lambda: client.get("/engines").json()["items"], "e1's row")
        assert client.get("/engines").json()["items"][0]["api_applied_version"] is None
        made = client.post("/users/alice/keys")
        assert made.status_code == 201
        api = peers()
        api.send(p.Hello("e1", "", 0, role=p.API_ROLE))
        assert api.next(p.Snapshot).version == 1
        api.send(p.Ack("e1", 1))
        row = wait_for(
            lambda: (
                (r := client.get("/engines").json()["items"][0])["api_applied_version"] == 1 and r
            ),
            "api_applied_version",
        )
        assert (row["applied_version"], row["connected"]) == (0, True)
        # A revocation reaches the API server as fast as a limit change, then shows here.
        assert client.delete(f"/keys/{made.json()['id']}").status_code == 204
        assert api.next(p.Delta, timeout_s=5).version == 2
        api.send(p.Ack("e1", 2))
        wait_for(
            lambda: client.get("/engines").json()["items"][0]["api_applied_version"] == 2,
            "the revocation applied",
        )
        # An API server alone (its engine core never connected) has a row, not connected.
        alone = peers()
        alone.send(p.Hello("e2", "", 0, role=p.API_ROLE))
        alone.next(p.Snapshot)
        alone.send(p.Ack("e2", 2))
        row = wait_for(
            lambda: next(
                (
                    r
                    for r in client.get("/engines").json()["items"]
                    if r["engine_id"] == "e2" and r["api_applied_version"] == 2
                ),
                None,
            ),
            "e2's row",
        )
        assert (row["connected"], row["api_applied_version"], row["model"]) == (False, 2, "")
        # /metrics lists each role under its own series, no duplicate samples.
        assert client.get("/metrics").status_code == 200


def test_the_curve_allow_list_binds_an_api_server_to_its_engine_ids(db: Database) -> None:
    server_public, server_secret = (k.decode() for k in zmq.curve_keypair())
    engine_public, engine_secret = (k.decode() for k in zmq.curve_keypair())
    create_key(db, "alice")
    srv = PushServer(
        endpoint="tcp://127.0.0.1:0",
        db=db,
        secret_key=server_secret,
        client_public_keys={engine_public: frozenset({"e1"})},
    )
    srv.start()
    own = Peer(srv.endpoint, server_public=server_public, secret=engine_secret)
    other = Peer(srv.endpoint, server_public=server_public, secret=engine_secret)
    try:
        own.send(p.Hello("e1", "", 0, role=p.API_ROLE))
        assert own.next(p.Snapshot).keys
        other.send(p.Hello("e2", "", 0, role=p.API_ROLE))
        assert p.Snapshot not in other.kinds(1.0)
        assert [peer.engine_id for peer in srv.peers.all()] == ["e1"]
    finally:
        own.close()
        other.close()
        srv.close()


def test_key_deltas_reach_a_busy_api_server_in_order(
    db: Database, server: PushServer, peers: Callable[[], Peer]
) -> None:
    api = peers()
    api.send(p.Hello("e1", "", 0, role=p.API_ROLE))
    api.next(p.Snapshot)
    writer = threading.Thread(
        target=lambda: [create_key(db, f"user-{i}") for i in range(30)], daemon=True
    )
    writer.start()
    versions = [api.next(p.Delta).version for _ in range(30)]
    writer.join()
    assert versions == list(range(1, 31))


def test_a_served_control_plane_records_key_use_and_flushes_it_at_shutdown(
    tmp_path: Path,
) -> None:
    with fresh_database("sqlite", tmp_path) as url:
        with serve(url, tmp_path) as served, served.client() as api:
            made = api.post("/users/alice/keys").json()
            peer = Peer(served.zmq_endpoint)
            try:
                peer.send(p.Hello("e1", "", 0, role=p.API_ROLE))
                assert made["id"] in peer.next(p.Snapshot).keys
                first = time.time() - 10
                peer.send(p.KeyUse("e1", {made["id"]: first}))

                def last_used() -> str | None:
                    items = api.get("/users/alice/keys").json()["items"]
                    return items[0]["last_used_at"]

                shown = wait_for(last_used, "last_used_at over REST")
                assert abs(datetime.fromisoformat(shown).timestamp() - first) < 0.01
                peer.send(p.KeyUse("e1", {made["id"]: first + 5}))
                time.sleep(0.5)  # received; within the minute, so only pending
                assert last_used() == shown
            finally:
                peer.close()
        # SIGTERM: the shutdown wrote what was pending.
        database = Database(make_engine(url))
        try:
            row = database.read_now(keys.list_keys, user="alice").items[0]
            assert row.last_used_at is not None
            assert abs(row.last_used_at.timestamp() - (first + 5)) < 0.01
        finally:
            database.dispose()
