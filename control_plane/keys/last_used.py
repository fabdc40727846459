"""last_used_at of API keys, from engines' API servers' KeyUse reports.

The push server hands every report to `KeyUseRecorder.add` (cheap: a dict under a lock);
a thread of its own writes them, so neither the socket thread nor the event loop waits
on the database. A key is written at most once per WRITE_INTERVAL_S: its first use at
the next flush, later uses when its minute is up (and whatever is pending at shutdown),
so a flood of reports costs at most one row write per key per minute.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from control_plane.db import Database
from control_plane.keys import service

logger = logging.getLogger("control_plane")

WRITE_INTERVAL_S = 60.0
FLUSH_INTERVAL_S = 5.0
# Keys waiting for their write at once; a report's further keys are left out (counted).
MAX_PENDING_KEYS = 100_000


class KeyUseRecorder:
    def __init__(
        self,
        db: Database,
        *,
        write_interval_s: float = WRITE_INTERVAL_S,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._db = db
        self._write_interval_s = write_interval_s
        self._flush_interval_s = flush_interval_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        # key id -> latest use reported and not written yet (Unix seconds)
        self._pending: dict[str, float] = {}
        # key id -> when (clock) its last write was; forgotten after the interval
        self._written_at: dict[str, float] = {}
        # Rows handed to the database, and reported keys left out (MAX_PENDING_KEYS).
        self.num_writes = 0
        self.num_left_out = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, used: Mapping[str, float]) -> None:
        """A report: key id -> last use (Unix seconds). Any thread."""
        now = self._wall_clock()
        with self._lock:
            for key_id, at in used.items():
                # A peer's clock ahead of ours must not set a use in the future.
                at = min(at, now)
                known = self._pending.get(key_id)
                if known is None and len(self._pending) >= MAX_PENDING_KEYS:
                    self.num_left_out += 1
                elif known is None or at > known:
                    self._pending[key_id] = at

    def flush(self, *, everything: bool = False) -> None:
        """Write the keys whose minute is up (all pending ones with `everything`)."""
        now = self._clock()
        with self._lock:
            due = [
                (key_id, at)
                for key_id, at in self._pending.items()
                if everything
                or now - self._written_at.get(key_id, float("-inf")) >= self._write_interval_s
            ]
            for key_id, _ in due:
                del self._pending[key_id]
                self._written_at[key_id] = now
            self._written_at = {
                k: t
                for k, t in self._written_at.items()
                if now - t < self._write_interval_s or k in self._pending
            }
            self.num_writes += len(due)
        if due:
            used = [(key_id, datetime.fromtimestamp(at, UTC)) for key_id, at in due]
            self._db.run_now(service.record_key_uses, used=used)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="output-rate-key-use", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._flush_logged(everything=True)

    def _run(self) -> None:
        while not self._stop.wait(self._flush_interval_s):
            self._flush_logged()

    def _flush_logged(self, *, everything: bool = False) -> None:
        try:
            self.flush(everything=everything)
        except Exception:  # the database may be down for a while: keep serving
            logger.exception("API key last use: write failed; these uses are dropped")
