"""Where the push server's deltas come from (control_plane/push/log_reader.py): a write
committed here is sent from its own ops, with no read of the change log, when it is the
version right after the newest one read; any other version (a write this replica was not
told of, another replica's write) is read from the log. Real databases, a real push
server on 127.0.0.1, a hand-driven engine connection that sees every frame; every read of
the change log is recorded with the thread that made it. The log's safety-net poll runs
once an hour here: only the writes' hand-ins and notifications move the push."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from control_plane.db import Commit, ConfigChange, Database, make_engine
from control_plane.keys import service as keys
from control_plane.keys.bucket import TokenBucket
from control_plane.limits import service as limits
from control_plane.limits.plans import UserItem
from control_plane.push.log_reader import LogRead, LogReader
from control_plane.push.server import PushServer
from control_plane.replicas.notify import ChangeAnnouncer, ChangeListener, current_channel
from harness.control_plane import fresh_database
from output_rate_core import protocol as p
from output_rate_core.policy import Policy
from tests.control_plane.push.test_api_role import Peer

POLL_INTERVAL_S = 3600.0
WAIT_S = 20.0
BUCKET = TokenBucket(per_minute=60_000, burst=1000)


def log_reads(db: Database) -> list[str]:
    """The threads that read the change log through ``db`` from now on, one per read."""
    threads: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "config_changes" in statement:
            threads.append(threading.current_thread().name)

    event.listen(db.engine, "before_cursor_execute", record)
    return threads


def write(db: Database, fn: Callable[..., ConfigChange[Any]], **kw: Any) -> Commit:
    commit = db.write_now(fn, actor="test", **kw).commit
    assert commit is not None
    return commit


# Every kind of write: (the service, its request).
WRITES: list[tuple[Callable[..., ConfigChange[Any]], dict[str, Any]]] = [
    (limits.put_tier, {"name": "pro", "rate": 50, "description": "paid"}),
    (limits.put_tier, {"name": "trial", "rate": 1, "description": None}),
    (limits.put_limit, {"user": "alice", "rate": 5, "tier": None}),
    (limits.patch_limit, {"user": "alice", "changes": {"tier": "pro"}}),
    (limits.patch_tier, {"name": "pro", "changes": {"enforcement": "shadow"}}),
    (
        limits.bulk_put_limits,
        {"items": [UserItem(f"u{i}", "pro", Policy(i + 1, "engine")) for i in range(50)]},
    ),
    (limits.put_default, {"rate": 9, "scope": "engine", "enforcement": None}),
    (keys.create_key, {"user": "alice", "max_keys_per_user": 5, "bucket": BUCKET}),
    (limits.delete_limit, {"user": "alice"}),
    (limits.delete_tier, {"name": "trial"}),
]


def write_every_kind(db: Database) -> list[Commit]:
    commits = [write(db, fn, **kw) for fn, kw in WRITES]
    key_id = next(op.id for c in commits for op in c.ops if isinstance(op, p.SetKey))
    return [*commits, write(db, keys.revoke_key, key_id=key_id)]


@contextmanager
def pushing(db: Database) -> Iterator[tuple[PushServer, Peer, list[str]]]:
    """A push server told of every write committed through ``db``, an engine connection
    holding its snapshot, and the reads of the change log from then on."""
    reads = log_reads(db)
    server = PushServer(endpoint="tcp://127.0.0.1:0", db=db, poll_interval_s=POLL_INTERVAL_S)
    db.on_commit.append(server.committed)
    server.start()
    peer = Peer(server.endpoint)
    try:
        peer.send(p.Hello("e1", "tiny", 0))
        snapshot = peer.next(p.Snapshot)
        peer.send(p.Ack("e1", snapshot.version))
        # The poll's first read of the log, at the server's start, is the last one.
        deadline = time.monotonic() + WAIT_S
        while not reads:
            assert time.monotonic() < deadline, "the poll never read the log"
            time.sleep(0.01)
        reads.clear()
        yield server, peer, reads
    finally:
        peer.close()
        server.close()


def deltas(peer: Peer, num: int) -> list[p.Delta]:
    """The next ``num`` deltas, then whatever else arrives within a moment (nothing)."""
    got = [peer.next(p.Delta, WAIT_S) for _ in range(num)]
    more = [kind for kind in peer.kinds(0.3) if kind is p.Delta]
    assert more == [], f"{len(more)} delta(s) more than {num}"
    return got


def test_a_local_write_is_sent_from_its_own_ops_without_reading_the_log(db_url: str) -> None:
    db = Database(make_engine(db_url))
    try:
        with pushing(db) as (_, peer, reads):
            commits = write_every_kind(db)
            got = deltas(peer, len(commits))
            assert reads == []
    finally:
        db.dispose()
    # Each version once, in order, with exactly the limit ops its commit made (an
    # engine core gets no key op; the key writes' versions arrive without ops).
    assert [d.version for d in got] == [c.version for c in commits]
    assert [d.ops for d in got] == [
        [op for op in c.ops if not isinstance(op, p.SetKey | p.DeleteKey)] for c in commits
    ]


def test_a_version_not_handed_in_is_read_from_the_log_in_order(db_url: str) -> None:
    db = Database(make_engine(db_url))
    # Another writer of the same database that tells this push server nothing (a write
    # whose notification is still on its way).
    silent = Database(make_engine(db_url))
    try:
        with pushing(db) as (_, peer, reads):
            unseen = write(silent, limits.put_limit, user="bob", rate=3, tier=None)
            assert peer.kinds(0.3).count(p.Delta) == 0  # nothing told the push server
            after_gap = write(db, limits.put_limit, user="carol", rate=4, tier=None)
            got = deltas(peer, 2)
            assert reads == ["output-rate-push-reads"]  # one read, on the reader's thread
            # Caught up: the next local write is sent from its ops again.
            next_one = write(db, limits.put_limit, user="dave", rate=6, tier=None)
            got += deltas(peer, 1)
            assert reads == ["output-rate-push-reads"]
    finally:
        silent.dispose()
        db.dispose()
    assert [d.version for d in got] == [unseen.version, after_gap.version, next_one.version]
    assert [d.ops for d in got] == [list(unseen.ops), list(after_gap.ops), list(next_one.ops)]


@pytest.mark.postgres
def test_another_replicas_write_is_read_from_the_log(tmp_path: Path) -> None:
    with ExitStack() as stack:
        url = stack.enter_context(fresh_database("postgres", tmp_path))
        db = Database(make_engine(url))
        stack.callback(db.dispose)
        other = Database(make_engine(url))  # the other replica's, which announces its writes
        stack.callback(other.dispose)
        with db.engine.connect() as conn:
            channel = current_channel(conn)
        announcer = ChangeAnnouncer(other.engine, channel)
        announcer.start()
        stack.callback(announcer.close)
        other.on_commit.append(announcer.committed)
        server, peer, reads = stack.enter_context(pushing(db))
        listener = ChangeListener(db.engine, channel, server.notify)
        listener.start()
        stack.callback(listener.close)
        assert listener.wait_listening(WAIT_S)

        theirs = write(other, limits.put_limit, user="bob", rate=3, tier=None)
        got = deltas(peer, 1)
        assert reads == ["output-rate-push-reads"]
        ours = write(db, limits.put_limit, user="carol", rate=4, tier=None)
        got += deltas(peer, 1)
        assert reads == ["output-rate-push-reads"]  # ours: sent from its ops
    assert [(d.version, d.ops) for d in got] == [
        (theirs.version, list(theirs.ops)),
        (ours.version, list(ours.ops)),
    ]


def test_a_commits_frames_are_the_frames_its_log_row_makes(db_url: str) -> None:
    """The ops handed in and the ops read back from the log encode to the same bytes, for
    both roles and every kind of op."""
    db = Database(make_engine(db_url))
    woken = threading.Event()
    reads: list[LogRead] = []
    reader = LogReader(db, wake=woken.set, on_read=reads.append, engine_timeout_s=5.0)
    reader.start()
    db.on_commit.append(reader.committed)
    try:
        commits = write_every_kind(db)
        reader.read(commits[0].version - 1)
        deadline = time.monotonic() + WAIT_S
        while len(reads) < len(commits) + 1:
            assert time.monotonic() < deadline, f"{len(reads)} reads"
            woken.wait(0.1)
            woken.clear()
            reader.deliver()
    finally:
        reader.close()
        db.dispose()
    *ready, from_log = reads
    assert [(r.since, r.newest) for r in ready] == [(c.version - 1, c.version) for c in commits]
    assert {v: frames for r in ready for v, frames in r.deltas.items()} == from_log.deltas
