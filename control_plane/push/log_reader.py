"""Every read the push server makes of the configuration, on a thread of its own: the
one place that knows the change log and the snapshots.

- ``committed(commit)``: a write committed on this replica hands its ops in
  (``PushServer.committed``, the database's on-commit hook). When its version is the one
  right after the newest read, those ops are the read: encoded on the committing thread
  and handed to the socket thread, no database read. Any other version (one this replica
  has not read comes between: another replica's write, a write not handed in) is read
  from the log, as ``notified`` does;
- ``notified(version)``, ``follow``: the change log after the newest version read so far,
  for a version known by its number only (another replica's write, through the
  database's notifications), and the socket thread's poll as the safety net;
- ``read(since)``: the log after an older version, for connections behind the newest;
- ``snapshot(role)``: what a connection gets first, encoded once per version and fleet
  size, so that engines connecting together share one read;
- ``model(at)``, ``term_start``: the limits a fleet coordinator keeps (docs/fleet.md).

The results go to the socket thread (``DatabaseWorker.deliver``), deltas encoded as each
role receives them: the socket thread only sends bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec

from control_plane.config import service as config
from control_plane.config.follower import Catchup, StoredLog, read_catchup
from control_plane.db import Commit, Database
from control_plane.engines import service as engines
from control_plane.keys import service as keys
from control_plane.push.worker import DatabaseWorker
from output_rate_core import protocol as p

logger = logging.getLogger(__name__)

# The ops each role receives of a delta (the rest are left out, the version kept).
KEY_OPS = (p.SetKey, p.DeleteKey)
ROLES: tuple[p.Role, ...] = (p.ENGINE_ROLE, p.API_ROLE)

# A version of the change log and its ops, as stored.
Change = tuple[int, list[dict[str, Any]]]


def ops_for(role: p.Role, ops: list[p.Op]) -> list[p.Op]:
    """An API server gets the key ops only; an engine core the limit ops only."""
    want_keys = role == p.API_ROLE
    return [op for op in ops if isinstance(op, KEY_OPS) == want_keys]


def encode_deltas(version: int, ops: list[p.Op]) -> dict[p.Role, bytes]:
    """role -> the delta of ``version`` as that role receives it."""
    return {role: p.encode(p.Delta(version, ops_for(role, ops))) for role in ROLES}


@dataclass(frozen=True)
class LogRead:
    """The change log after ``since``: each version's delta as each role receives it, up
    to the first version that cannot be sent (logged); ``newest``: the newest version
    read (``since`` when there was none)."""

    since: int
    newest: int
    # version -> role -> its encoded delta
    deltas: dict[int, dict[p.Role, bytes]]


@dataclass(frozen=True)
class TermStart:
    """What a new leader's coordinator starts from: the engines that may be enforcing
    its predecessor's shares, and the limits now."""

    live: list[str]
    snapshot: p.Snapshot


