"""The leader lease as the fleet-wide writes see it: its term, and the fencing check.

A lease is a row of ``replica_leases`` (taken and renewed by
control_plane/replicas/lease.py): its holder, until when (database time, so replicas'
clocks need not agree) and a fencing token that grows by one whenever the holder changes.

Every write a leader makes for the fleet runs ``check_fence`` in its own transaction
first: the lease row is read under a share lock and must still carry the leader's token
and an unexpired deadline, else the write is refused (``NotLeader``) and rolled back. A
new holder's token change waits for that lock, so a former leader's write either commits
before the change or is refused after it, never interleaved.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, select, text

from control_plane.errors import DomainError
from control_plane.models import ReplicaLease, table, utcnow

LEADER = "leader"
leases = table(ReplicaLease)


class NotLeader(DomainError):
    status_code = 409


@dataclass(frozen=True)
class Term:
    """A leadership this replica holds: its token, and until when it may act."""

    token: int
    # time.monotonic() after which this replica must not act on it
    valid_until: float
    # time.monotonic() by which the previous holder's lease had ended (-inf: there was none)
    predecessor_ended_at: float = -math.inf


def database_now(conn: Connection) -> datetime:
    """The database's clock (PostgreSQL), or this process's (SQLite: one replica)."""
    if conn.dialect.name == "postgresql":
        now: datetime = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
        return now
    return utcnow()


def check_fence(conn: Connection, *, name: str, token: int) -> None:
    """In a leader's write transaction: refuse it unless ``token`` still holds the lease."""
    row = conn.execute(
        select(leases.c.token, leases.c.expires_at)
        .where(leases.c.name == name)
        .with_for_update(read=True)
    ).one()
    if row.token != token or row.expires_at <= database_now(conn):
        raise NotLeader(f"lease {name!r} is no longer held with token {token}")


def current_token(conn: Connection, *, name: str = LEADER) -> int | None:
    """The token holding the lease now (None: it has expired), read under a share lock:
    what a replica delivers for the leader must carry it (control_plane/replicas/relay.py)."""
    row = conn.execute(
        select(leases.c.token, leases.c.expires_at)
        .where(leases.c.name == name)
        .with_for_update(read=True)
    ).one()
    return int(row.token) if row.expires_at > database_now(conn) else None


def fleet_work_token(term: Callable[[], Term | None] | None) -> tuple[bool, int | None]:
    """(may run it now, fencing token) for work that runs once for the fleet (pruning,
    engine expiry): with no lease (one replica) always, unfenced; else only while this
    replica leads, fenced with its term's token."""
    if term is None:
        return True, None
    current = term()
    return current is not None, None if current is None else current.token
