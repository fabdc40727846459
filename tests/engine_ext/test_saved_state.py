"""The saved configuration (engine_ext/saved_state.py): real files in a temporary
directory, a real PushClient against a scripted server (a real ROUTER socket) and
against the real push server on a real SQLite database, with the real limiter."""

from __future__ import annotations

import logging
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from control_plane.config import service as config
from control_plane.db import Database, make_engine
from control_plane.keys import service as key_service
from control_plane.keys.bucket import TokenBucket
from control_plane.limits import service as limits
from control_plane.push.server import PushServer
from engine_ext.key_client import KeyClient
from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import PushClient
from engine_ext.saved_state import FORMAT, SavedFleet, SavedState, StateFile, StateWriter
from harness.control_plane import fresh_database
from harness.scripted_server import WAIT_S, ScriptedServer
from output_rate_core import protocol as p
from output_rate_core.policy import Policy

ENGINE_ID = "host-1:8000"
SNAP = p.Snapshot(
    version=5,
    default_rate=50,
    tiers={"free": 20},
    users={"a": ("free", None), "b": (None, 7), "fleet-user": (None, 40)},
    user_scopes={"b": "engine"},
    num_engines=4,
)


def eventually(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_saved_snapshot_reads_back_as_it_was(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    file = StateFile(state_dir, ENGINE_ID, p.ENGINE_ROLE)
    file.save(SNAP)
    loaded = file.load()
    assert loaded is not None
    assert loaded.snapshot == SNAP
    assert abs(loaded.saved_at - time.time()) < 60
    # Readable by the engine's user only: it lists limits and API key hashes.
    assert stat.S_IMODE(file.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    # Written atomically: no temporary file is left beside it.
    assert [f.name for f in state_dir.iterdir()] == [file.path.name]


def test_every_engine_id_and_role_has_a_file_of_its_own(tmp_path: Path) -> None:
    ids = ["a:1", "a%3A1", "[::1]:8000", "...", "a@b", "x-dp0"]
    paths = {StateFile(tmp_path, i, role).path for i in ids for role in (p.ENGINE_ROLE, p.API_ROLE)}
    assert len(paths) == 2 * len(ids)
    assert all(path.parent == tmp_path for path in paths)


def test_no_file_is_no_saved_state(tmp_path: Path) -> None:
    assert StateFile(tmp_path / "none", ENGINE_ID, p.ENGINE_ROLE).load() is None


@pytest.mark.parametrize(
    ("contents", "reason"),
    [
        (b"", "not usable"),
        (b"\x93garbage", "not usable"),
        (
            msgspec.msgpack.encode(
                SavedState(FORMAT + 1, ENGINE_ID, p.ENGINE_ROLE, 0.0, p.encode(SNAP))
            ),
            f"format {FORMAT + 1}",
        ),
        (
            msgspec.msgpack.encode(SavedState(FORMAT, "other:8000", "engine", 0.0, p.encode(SNAP))),
            "belongs to 'other:8000'",
        ),
        (
            msgspec.msgpack.encode(SavedState(FORMAT, ENGINE_ID, "api", 0.0, p.encode(SNAP))),
            "belongs to",
        ),
        (
            msgspec.msgpack.encode(
                SavedState(FORMAT, ENGINE_ID, "engine", 0.0, p.encode(p.Heartbeat(3)))
            ),
            "not a snapshot",
        ),
        (
            msgspec.msgpack.encode(
                SavedState(FORMAT, ENGINE_ID, "engine", 0.0, p.encode(SNAP)[:-3])
            ),
            "not usable",
        ),
    ],
)
def test_a_file_that_is_not_usable_is_logged_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, contents: bytes, reason: str
) -> None:
    file = StateFile(tmp_path, ENGINE_ID, p.ENGINE_ROLE)
    file.path.write_bytes(contents)
    with caplog.at_level(logging.WARNING):
        assert file.load() is None
    assert reason in caplog.text and str(file.path) in caplog.text


def test_an_unreadable_path_is_logged_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    file = StateFile(tmp_path, ENGINE_ID, p.ENGINE_ROLE)
    file.path.mkdir()  # a directory where the file should be
    with caplog.at_level(logging.WARNING):
        assert file.load() is None
    assert "cannot read" in caplog.text


def test_a_write_that_fails_is_logged_once_and_never_raises(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    writer = StateWriter(StateFile(blocker / "state", ENGINE_ID, p.ENGINE_ROLE))
    with caplog.at_level(logging.ERROR):
        writer.on_snapshot(SNAP)
        writer.on_ops(6, [p.SetUser("c", None, 3)])
        writer.close()
    assert caplog.text.count("cannot save the applied configuration") == 1
    assert writer.num_written == 0


def test_the_writer_follows_snapshots_ops_and_the_fleet_size(tmp_path: Path) -> None:
    file = StateFile(tmp_path, ENGINE_ID, p.ENGINE_ROLE)
    writer = StateWriter(file)
    writer.on_ops(4, [p.SetUser("z", None, 1)])  # no snapshot yet: nothing to build on
    writer.on_snapshot(SNAP)
    writer.on_ops(6, [p.SetTier("free", 30), p.DeleteUser("b")])
    writer.on_ops(7, [p.SetUser("c", None, 9, "engine", "shadow")])
    # Ceilings are kept like any other field of a policy.
    writer.on_ops(8, [p.SetUser("d", None, 5, ceiling=8), p.SetDefault(50, ceiling=60)])
    writer.on_fleet_size(2)
    writer.close()
    loaded = file.load()
    assert loaded is not None
    saved = loaded.snapshot
    assert saved.version == 8
    assert saved.num_engines == 2
    assert saved.default_policy == Policy(50, ceiling=60)
    assert saved.tier_policies() == {"free": Policy(30)}
    assert saved.user_policies() == {
        "a": ("free", Policy()),
        "fleet-user": (None, Policy(40)),
        "c": (None, Policy(9, "engine", "shadow")),
        "d": (None, Policy(5, ceiling=8)),
    }


def test_the_writer_keeps_the_fleet_counts_and_an_old_file_reads_as_none(tmp_path: Path) -> None:
    file = StateFile(tmp_path, ENGINE_ID, p.ENGINE_ROLE)
    writer = StateWriter(file)
    counts = SavedFleet(
        serving={"fleet-user": 1, "a": 3},
        serving_until={"a": 1.7e9},
        outage="keep",
        outage_keep_ms=30_000,
        lease_ms=10_000,
        in_outage=True,
    )
    writer.on_fleet(counts)  # no snapshot yet: nothing written
    writer.on_snapshot(SNAP)
    writer.close()
    loaded = file.load()
    assert loaded is not None and loaded.fleet == counts and loaded.snapshot == SNAP
    # A file written before the counts (the envelope without the field) reads as none.
    old = {
        "format": FORMAT,
        "engine_id": ENGINE_ID,
        "role": p.ENGINE_ROLE,
        "saved_at": 0.0,
        "snapshot": p.encode(SNAP),
    }
    file.path.write_bytes(msgspec.msgpack.encode(old))
    loaded = file.load()
    assert loaded is not None and loaded.fleet is None and loaded.snapshot == SNAP


def test_an_api_servers_file_keeps_the_keys_and_their_revocations(tmp_path: Path) -> None:
    key_hash, k1, k2 = "a" * 64, "a" * 12, "b" * 12
    file = StateFile(tmp_path, ENGINE_ID, p.API_ROLE)
    writer = StateWriter(file)
    writer.on_snapshot(p.Snapshot(3, None, {}, {}, keys={k1: ("alice", key_hash)}))
    writer.on_ops(4, [p.SetKey(k2, "bob", key_hash)])
    writer.on_ops(5, [p.DeleteKey(k1)])
    writer.close()
    loaded = file.load()
    assert loaded is not None
    assert (loaded.snapshot.version, loaded.snapshot.keys) == (5, {k2: ("bob", key_hash)})


# ---- a PushClient with a state directory ------------------------------------------


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    srv = ScriptedServer()
    yield srv
    srv.close()


class Engine:
    """A PushClient feeding a real limiter, with the engine's flags' limits."""

    def __init__(self, endpoint: str, state_dir: Path) -> None:
        self.limiter = OutputRateLimiter(None, {"flag-user": 3})
        self.file = StateFile(state_dir, ENGINE_ID, p.ENGINE_ROLE)
        self.client = PushClient(
            endpoints=(endpoint,),
            engine_id=ENGINE_ID,
            model="tiny",
            server_public_key=None,
            state=StateWriter(self.file),
        )

    def start(self) -> None:
        saved = self.file.load()
        if saved is not None:
            self.client.enforce_saved(self.limiter, saved.snapshot, saved.fleet)
        self.client.start()

    def pump(self) -> None:
        self.client.apply_pending(self.limiter)


def test_an_engine_restarted_without_a_control_plane_enforces_what_it_applied(
    server: ScriptedServer, tmp_path: Path
) -> None:
    first = Engine(server.endpoint, tmp_path)
    first.start()
    server.pump = first.pump
    identity, _ = server.recv(p.Hello)
    server.send(identity, SNAP)
    server.send(identity, p.Delta(6, [p.SetTier("free", 30), p.SetUser("b", None, None)]))
    server.send(identity, p.Shares(9, 1, 5_000, 2, True, {}))
    server.recv(p.ShareAck)
    assert first.client.applied_version == 6
    first.client.close()  # its last write is done when close returns

    # Started again with no control plane answering (a port nobody listens on).
    dead = ScriptedServer()
    dead_endpoint = dead.endpoint
    dead.close()
    second = Engine(dead_endpoint, tmp_path)
    second.start()
    try:
        assert not second.client.wait_for_snapshot(0.2)
        # Never the flags' limits alone, never unlimited for a user the snapshot limited:
        # what it applied last, fleet users at their safe share of the saved fleet (2).
        assert second.client.serving_saved and not second.client.is_in_sync
        assert second.client.applied_version == 6
        limiter = second.limiter
        assert limiter.default_rate == 25  # 50 tok/s over 2 engines
        assert limiter.user_rates() == {"a": 15, "fleet-user": 20}
        assert limiter.rate_of("b") == 25 and limiter.rate_of("flag-user") == 25
    finally:
        second.client.close()


def _dead_endpoint() -> str:
    dead = ScriptedServer()
    endpoint = dead.endpoint
    dead.close()
    return endpoint


def _shares_with_counts(server: ScriptedServer, engine: Engine, lease_ms: int) -> float:
    """The fleet user ("fleet-user", 40 tok/s) served here alone (its count: 1); "a" (20,
    the free tier) by 2 engines, then withdrawn here (the count is kept, 2 x lease + 1 s,
    from the arrival). Returns when the withdrawal was sent (before it arrived)."""
    server.pump = engine.pump
    identity, _ = server.recv(p.Hello)
    server.send(identity, SNAP)
    shares = {"fleet-user": 30_000, "a": 10_000}
    server.send(
        identity, p.Shares(9, 1, lease_ms, 4, True, shares, serving={"fleet-user": 1, "a": 2})
    )
    withdrawn_at = time.monotonic()
    server.send(identity, p.Shares(9, 2, lease_ms, 4, False, {"a": 0}))
    while server.recv(p.ShareAck)[1].seq < 2:
        pass
    return withdrawn_at


def test_an_engine_restarted_in_an_outage_enforces_the_outage_shares_it_did(
    server: ScriptedServer, tmp_path: Path
) -> None:
    """Restarted while the control plane is down, past its lease: "fleet-user" at 40 / 1
    and "a" at 20 / 2 as before the restart (the counts saved with their age), not the
    safe share of the saved fleet (40 / 4, 20 / 4); "a"'s count, kept past its share,
    still expires 2 s after its withdrawal (2 x 0.5 s + 1 s; 20 / 4 then)."""
    first = Engine(server.endpoint, tmp_path)
    first.start()
    withdrawn_at = _shares_with_counts(server, first, lease_ms=500)
    eventually(lambda: first.pump() is None and first.limiter.rate_of("fleet-user") == 40)
    assert first.limiter.rate_of("a") == 10
    first.client.close()

    second = Engine(_dead_endpoint(), tmp_path)
    second.start()
    try:
        assert second.client.serving_saved and second.client.table.fleet.in_outage
        assert second.limiter.rate_of("fleet-user") == 40
        assert time.monotonic() - withdrawn_at < 1.9
        assert second.limiter.rate_of("a") == 10
        eventually(lambda: second.pump() is None and second.limiter.rate_of("a") == 5)
        assert time.monotonic() - withdrawn_at >= 2.0
        assert second.limiter.rate_of("fleet-user") == 40  # held when the lease ended
    finally:
        second.client.close()


def test_an_engine_restarted_within_its_lease_waits_for_it_to_end(
    server: ScriptedServer, tmp_path: Path
) -> None:
    """Restarted before its lease ended (it holds no share now): the safe share of the
    saved fleet until the longest lease it was given has passed since the restart, then
    the outage share of the saved count; never the outage share while the others may
    still hold their shares."""
    first = Engine(server.endpoint, tmp_path)
    first.start()
    _shares_with_counts(server, first, lease_ms=1_000)
    first.client.close()
    second = Engine(_dead_endpoint(), tmp_path)
    started = time.monotonic()
    second.start()
    try:
        assert not second.client.table.fleet.in_outage
        assert second.limiter.rate_of("fleet-user") == 10  # 40 / 4
        eventually(lambda: second.pump() is None and second.limiter.rate_of("fleet-user") == 40)
        assert time.monotonic() - started >= 1.0
    finally:
        second.client.close()


def test_a_saved_engine_takes_the_control_planes_snapshot_when_it_answers(
    server: ScriptedServer, tmp_path: Path
) -> None:
    StateFile(tmp_path, ENGINE_ID, p.ENGINE_ROLE).save(SNAP)
    engine = Engine(server.endpoint, tmp_path)
    engine.start()
    server.pump = engine.pump
    try:
        # The HELLO says the version it holds; deltas are not taken on top of a saved
        # state, the snapshot is (what was revoked meanwhile applies now).
        identity, hello = server.recv(p.Hello)
        assert (hello.engine_id, hello.version) == (ENGINE_ID, 5)
        server.send(identity, p.Delta(6, [p.SetUser("x", None, 1)]))
        fresh = p.Snapshot(8, None, {}, {"b": (None, 2)}, user_scopes={"b": "engine"})
        server.send(identity, fresh)
        assert server.recv(p.Ack)[1] == p.Ack(ENGINE_ID, 8)
        eventually(lambda: engine.client.is_in_sync)
        assert not engine.client.serving_saved
        assert engine.limiter.default_rate is None
        assert engine.limiter.user_rates() == {"b": 2}
        eventually(lambda: (loaded := engine.file.load()) is not None and loaded.snapshot == fresh)
    finally:
        engine.client.close()


# ---- against the real push server (in-process, real SQLite) ------------------------


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    with fresh_database("sqlite", tmp_path) as url:
        database = Database(make_engine(url))
        yield database
        database.dispose()


def write(db: Database, server: PushServer | None, fn: Callable[..., Any], **kw: Any) -> Any:
    result = db.write_now(fn, actor="test", **kw)
    if server is not None:
        server.notify(db.read_now(config.current_version))
    return result


class Node:
    """An engine core and its API server, as `vllm serve` runs them, with one state dir."""

    def __init__(self, endpoint: str, state_dir: Path) -> None:
        self.limiter = OutputRateLimiter(None, {"alice": 1000})
        core_file = StateFile(state_dir, "node-1", p.ENGINE_ROLE)
        keys_file = StateFile(state_dir, "node-1", p.API_ROLE)
        common: dict[str, Any] = {
            "endpoints": [endpoint],
            "engine_id": "node-1",
            "model": "tiny",
            "server_public_key": None,
        }
        self.core = PushClient(**common, state=StateWriter(core_file))
        self.keys = KeyClient(**common, state=StateWriter(keys_file))
        for client, file in ((self.core, core_file), (self.keys, keys_file)):
            saved = file.load()
            if saved is None:
                continue
            if isinstance(client, PushClient):
                client.enforce_saved(self.limiter, saved.snapshot, saved.fleet)
            else:
                client.install_saved(saved.snapshot)
        self.core.start()
        self.keys.start()

    def pump(self) -> None:
        self.core.apply_pending(self.limiter)

    def until(self, condition: Callable[[], bool]) -> None:
        eventually(lambda: self.core.apply_pending(self.limiter) >= 0 and condition())

    def close(self) -> None:
        self.core.close()
        self.keys.close()


def test_limits_and_keys_survive_a_restart_while_the_control_plane_is_down(
    db: Database, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    server = PushServer(endpoint="tcp://127.0.0.1:0", db=db)
    server.start()
    endpoint = server.endpoint
    bucket = TokenBucket(per_minute=60_000, burst=1000)

    def create_key(user: str) -> tuple[str, str]:
        created = write(
            db, server, key_service.create_key, user=user, max_keys_per_user=10, bucket=bucket
        ).result
        return created.id, created.key

    write(db, server, limits.put_limit, user="alice", rate=30, tier=None)
    alice_key, bob_key = create_key("alice"), create_key("bob")
    node = Node(endpoint, state_dir)
    try:
        node.until(lambda: node.limiter.rate_of("alice") == 30)
        # Revoked before the outage: the saved keys no longer hold it.
        write(db, server, key_service.revoke_key, key_id=bob_key[0])
        node.until(lambda: node.keys.table.user_of(bob_key[1]) is None)
        version = db.read_now(config.current_version)
        node.until(lambda: node.core.applied_version == version)
    finally:
        node.close()
    # Changed while the engine is away, then the control plane goes down.
    write(db, server, limits.put_limit, user="alice", rate=5, tier=None)
    write(db, server, key_service.revoke_key, key_id=alice_key[0])
    server.close()

    node = Node(endpoint, state_dir)
    try:
        # What it applied last: never the flags' 1000, nor unlimited; the key it had works,
        # the one revoked before the outage does not.
        assert node.core.serving_saved and node.keys.serving_saved
        assert node.limiter.rate_of("alice") == 30
        assert node.keys.table.user_of(alice_key[1]) == (alice_key[0], "alice")
        assert node.keys.table.user_of(bob_key[1]) is None
        time.sleep(1.0)
        node.pump()
        assert node.limiter.rate_of("alice") == 30
        # The control plane comes back on its endpoint: what changed meanwhile applies.
        server = PushServer(endpoint=endpoint, db=db)
        server.start()
        node.until(lambda: node.core.is_in_sync and node.limiter.rate_of("alice") == 5)
        eventually(lambda: node.keys.table.user_of(alice_key[1]) is None)
        assert not node.core.serving_saved
    finally:
        node.close()
        server.close()
