"""Usage history: what engines report, rolled up per user and minute in the database.

The push endpoint hands every usage report to `UsageRecorder.add` (cheap: counts in a
dict); a thread writes the counts every few seconds (and at shutdown) and prunes rows
older than the retention (OUTPUT_RATE_USAGE_RETENTION_DAYS, default 7 days). Minutes are
those of the control plane's clock (injectable) when the report arrived, so an engine
that is disconnected leaves no rows: its users' history has a gap, not a zero.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from control_plane.db import Database
from control_plane.usage import service
from output_rate_core import protocol as p

logger = logging.getLogger("control_plane")

FLUSH_INTERVAL_S = 5.0
PRUNE_INTERVAL_S = 600.0


class UsageRecorder:
    def __init__(
        self,
        db: Database,
        *,
        retention_days: int,
        clock: Callable[[], float] = time.time,
        flush_interval_s: float = FLUSH_INTERVAL_S,
    ) -> None:
        self._db = db
        self.retention_days = retention_days
        self._clock = clock
        self._flush_interval_s = flush_interval_s
        self._lock = threading.Lock()
        # (user, minute start) -> [tokens granted, request-steps throttled]
        self._counts: dict[tuple[str, int], list[int]] = {}
        self._last_prune: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, report: p.Usage) -> None:
        minute = int(self._clock()) // service.MINUTE_S * service.MINUTE_S
        with self._lock:
            for user, n in report.granted.items():
                self._counts.setdefault((user, minute), [0, 0])[0] += n
            for user, n in report.throttled.items():
                self._counts.setdefault((user, minute), [0, 0])[1] += n

    def flush(self) -> None:
        """Write what was added since the last flush; prune when due. Any thread."""
        with self._lock:
            counts, self._counts = self._counts, {}
        now = self._clock()
        due = self._last_prune is None or now - self._last_prune >= PRUNE_INTERVAL_S
        if counts:
            self._db.run_now(
                service.record_usage, counts={k: (v[0], v[1]) for k, v in counts.items()}
            )
        if due:
            self._db.run_now(service.prune_usage, now=now, retention_days=self.retention_days)
            self._last_prune = now

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="output-rate-history", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._flush_logged()

    def _run(self) -> None:
        while not self._stop.wait(self._flush_interval_s):
            self._flush_logged()

    def _flush_logged(self) -> None:
        try:
            self.flush()
        except Exception:  # the database may be down for a while: keep serving
            logger.exception("usage history: flush failed; these counts are dropped")
