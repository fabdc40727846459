"""Usage history: what engines report, rolled up per user and minute in the database.

The push endpoint hands every usage report to `UsageRecorder.add` (cheap: counts in a
dict); a thread writes the counts every few seconds (and at shutdown) and prunes rows
older than the retention (OUTPUT_RATE_USAGE_RETENTION_DAYS, default 7 days). Minutes are
those of the control plane's clock (injectable) when the report arrived, so an engine
that is disconnected leaves no rows: its users' history has a gap, not a zero.

Bounded per minute (one row per user and minute): at most `max_users_per_minute` users
(OUTPUT_RATE_USAGE_HISTORY_MAX_USERS_PER_MINUTE), and of them at most
MAX_NEW_USERS_PER_ENGINE_PER_MINUTE brought by one engine that had no row the minute
before; the rest of a report's users are left out of the history and counted. A user
who already has a row this minute always counts. Writes go in transactions of
FLUSH_CHUNK_ROWS rows with a pause between them, on the recorder's own thread, so a
large flush neither holds the database's write lock nor the event loop's GIL for long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from control_plane.db import Database
from control_plane.replicas.lease import NotLeader, Term, fleet_work_token
from control_plane.settings import DEFAULT_HISTORY_MAX_USERS_PER_MINUTE
from control_plane.usage import service
from control_plane.usage.book import Refusals
from output_rate_core import protocol as p

logger = logging.getLogger("control_plane")

FLUSH_INTERVAL_S = 5.0
PRUNE_INTERVAL_S = 600.0
MAX_NEW_USERS_PER_ENGINE_PER_MINUTE = 1_000
FLUSH_CHUNK_ROWS = 500
# Between two chunks of a flush: the event loop gets the GIL (and SQLite's write lock)
# for a while, instead of waiting out the whole flush.
FLUSH_CHUNK_PAUSE_S = 0.005

# Users left out of the history (the `reason` of output_rate_usage_refused_total).
REFUSED_ENGINE_USERS = "history_engine_users"  # over one engine's new users this minute
REFUSED_MINUTE_USERS = "history_users"  # over max_users_per_minute
REFUSAL_REASONS = (REFUSED_ENGINE_USERS, REFUSED_MINUTE_USERS)


class UsageRecorder:
    def __init__(
        self,
        db: Database,
        *,
        retention_days: int,
        max_users_per_minute: int = DEFAULT_HISTORY_MAX_USERS_PER_MINUTE,
        clock: Callable[[], float] = time.time,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        term: Callable[[], Term | None] | None = None,
    ) -> None:
        self._db = db
        # Replicas: only the leader prunes (the rows are shared); None: this one does.
        self._term = term
        self.retention_days = retention_days
        self.max_users_per_minute = max_users_per_minute
        self._clock = clock
        self._flush_interval_s = flush_interval_s
        self._lock = threading.Lock()
        # (user, minute start) -> [tokens granted, request-steps throttled, request-steps
        # a shadow limit would have throttled]
        self._counts: dict[tuple[str, int], list[int]] = {}
        # The users with a row in the current minute and in the one before it, and how
        # many users without a row the minute before each engine brought this minute.
        self._minute = -1
        self._rows: set[str] = set()
        self._rows_before: set[str] = set()
        self._num_new: dict[str, int] = {}
        self.refused = Refusals()
        self._last_prune: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, report: p.Usage) -> None:
        minute = int(self._clock()) // service.MINUTE_S * service.MINUTE_S
        with self._lock:
            if minute != self._minute:
                last = self._rows if minute == self._minute + service.MINUTE_S else set()
                self._minute, self._rows, self._rows_before = minute, set(), last
                self._num_new = {}
            users = {*report.granted, *report.throttled, *report.would_throttle}
            admitted = self._admit(report.engine_id, users)
            counts = self._counts
            for index, report_counts in enumerate(
                (report.granted, report.throttled, report.would_throttle)
            ):
                for user, n in report_counts.items():
                    if user in admitted:
                        counts.setdefault((user, minute), [0, 0, 0])[index] += n

    def _admit(self, engine_id: str, users: set[str]) -> set[str]:
        """The users of a report that get (or have) a row this minute; counts the rest."""
        rows, before = self._rows, self._rows_before
        fresh = users - rows
        if not fresh:
            return users
        room = self.max_users_per_minute - len(rows)
        num_new = self._num_new.get(engine_id, 0)
        engine_room = MAX_NEW_USERS_PER_ENGINE_PER_MINUTE - num_new
        taken: list[str] = []
        num_over_engine = num_over_minute = 0
        # In id order, so which users a flood crowds out does not depend on dict order.
        for user in sorted(fresh):
            if len(taken) >= room:
                num_over_minute += 1
            elif user in before:
                taken.append(user)
            elif engine_room > 0:
                taken.append(user)
                engine_room -= 1
                num_new += 1
            else:
                num_over_engine += 1
        self._num_new[engine_id] = num_new
        rows.update(taken)
        if num_over_engine:
            self.refused.add(REFUSED_ENGINE_USERS, num_over_engine, engine_id=engine_id)
        if num_over_minute:
            self.refused.add(REFUSED_MINUTE_USERS, num_over_minute, engine_id=engine_id)
        if len(taken) == len(fresh):
            return users
        return (users - fresh).union(taken)

    def flush(self) -> None:
        """Write what was added since the last flush; prune when due. Any thread."""
        with self._lock:
            counts, self._counts = self._counts, {}
        now = self._clock()
        due = self._last_prune is None or now - self._last_prune >= PRUNE_INTERVAL_S
        items = sorted((key, (v[0], v[1], v[2])) for key, v in counts.items())
        for start in range(0, len(items), FLUSH_CHUNK_ROWS):
            if start:
                time.sleep(FLUSH_CHUNK_PAUSE_S)
            self._db.run_now(
                service.record_usage, counts=dict(items[start : start + FLUSH_CHUNK_ROWS])
            )
        may_prune, fence = fleet_work_token(self._term)
        if due and may_prune:
            try:
                self._db.run_now(
                    service.prune_usage, now=now, retention_days=self.retention_days, fence=fence
                )
            except NotLeader:
                return  # the lease moved meanwhile: the new leader prunes
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