class LogReader:
    def __init__(
        self,
        db: Database,
        *,
        wake: Callable[[], None],
        on_read: Callable[[LogRead], None],
        engine_timeout_s: float,
    ) -> None:
        """``on_read``: the socket thread's use of every log read (follow and read)."""
        self._db = db
        self._worker = DatabaseWorker("output-rate-push-reads", wake)
        self._on_read = on_read
        self._engine_timeout_s = engine_timeout_s
        # The newest version a read handed to the socket thread, from the log or from a
        # commit here (written under _newest_lock by the reader thread and committing
        # threads; read without it: an int, read atomically).
        self.newest = 0
        self._newest_lock = threading.Lock()
        self._follow_lock = threading.Lock()
        # A follow is queued and has not started: another would read nothing more.
        self._follow_queued = False
        # role -> (version, fleet size, encoded snapshot) (the reader thread only)
        self._snapshots: dict[p.Role, tuple[int, int, bytes]] = {}

    # ---- the socket thread, or any thread for follow ------------------------------

    def start(self) -> None:
        """Follow from the version now: connections start from a snapshot."""
        self.newest = self._db.run_now(config.current_version)
        self._worker.start()

    def close(self) -> None:
        self._worker.close(finish=False)

    def deliver(self) -> None:
        self._worker.deliver()

    def committed(self, commit: Commit) -> None:
        """A write committed on this replica (the writer's thread, after its commit)."""
        # Encoded before the lock: a committer never waits on another's encoding.
        read = LogRead(
            commit.version - 1,
            commit.version,
            {commit.version: encode_deltas(commit.version, list(commit.ops))},
        )
        with self._newest_lock:
            ready = commit.version == self.newest + 1
            if ready:
                self.newest = commit.version
                # Under the lock: the next version's read is handed back after this one.
                self._worker.ready(read, self._on_read)
        if not ready:
            self.notified(commit.version)

    def notified(self, version: int) -> None:
        """``version`` was committed (any thread): read the log, unless a read carried it."""
        if version > self.newest:
            self.follow()

    def follow(self) -> None:
        with self._follow_lock:
            if self._follow_queued:
                return
            self._follow_queued = True
        self._worker.submit(self._follow, self._on_read)

    def read(self, since: int) -> None:
        self._worker.submit(partial(self._read, since), self._on_read)

    def snapshot(
        self,
        role: p.Role,
        num_engines: int,
        count_rows: bool,
        joining: frozenset[str],
        then: Callable[[tuple[int, bytes]], None],
        failed: Callable[[], None],
    ) -> None:
        """``then((version, frame))``: the snapshot a connection of ``role`` gets, with
        the fleet size ``num_engines``, or (``count_rows``) the larger of that and the
        live engine rows of every replica with the engines it goes to (``joining``)."""
        job = partial(self._snapshot, role, num_engines, count_rows, joining)
        self._worker.submit(job, then, failed)

    def model(
        self, at: int | None, then: Callable[[Catchup], None], failed: Callable[[], None]
    ) -> None:
        """``then(Catchup)``: what brings a coordinator's limit model at ``at`` up to date."""
        self._worker.submit(partial(self._model, at), then, failed)

    def term_start(
        self, within_s: float, then: Callable[[TermStart], None], failed: Callable[[], None]
    ) -> None:
        """``then(TermStart)``: the engine rows heard within ``within_s``, the limits."""
        self._worker.submit(partial(self._term_start, within_s), then, failed)

    # ---- the reader thread --------------------------------------------------------

    def _follow(self) -> LogRead:
        with self._follow_lock:
            self._follow_queued = False  # a commit from now on needs another read
        return self._read(self.newest)

    def _read(self, since: int) -> LogRead:
        changes: list[Change] = self._db.run_now(config.changes_since, since)
        deltas: dict[int, dict[p.Role, bytes]] = {}
        for version, rows in changes:
            try:
                ops = p.ops_from_rows(rows)
            except p.ProtocolError:
                logger.exception("config change %d cannot be sent", version)
                break
            deltas[version] = encode_deltas(version, ops)
        newest = changes[-1][0] if changes else since
        with self._newest_lock:
            self.newest = max(self.newest, newest)
        return LogRead(since, newest, deltas)

    def _snapshot(
        self, role: p.Role, num_engines: int, count_rows: bool, joining: frozenset[str]
    ) -> tuple[int, bytes]:
        if count_rows:
            live: list[str] = self._db.run_now(
                engines.live_engine_ids, within_s=self._engine_timeout_s
            )
            num_engines = max(1, num_engines, len(joining.union(live)))
        cached = self._snapshots.get(role)
        if (
            cached is not None
            and cached[1] == num_engines
            and cached[0] == self._db.run_now(config.current_version)
        ):
            return cached[0], cached[2]
        if role == p.API_ROLE:
            snap = self._db.run_now(keys.load_key_snapshot)
        else:
            snap = msgspec.structs.replace(
                self._db.run_now(config.load_snapshot), num_engines=num_engines
            )
        frame = p.encode(snap)
        self._snapshots[role] = (snap.version, num_engines, frame)
        return snap.version, frame

    def _model(self, at: int | None) -> Catchup:
        return read_catchup(StoredLog(self._db), at)

    def _term_start(self, within_s: float) -> TermStart:
        live: list[str] = self._db.run_now(engines.live_engine_ids, within_s=within_s)
        return TermStart(live, self._db.run_now(config.load_snapshot))
