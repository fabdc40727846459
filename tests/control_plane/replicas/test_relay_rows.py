"""The fleet relay's rows and the engines' home replica on a real database: fenced share
batches, delivery of the current leader's only, each row taken once; an engine core
bound on one replica at a time; a replica marks only its own engines disconnected."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from sqlalchemy import func, select

from control_plane import fencing
from control_plane.db import Database, make_engine
from control_plane.engines import service as engines
from control_plane.models import FleetRelayRow, table
from control_plane.replicas import lease
from control_plane.replicas import relay as r
from harness.control_plane import fresh_database
from output_rate_core import protocol as p

TIMEOUT_S = 5.0


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    database = Database(make_engine(db_url))
    yield database
    database.dispose()


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Database]:
    with fresh_database("postgres", tmp_path) as url:
        database = Database(make_engine(url))
        yield database
        database.dispose()


def take_lease(db: Database, holder: str, ttl_s: float = 30.0) -> int:
    token = db.run_now(lease.take_or_renew, name=fencing.LEADER, holder=holder, ttl_s=ttl_s)
    assert token is not None
    return token


def row(kind: str, to: str, token: int, *frames: tuple[str, bytes]) -> dict[str, object]:
    body = msgspec.msgpack.encode(r.Batch(list(frames)))
    return {"kind": kind, "token": token, "from_replica": "x", "to_replica": to, "body": body}


def num_rows(db: Database) -> int:
    return db.read_now(
        lambda conn: conn.execute(
            select(func.count()).select_from(table(FleetRelayRow))
        ).scalar_one()
    )


def test_share_batches_are_fenced_and_delivered_only_under_the_current_token(pg: Database) -> None:
    first = take_lease(pg, "a")
    pg.run_now(r.write_rows, rows=[row(r.DOWN, "home", first, ("e1", b"one"))], token=first)
    # a gives the lease up; b leads with the next token.
    pg.run_now(lease.release, name=fencing.LEADER, holder="a", token=first)
    second = take_lease(pg, "b")
    with pytest.raises(fencing.NotLeader):  # the former leader writes nothing more
        pg.run_now(r.write_rows, rows=[row(r.DOWN, "home", first, ("e1", b"two"))], token=first)
    pg.run_now(r.write_rows, rows=[row(r.DOWN, "home", second, ("e1", b"three"))], token=second)
    ups, downs, num_stale = pg.run_now(r.take_rows, replica="home", leader_token=None)
    assert ups == []
    # The first leader's batch, written before the change, is not delivered after it.
    assert [a.batch.frames for a in downs] == [[("e1", b"three")]]
    assert num_stale == 1
    # Taken once: nothing is left for the next read.
    assert pg.run_now(r.take_rows, replica="home", leader_token=None) == ([], [], 0)


def test_only_the_leader_takes_the_engines_frames_in_the_order_they_were_written(
    pg: Database,
) -> None:
    token = take_lease(pg, "leader")
    for n in range(3):
        pg.run_now(r.write_rows, rows=[row(r.UP, "", 0, ("e1", bytes([n])))], token=None)
    ups, _, _ = pg.run_now(r.take_rows, replica="follower", leader_token=token + 1)
    assert ups == []  # not the token that leads: nothing taken
    ups, _, _ = pg.run_now(r.take_rows, replica="leader", leader_token=token)
    assert [a.batch.frames for a in ups] == [
        [("e1", b"\x00")],
        [("e1", b"\x01")],
        [("e1", b"\x02")],
    ]
    assert num_rows(pg) == 0


def test_rows_nobody_took_are_pruned(pg: Database) -> None:
    pg.run_now(r.write_rows, rows=[row(r.UP, "", 0)], token=None)
    assert pg.run_now(r.prune_rows, keep_s=60.0) == 0
    time.sleep(0.05)
    assert pg.run_now(r.prune_rows, keep_s=0.01) == 1
    assert num_rows(pg) == 0


def seen(engine_id: str, role: p.Role = p.ENGINE_ROLE) -> engines.EngineSeen:
    return engines.EngineSeen(
        engine_id=engine_id,
        model="tiny",
        applied_version=0,
        first_seen=datetime.now(UTC),
        role=role,
    )


def claim(db: Database, engine_id: str, replica: str, role: p.Role = p.ENGINE_ROLE) -> bool:
    return db.run_now(
        engines.claim_engine, engine_id=engine_id, replica=replica, timeout_s=TIMEOUT_S, role=role
    )


def connected(db: Database) -> dict[str, bool]:
    listed = db.run_now(engines.list_engines, timeout_s=TIMEOUT_S)
    return {e.engine_id: e.connected for e in listed.items}


def test_an_engine_core_is_bound_on_one_replica_at_a_time(db: Database) -> None:
    assert claim(db, "e1", "a")
    db.run_now(engines.record_engines, seen=[seen("e1")], replica="a")
    assert not claim(db, "e1", "b")  # live on a
    assert claim(db, "e1", "a")  # a again (a reconnect there)
    # a lets it go (its connection timed out there): b may take it, and a, woken after
    # a pause, writes nothing for it any more and is told so.
    db.run_now(engines.disconnect_engines, engine_ids=["e1"], replica="a")
    assert claim(db, "e1", "b")
    assert db.run_now(engines.record_engines, seen=[seen("e1")], replica="a") == {
        ("e1", p.ENGINE_ROLE)
    }
    db.run_now(engines.disconnect_engines, engine_ids=["e1"], replica="a")
    assert db.run_now(engines.record_engines, seen=[seen("e1")], replica="b") == set()
    assert connected(db) == {"e1": True}
    assert not claim(db, "e1", "a")


def test_a_new_id_bound_on_two_replicas_at_once_stays_with_the_first_that_writes_it(
    db: Database,
) -> None:
    # No row yet: both may bind (the row is written once the engine proves itself) ...
    assert claim(db, "fresh", "a") and claim(db, "fresh", "b")
    assert connected(db) == {}  # a bind alone writes no row
    # ... the first to write it keeps it; the other is told and lets go.
    assert db.run_now(engines.record_engines, seen=[seen("fresh")], replica="a") == set()
    assert db.run_now(engines.record_engines, seen=[seen("fresh")], replica="b") == {
        ("fresh", p.ENGINE_ROLE)
    }
    assert not claim(db, "fresh", "b")


def test_an_api_server_is_bound_on_one_replica_at_a_time_like_its_core(db: Database) -> None:
    # The core on a, its API server on b: each is bound where it is, apart.
    assert claim(db, "e1", "a")
    db.run_now(engines.record_engines, seen=[seen("e1")], replica="a")
    assert claim(db, "e1", "b", p.API_ROLE)
    db.run_now(engines.record_engines, seen=[seen("e1", p.API_ROLE)], replica="b")
    # The API server's id live on b cannot be claimed on a (nor c), nor the core on b.
    assert not claim(db, "e1", "a", p.API_ROLE)
    assert not claim(db, "e1", "c", p.API_ROLE)
    assert not claim(db, "e1", "b")
    assert claim(db, "e1", "b", p.API_ROLE)  # b again (a reconnect there)
    # b lets it go (its connection timed out there): a may take it, and b, woken after a
    # pause, writes nothing for it any more and is told so.
    db.run_now(engines.disconnect_engines, engine_ids=["e1"], role=p.API_ROLE, replica="b")
    assert claim(db, "e1", "a", p.API_ROLE)
    assert db.run_now(engines.record_engines, seen=[seen("e1", p.API_ROLE)], replica="b") == {
        ("e1", p.API_ROLE)
    }
    # a replica starting clears only the API servers homed there.
    db.run_now(engines.record_engines, seen=[seen("e1", p.API_ROLE)], replica="a")
    db.run_now(engines.disconnect_engines, engine_ids=None, role=p.API_ROLE, replica="b")
    assert not claim(db, "e1", "b", p.API_ROLE)
    # A new id's API server: the first replica to write its row keeps it.
    assert claim(db, "e2", "a", p.API_ROLE) and claim(db, "e2", "b", p.API_ROLE)
    assert db.run_now(engines.record_engines, seen=[seen("e2", p.API_ROLE)], replica="a") == set()
    assert db.run_now(engines.record_engines, seen=[seen("e2", p.API_ROLE)], replica="b") == {
        ("e2", p.API_ROLE)
    }
    assert not claim(db, "e2", "b", p.API_ROLE)
    assert claim(db, "e2", "b")  # its core is free: no core has been seen


def test_a_replica_starting_marks_only_its_own_engines_disconnected(db: Database) -> None:
    for engine_id, replica in (("on-a", "a"), ("on-b", "b")):
        assert claim(db, engine_id, replica)
        db.run_now(engines.record_engines, seen=[seen(engine_id)], replica=replica)
    db.run_now(engines.disconnect_engines, engine_ids=None, replica="a")
    assert connected(db) == {"on-a": False, "on-b": True}
    assert db.run_now(engines.count_live_engines, timeout_s=TIMEOUT_S) == 1
    assert db.run_now(engines.live_engine_ids, within_s=TIMEOUT_S) == ["on-b"]


def test_a_taken_over_lease_says_when_its_predecessor_ended(db: Database) -> None:
    first = db.run_now(lease.take_or_renew_lease, name=fencing.LEADER, holder="a", ttl_s=0.1)
    assert first is not None and first.predecessor_ended_s_ago is None  # nobody before
    renewed = db.run_now(lease.take_or_renew_lease, name=fencing.LEADER, holder="a", ttl_s=0.1)
    assert renewed == lease.Taken(first.token, None)
    time.sleep(0.3)
    taken = db.run_now(lease.take_or_renew_lease, name=fencing.LEADER, holder="b", ttl_s=5.0)
    assert taken is not None and taken.token == first.token + 1
    assert taken.predecessor_ended_s_ago is not None
    assert 0.15 < taken.predecessor_ended_s_ago < 5.0
