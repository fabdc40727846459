"""Cross-replica wake-up: a committed config change is announced with PostgreSQL's NOTIFY,
and every replica LISTENs so that its push thread publishes the change to its own engines
at once instead of at its next poll of the change log.

NOTIFY is only a hint. It reaches only sessions listening at that moment and is never
replayed, so a replica that was disconnected, or a notification lost with a dropped
connection, is covered by the push thread's poll of ``config_changes`` (the log is the
truth; versions come from one row locked by every write, so commit order is version order
and no replica can see version N+1 before N). The notification is sent inside the write's
own transaction, so it is delivered exactly when the change is visible. Its cost: PostgreSQL
serialises the commits of notifying transactions on a global lock; config writes already
serialise on the version row, so this adds nothing to them (bench/replica_bench.py).

The channel is per schema (tests give each database its own schema in one PostgreSQL
database, and a channel is database-wide).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable

from sqlalchemy import Connection, Engine, text

logger = logging.getLogger(__name__)

CHANNEL_PREFIX = "output_rate_changes"
# How long the listener waits for a notification before checking whether it should stop.
LISTEN_POLL_S = 0.5
RECONNECT_BACKOFF_S = (0.1, 0.5, 1.0, 2.0)


def channel_of(schema: str) -> str:
    if schema == "public":
        return CHANNEL_PREFIX
    return f"{CHANNEL_PREFIX}_{hashlib.sha256(schema.encode()).hexdigest()[:16]}"


def current_channel(conn: Connection) -> str:
    return channel_of(str(conn.execute(text("SELECT current_schema()")).scalar_one()))


def announce(conn: Connection, channel: str, version: int) -> None:
    """In a write's transaction: wake every replica's push thread when it commits."""
    conn.execute(
        text("SELECT pg_notify(:channel, :version)"), {"channel": channel, "version": str(version)}
    )


class ChangeListener:
    """A thread holding one LISTEN session; calls ``on_version(v)`` for each notification
    (the push server's ``notify``: cheap, any thread). Reconnects with backoff."""

    def __init__(self, engine: Engine, channel: str, on_version: Callable[[int], None]) -> None:
        self._engine = engine
        self.channel = channel
        self._on_version = on_version
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="output-rate-listen", daemon=True)
        self._listening = threading.Event()
        self.num_notifications = 0
        self.num_reconnects = 0

    def start(self) -> None:
        self._thread.start()

    def wait_listening(self, timeout_s: float) -> bool:
        return self._listening.wait(timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self._listen()
                failures = 0
            except Exception as e:  # a dropped session: the poll covers the gap
                self._listening.clear()
                self.num_reconnects += 1
                delay = RECONNECT_BACKOFF_S[min(failures, len(RECONNECT_BACKOFF_S) - 1)]
                failures += 1
                if failures == 1:
                    logger.warning("LISTEN session lost (%s); reconnecting", e)
                self._stop.wait(delay)

    def _listen(self) -> None:
        dialect = self._engine.dialect
        cargs, cparams = dialect.create_connect_args(self._engine.url)
        conn = dialect.connect(*cargs, **cparams)  # a psycopg connection of its own
        try:
            conn.autocommit = True
            conn.execute(f'LISTEN "{self.channel}"')
            self._listening.set()
            while not self._stop.is_set():
                for note in conn.notifies(timeout=LISTEN_POLL_S):
                    self.num_notifications += 1
                    try:
                        version = int(note.payload)
                    except ValueError:
                        continue
                    self._on_version(version)
        finally:
            self._listening.clear()
            conn.close()
