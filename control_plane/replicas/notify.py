"""Cross-replica wake-up: a committed config change is announced with PostgreSQL's NOTIFY,
and every replica LISTENs so that its push thread publishes the change to its own engines
at once instead of at its next poll of the change log.

NOTIFY is only a hint. It reaches only sessions listening at that moment and is never
replayed, so a replica that was disconnected, a notification lost with a dropped session,
or a replica killed between a commit and its announcement, is covered by the push
thread's poll of ``config_changes`` (the log is the truth; versions come from one row
locked by every write, so commit order is version order and no replica sees version N+1
before N).

The announcement is sent after the commit, by a thread of its own on a session of its own,
never inside the write: PostgreSQL serialises the commits of notifying transactions on one
lock, and a NOTIFY inside the write would hold the version row for that long too. Versions
committed while an announcement is on its way are folded into the next one (only the
highest matters: the listener reads the log up to it). Measured in
bench/results/replicas.md.

The channel is per schema (tests give each database its own schema in one PostgreSQL
database, and a channel is database-wide).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Engine, text

from control_plane.db import Commit

logger = logging.getLogger(__name__)

CHANNEL_PREFIX = "output_rate_changes"
# How long the listener waits for a notification before checking whether it should stop.
LISTEN_POLL_S = 0.5
RECONNECT_BACKOFF_S = (0.1, 0.5, 1.0, 2.0)


def channel_of(schema: str, prefix: str = CHANNEL_PREFIX) -> str:
    if schema == "public":
        return prefix
    return f"{prefix}_{hashlib.sha256(schema.encode()).hexdigest()[:16]}"


def current_channel(conn: Connection, prefix: str = CHANNEL_PREFIX) -> str:
    return channel_of(str(conn.execute(text("SELECT current_schema()")).scalar_one()), prefix)


class _Session(threading.Thread):
    """A thread with one autocommit psycopg session of its own, reopened with backoff."""

    def __init__(self, engine: Engine, channel: str, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._engine = engine
        self.channel = channel
        self._closing = threading.Event()
        self.num_reconnects = 0

    def close(self) -> None:
        self._closing.set()
        self.join(timeout=5)

    def run(self) -> None:
        failures = 0
        while not self._closing.is_set():
            dialect = self._engine.dialect
            cargs, cparams = dialect.create_connect_args(self._engine.url)
            try:
                conn = dialect.connect(*cargs, **cparams)
                try:
                    conn.autocommit = True
                    failures = 0
                    self.serve(conn)
                finally:
                    conn.close()
            except Exception as e:  # a dropped session: the poll covers the gap
                self.num_reconnects += 1
                if failures == 0:
                    logger.warning("%s: PostgreSQL session lost (%s); reconnecting", self.name, e)
                delay = RECONNECT_BACKOFF_S[min(failures, len(RECONNECT_BACKOFF_S) - 1)]
                failures += 1
                self._closing.wait(delay)

    def serve(self, conn: Any) -> None:
        raise NotImplementedError


class ChangeAnnouncer(_Session):
    """Sends ``NOTIFY channel, 'version'`` after commits (``committed`` is a Database
    on_commit hook: it only records the version and wakes the thread)."""

    def __init__(self, engine: Engine, channel: str) -> None:
        super().__init__(engine, channel, "output-rate-announce")
        self._lock = threading.Lock()
        self._due = threading.Event()
        # The highest committed version not announced yet (0: none).
        self._pending = 0
        self.num_announced = 0

    def committed(self, commit: Commit) -> None:
        self.announce(commit.version)

    def announce(self, version: int) -> None:
        with self._lock:
            self._pending = max(self._pending, version)
        self._due.set()

    def close(self) -> None:
        self._closing.set()
        self._due.set()
        self.join(timeout=5)

    def serve(self, conn: Any) -> None:
        while not self._closing.is_set():
            self._due.wait(LISTEN_POLL_S)
            self._due.clear()
            with self._lock:
                version, self._pending = self._pending, 0
            if version:
                try:
                    conn.execute("SELECT pg_notify(%s, %s)", (self.channel, str(version)))
                except Exception:
                    self.announce(version)  # again on the next session
                    raise
                self.num_announced += 1


class ChangeListener(_Session):
    """Holds one LISTEN session; calls ``on_version(v)`` for each notification (the push
    server's ``notify``: cheap, any thread)."""

    def __init__(self, engine: Engine, channel: str, on_version: Callable[[int], None]) -> None:
        super().__init__(engine, channel, "output-rate-listen")
        self._on_version = on_version
        self._listening = threading.Event()
        self.num_notifications = 0

    def wait_listening(self, timeout_s: float) -> bool:
        return self._listening.wait(timeout_s)

    def serve(self, conn: Any) -> None:
        conn.execute(f'LISTEN "{self.channel}"')
        self._listening.set()
        try:
            while not self._closing.is_set():
                for note in conn.notifies(timeout=LISTEN_POLL_S):
                    self.num_notifications += 1
                    try:
                        version = int(note.payload)
                    except ValueError:
                        continue
                    self._on_version(version)
        finally:
            self._listening.clear()
