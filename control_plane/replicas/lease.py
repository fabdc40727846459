"""One elected replica at a time for the work that must run once for the fleet.

A replica takes the lease (a row of ``replica_leases``, control_plane/fencing.py) when it
has expired and renews it every ``ttl / 3`` while it holds it. It acts as leader only until
``ttl`` after it *started* its last successful renewal (measured on its own monotonic
clock), which is never later than the database deadline; so a replica that was paused
(SIGSTOP, a long GC, a frozen VM) knows on waking that it no longer leads, before it does
anything. What it writes as leader is fenced with its term's token (control_plane/fencing.py).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, Engine, event, select, update

from control_plane.db import Database, service
from control_plane.fencing import LEADER, Term, database_now, leases
from control_plane.models import MAX_REPLICA_ID_LEN

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 3.0
# PostgreSQL ends a session left inside a transaction this long (a replica stopped or
# frozen mid-transaction), so its row locks go with it: another replica's engine claims
# and writes never wait on it for longer (a failover from a frozen replica that held an
# engine's row lock then takes up to this long, over the 3.5 s silence). Our
# transactions never idle this long between statements.
STOPPED_SESSION_TIMEOUT_S = 5.0


def default_replica_id() -> str:
    """This process, as the lease names its holder: host and pid."""
    return f"{socket.gethostname()}-{os.getpid()}"[:MAX_REPLICA_ID_LEN]


@dataclass(frozen=True)
class Taken:
    """A successful take or renewal: the fencing token, and how long ago (database time)
    the previous holder's lease ended (None: a renewal, nobody held it before us)."""

    token: int
    predecessor_ended_s_ago: float | None


@service("write")
def take_or_renew(conn: Connection, *, name: str, holder: str, ttl_s: float) -> int | None:
    """The fencing token if ``holder`` holds the lease for another ``ttl_s``, else None."""
    taken = take_or_renew_lease(conn, name=name, holder=holder, ttl_s=ttl_s)
    return None if taken is None else taken.token


@service("write")
def take_or_renew_lease(conn: Connection, *, name: str, holder: str, ttl_s: float) -> Taken | None:
    """As take_or_renew, saying when a taken-over lease ended (a new leader waits out
    what its predecessor may have promised: control_plane/fleet/coordinator.py)."""
    row = conn.execute(
        select(leases.c.holder, leases.c.token, leases.c.expires_at)
        .where(leases.c.name == name)
        .with_for_update()
    ).one()
    now = database_now(conn)
    predecessor_ended_s_ago: float | None = None
    if row.holder == holder and row.expires_at > now:
        token = int(row.token)
    elif row.expires_at <= now:
        token = int(row.token) + 1
        if row.token > 0:
            predecessor_ended_s_ago = (now - row.expires_at).total_seconds()
    else:
        return None  # another replica holds it
    conn.execute(
        update(leases)
        .where(leases.c.name == name)
        .values(holder=holder, token=token, expires_at=now + timedelta(seconds=ttl_s))
    )
    return Taken(token, predecessor_ended_s_ago)


@service("write")
def release(conn: Connection, *, name: str, holder: str, token: int) -> None:
    """Give the lease up at shutdown, so another replica takes it at once."""
    conn.execute(
        update(leases)
        .where(leases.c.name == name, leases.c.holder == holder, leases.c.token == token)
        .values(expires_at=database_now(conn))
    )


class LeaseKeeper:
    """A thread that takes and renews one lease for this replica."""

    def __init__(
        self,
        db: Database,
        *,
        holder: str,
        name: str = LEADER,
        ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        self._db = db
        self.holder = holder
        self.name = name
        self.ttl_s = ttl_s
        self._term: Term | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="output-rate-lease", daemon=True)
        self.num_terms = 0

    @property
    def term(self) -> Term | None:
        """The current term, or None: not the leader (now)."""
        term = self._term
        if term is None or time.monotonic() >= term.valid_until:
            return None
        return term

    @property
    def is_leader(self) -> bool:
        return self.term is not None

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        term = self.term
        if term is not None:
            try:
                self._db.run_now(release, name=self.name, holder=self.holder, token=term.token)
            except Exception:
                logger.exception("could not release the %s lease", self.name)
        self._set(None)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                taken = self._db.run_now(
                    take_or_renew_lease, name=self.name, holder=self.holder, ttl_s=self.ttl_s
                )
            except Exception as e:
                # The database is unreachable: a term held lapses at its own deadline
                # (the lease in the database lasts at least as long), then nobody leads.
                logger.warning("could not take or renew the %s lease: %s", self.name, e)
                self._stop.wait(self.ttl_s / 6)
                continue
            self._set(None if taken is None else self._term_of(taken, started))
            self._stop.wait(self.ttl_s / 3)

    def _term_of(self, taken: Taken, started: float) -> Term:
        old = self._term
        if old is not None and old.token == taken.token:
            ended_at = old.predecessor_ended_at  # a renewal
        elif taken.predecessor_ended_s_ago is None:
            ended_at = -math.inf
        else:
            ended_at = started - taken.predecessor_ended_s_ago
        return Term(taken.token, started + self.ttl_s, ended_at)

    def _set(self, term: Term | None) -> None:
        old, self._term = self._term, term
        if term is not None and (old is None or old.token != term.token):
            self.num_terms += 1
            logger.info("replica %s leads (%s, token %d)", self.holder, self.name, term.token)
        elif term is None and old is not None:
            logger.info("replica %s no longer leads (%s)", self.holder, self.name)


def release_locks_of_stopped_replicas(engine: Engine) -> None:
    """Every session of this (PostgreSQL) engine ends after STOPPED_SESSION_TIMEOUT_S
    idle inside a transaction. Set before the engine's first connection."""

    @event.listens_for(engine, "connect")
    def _timeout(dbapi_connection: Any, _record: Any) -> None:
        ms = int(STOPPED_SESSION_TIMEOUT_S * 1000)
        with dbapi_connection.cursor() as cursor:
            cursor.execute(f"SET idle_in_transaction_session_timeout = {ms}")
        # Session-wide only once committed: a rolled-back SET is undone.
        dbapi_connection.commit()
