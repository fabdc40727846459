"""The fleet relay: one allocator for engines connected to any replica (docs/replicas.md).

Only the replica holding the leader lease runs the fleet allocator. An engine's *home*, the
replica holding its connection, forwards the engine's fleet frames (Demand, ShareAck) and,
every second, the list of its live engines to the leader ("up" rows), and delivers to its
engines the Shares frames the leader addresses to them ("down" rows), all through the
``fleet_relay`` table:

- One thread per replica does all of it, so the push thread never waits for PostgreSQL.
  What the push thread hands over is written at most every ``BATCH_S``, one row per
  destination per batch (one transaction); a write is announced with NOTIFY on the relay
  channel (off the write path, folded, as for config changes: notify.py), and every
  replica reads its rows on the notification and every ``POLL_S`` under it.
- Readers delete what they read (``DELETE ... RETURNING``): the leader every "up" row, a
  home the "down" rows addressed to it. One writer thread per replica commits its batches
  in order, so a reader sees each replica's batches in the order they were made.
- Fencing: "down" rows carry the leader's token and are written only after
  ``check_fence`` in the same transaction, so a paused former leader cannot add to the
  new leader's decisions; the leader takes "up" rows under the same fence; a home
  delivers only rows of the token that holds the lease when it reads them.
- Rows nobody took (a replica that died) are pruned after ``KEEP_S``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import msgspec
from sqlalchemy import Connection, delete, insert

from control_plane.db import Database, service
from control_plane.fencing import LEADER, NotLeader, Term, check_fence, current_token
from control_plane.fencing import database_now as db_now
from control_plane.models import FleetRelayRow, table
from control_plane.replicas.notify import ChangeAnnouncer, ChangeListener

logger = logging.getLogger(__name__)

relay_rows = table(FleetRelayRow)

# The relay thread writes and reads at most this often (a batch per destination).
BATCH_S = 0.05
# ... and reads its rows at least this often, whatever the notifications say.
POLL_S = 0.25
# Rows older than this are nobody's any more (their frames are stale: engines restate
# their whole demand every 5 s; shares are renewed every lease / 3).
KEEP_S = 60.0
PRUNE_INTERVAL_S = 10.0
UP, DOWN = "up", "down"
CHANNEL_PREFIX = "output_rate_relay"


class Batch(msgspec.Struct, frozen=True):
    """What one row carries."""

    # (engine id, one output_rate_core.protocol frame), in the order they were made
    frames: list[tuple[str, bytes]] = []
    # "up": the engines bound to the home replica and heard from lately (None: not said)
    live: list[str] | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Batch)


@dataclass(frozen=True)
class Arrived:
    """A batch read from the relay: from which replica."""

    from_replica: str
    batch: Batch


@service("write_batch")
def write_rows(conn: Connection, *, rows: list[dict[str, object]], token: int | None) -> None:
    """Insert relay rows; with a token, only while it still holds the leader lease."""
    if token is not None:
        check_fence(conn, name=LEADER, token=token)
    now = db_now(conn)
    conn.execute(insert(relay_rows), [{**row, "created_at": now} for row in rows])


@service("write_batch")
def take_rows(
    conn: Connection, *, replica: str, leader_token: int | None
) -> tuple[list[Arrived], list[Arrived], int]:
    """(the "up" rows, for the leader holding ``leader_token``; the "down" rows for this
    replica from the current leader; how many "down" rows were of another token)."""
    ups: list[Arrived] = []
    if leader_token is not None:
        try:
            check_fence(conn, name=LEADER, token=leader_token)
        except NotLeader:
            pass
        else:
            up_rows = conn.execute(
                delete(relay_rows)
                .where(relay_rows.c.kind == UP)
                .returning(relay_rows.c.id, relay_rows.c.from_replica, relay_rows.c.body)
            ).all()
            ups = [Arrived(r.from_replica, _decoder.decode(r.body)) for r in sorted(up_rows)]
    current = current_token(conn, name=LEADER)
    c = relay_rows.c
    taken = conn.execute(
        delete(relay_rows)
        .where(c.kind == DOWN, c.to_replica == replica)
        .returning(c.id, c.token, c.from_replica, c.body)
    ).all()
    downs = [
        Arrived(r.from_replica, _decoder.decode(r.body))
        for r in sorted(taken)
        if r.token == current
    ]
    return ups, downs, len(taken) - len(downs)


@service("write_batch")
def prune_rows(conn: Connection, *, keep_s: float) -> int:
    cutoff = db_now(conn) - timedelta(seconds=keep_s)
    result = conn.execute(delete(relay_rows).where(relay_rows.c.created_at < cutoff))
    return int(result.rowcount or 0)


class FleetRelay:
    """This replica's end of the relay. The push thread hands frames over (``up``,
    ``live``, ``down``) and takes what arrived (``take``); ``on_arrival`` wakes it."""

    def __init__(
        self,
        db: Database,
        *,
        replica_id: str,
        term: Callable[[], Term | None],
        channel: str,
        on_arrival: Callable[[], None] = lambda: None,
        notify: bool = True,
    ) -> None:
        """``notify``: announce batches and listen for the others' (off: reads every
        ``POLL_S`` only)."""
        self._db = db
        self.replica_id = replica_id
        self._term = term
        # Wakes the push thread (set once the push server is made).
        self.on_arrival = on_arrival
        self._lock = threading.Lock()
        # (home replica, or "" for the leader; token, or None) -> frames to write
        self._outbox: dict[tuple[str, int | None], list[tuple[str, bytes]]] = {}
        self._live: list[str] | None = None
        self._inbox: deque[tuple[str, Arrived]] = deque()
        self._due = threading.Event()
        self._read_due = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="output-rate-relay", daemon=True)
        self._announcer = ChangeAnnouncer(db.engine, channel) if notify else None
        self._listener = (
            ChangeListener(db.engine, channel, lambda _: self._poke_read()) if notify else None
        )
        self._num_announced = 0
        self.num_rows_written = 0
        self.num_write_transactions = 0
        self.num_read_transactions = 0
        # Frames handed over to be written ("up" and "down").
        self.num_frames_relayed = 0
        # "down" rows refused at write (fenced: no longer the leader) or not delivered
        # (another token).
        self.num_fenced = 0
        self.num_stale = 0

    # ---- the push thread ----------------------------------------------------------

    def up(self, engine_id: str, frame: bytes) -> None:
        self._add(("", None), engine_id, frame)

    def live(self, engine_ids: list[str]) -> None:
        if not engine_ids:
            return  # the leader takes no news as no news: silence ends engines there
        with self._lock:
            self._live = engine_ids
        self._due.set()

    def down(self, home: str, token: int, engine_id: str, frame: bytes) -> None:
        self._add((home, token), engine_id, frame)

    def take(self) -> list[tuple[str, Arrived]]:
        """(kind, batch) read since the last call, in order."""
        taken: list[tuple[str, Arrived]] = []
        while self._inbox:
            taken.append(self._inbox.popleft())
        return taken

    # ---- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        for session in (self._listener, self._announcer):
            if session is not None:
                session.start()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._due.set()
        self._thread.join(timeout=5)
        for session in (self._announcer, self._listener):
            if session is not None:
                session.close()

    # ---- the relay thread -----------------------------------------------------------

    def _add(self, key: tuple[str, int | None], engine_id: str, frame: bytes) -> None:
        with self._lock:
            self._outbox.setdefault(key, []).append((engine_id, frame))
            self.num_frames_relayed += 1
        self._due.set()

    def _poke_read(self) -> None:
        self._read_due.set()
        self._due.set()

    def _run(self) -> None:
        next_read = next_prune = 0.0
        while not self._stop.is_set():
            self._due.wait(POLL_S)
            self._due.clear()
            started = time.monotonic()
            try:
                self._write()
                if self._read_due.is_set() or started >= next_read:
                    self._read_due.clear()
                    next_read = started + POLL_S
                    self._read()
                if started >= next_prune:
                    next_prune = started + PRUNE_INTERVAL_S
                    self._db.run_now(prune_rows, keep_s=KEEP_S)
            except Exception as e:
                # The database is away: the batch being written is lost (engines restate
                # their whole demand every 5 s; the leader renews every lease / 3; a gap
                # in shares makes an engine ask for a full table), reads are retried.
                logger.warning("fleet relay: %s", e)
                self._stop.wait(0.5)
            self._stop.wait(max(0.0, started + BATCH_S - time.monotonic()))

    def _write(self) -> None:
        with self._lock:
            outbox, self._outbox = self._outbox, {}
            live, self._live = self._live, None
        if live is not None:
            outbox.setdefault(("", None), [])
        # token -> the rows written under it (None: unfenced, "up")
        by_token: dict[int | None, list[dict[str, object]]] = {}
        for (to_replica, token), frames in outbox.items():
            kind = UP if token is None else DOWN
            batch = Batch(frames, live if kind == UP else None)
            by_token.setdefault(token, []).append(
                {
                    "kind": kind,
                    "token": token or 0,
                    "from_replica": self.replica_id,
                    "to_replica": to_replica,
                    "body": _encoder.encode(batch),
                }
            )
        for token, rows in by_token.items():
            try:
                self._db.run_now(write_rows, rows=rows, token=token)
            except NotLeader:
                self.num_fenced += len(rows)
                continue
            self.num_write_transactions += 1
            self.num_rows_written += len(rows)
            self._num_announced += 1
            if self._announcer is not None:
                self._announcer.announce(self._num_announced)

    def _read(self) -> None:
        term = self._term()
        ups, downs, num_stale = self._db.run_now(
            take_rows, replica=self.replica_id, leader_token=None if term is None else term.token
        )
        self.num_read_transactions += 1
        self.num_stale += num_stale
        for arrived in ups:
            self._inbox.append((UP, arrived))
        for arrived in downs:
            self._inbox.append((DOWN, arrived))
        if ups or downs:
            self.on_arrival()
