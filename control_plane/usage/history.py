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

The limit in force, per part of a minute: the recorder keeps the limit model (the one
engines hold, output_rate_core.limits.LimitModel) at the change log's newest version (a
log follower, control_plane/config/follower.py), refreshed on its thread right after
each local commit and at least every LIMITS_REFRESH_S (changes made on another
replica). A report that arrives at t covers
[t - interval_s, t]; each user's part of it is weighted with the limit in force then,
split at the moment the recorder learnt of a change (an engine applies a change at its
next step, as quickly). Per user and minute it sums the seconds covered (the union over
engines: two engines reporting the same second count it once), the seconds under a
limit, limit x seconds (fleet scope: once per second, the limit is for the sum over
engines; engine scope: once per engine and second, each engine enforces the whole
rate), and the tokens granted under a limit. So a minute's limit in force is
limit_weight / limited_seconds, and a user held at its limit reads 100 % of it whatever
the limit did within the minute.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from control_plane.config.follower import LogFollower, StoredLog
from control_plane.db import Commit, Database
from control_plane.fencing import NotLeader, Term, fleet_work_token
from control_plane.settings import DEFAULT_HISTORY_MAX_USERS_PER_MINUTE
from control_plane.usage import service
from control_plane.usage.book import Refusals
from control_plane.usage.service import (
    BORROWED,
    LIMITED_S,
    LIMITED_TOKENS,
    NUM_SUMS,
    REPORTED_S,
    THROTTLED,
    TOKENS,
    WEIGHT,
    WOULD,
)
from output_rate_core import protocol as p
from output_rate_core.limits import EVERYONE, FLEET, LimitModel
from output_rate_core.policy import Scope

logger = logging.getLogger("control_plane")

FLUSH_INTERVAL_S = 5.0
# The limit model follows changes made on other replicas at least this often.
LIMITS_REFRESH_S = 1.0
# How far back the recorder remembers, per user, the end of the time reports covered and
# a limit change: engines report about once a second, so a report reaching further back
# (an interval_s of minutes) is counted in full, not merged with another engine's.
COVER_HORIZON_S = 120.0
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

# What one user is held to, as the history weighs it: (rate or None, scope).
Held = tuple[int | None, Scope]


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
        # (user, minute start) -> the sums named by TOKENS ... BORROWED
        self._counts: dict[tuple[str, int], list[float]] = {}
        # The limit model (empty until first read: every user unlimited, fleet scope);
        # per user whose limit changed in the last COVER_HORIZON_S, when the recorder
        # learnt of it and what the user was held to before; per user, the end of the
        # time its reports covered so far (on this clock).
        self._log = StoredLog(db)
        self._limits = LogFollower()
        self._changed: dict[str, tuple[float, Held]] = {}
        self._covered: dict[str, float] = {}
        self._refresh_lock = threading.Lock()
        self._wake = threading.Event()
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
        if self._limits.version is None:  # not started (tests), or the database was down
            try:
                self.refresh_limits()
            except Exception:  # counted below as under no known limit
                logger.exception("usage history: the limit model could not be loaded")
        now = self._clock()
        minute = int(now) // service.MINUTE_S * service.MINUTE_S
        with self._lock:
            if minute != self._minute:
                last = self._rows if minute == self._minute + service.MINUTE_S else set()
                self._minute, self._rows, self._rows_before = minute, set(), last
                self._num_new = {}
                self._forget_before(now)
            lent = report.borrowed_counts
            users = {*report.granted, *report.throttled, *report.would_throttle, *lent}
            admitted = self._admit(report.engine_id, users)
            counts = self._counts
            for index, report_counts in (
                (TOKENS, report.granted),
                (THROTTLED, report.throttled),
                (WOULD, report.would_throttle),
                (BORROWED, lent),
            ):
                for user, n in report_counts.items():
                    if user in admitted:
                        counts.setdefault((user, minute), [0] * NUM_SUMS)[index] += n
            for user in admitted:
                self._weigh(counts[user, minute], user, report, now)

    def _weigh(self, row: list[float], user: str, report: p.Usage, now: float) -> None:
        """Add the seconds `report` covered for `user`, under which limits, to its row."""
        tokens = report.granted.get(user, 0)
        # As /usage does: an interval no shorter than one engine needs for these tokens
        # at its bound, so a claimed tiny interval cannot make a huge rate.
        interval = max(report.interval_s, tokens / p.MAX_ENGINE_TOKENS_PER_S)
        start = now - interval
        held = self._held(self._limits.model, user)
        parts = [(start, now, held)]
        change = self._changed.get(user)
        if change is not None and start < change[0] < now:
            parts = [(start, change[0], change[1]), (change[0], now, held)]
        covered = self._covered.get(user, start)
        for begin, end, (rate, scope) in parts:
            fresh = max(0.0, end - max(begin, covered))
            covered = max(covered, end)
            row[REPORTED_S] += fresh
            if rate is not None:
                row[LIMITED_S] += fresh
                row[WEIGHT] += rate * (fresh if scope == FLEET else end - begin)
                row[LIMITED_TOKENS] += tokens * (end - begin) / interval
        self._covered[user] = covered

    def _forget_before(self, now: float) -> None:
        """Drop what reports of usual length no longer reach back to (a new minute began)."""
        horizon = now - COVER_HORIZON_S
        self._changed = {u: c for u, c in self._changed.items() if c[0] > horizon}
        self._covered = {u: t for u, t in self._covered.items() if t > horizon}

    def refresh_limits(self) -> None:
        """Bring the limit model to the change log's newest version; the users whose limit
        a change moved (of those reported lately) keep what held them before, from now.
        Any thread (the history thread calls it; tests call it after a change)."""
        with self._refresh_lock:
            catchup = self._limits.read(self._log)
            if catchup.up_to_date:
                return
            first = self._limits.version is None
            now = self._clock()
            with self._lock:
                model = self._limits.model
                before = {} if first else {u: self._held(model, u) for u in self._covered}
                active = set(before)

                def note(users: set[str] | None) -> None:
                    model = self._limits.model
                    for user in active if users is EVERYONE else users & active:
                        if self._held(model, user) != before[user]:
                            self._changed[user] = (now, before[user])

                self._limits.apply(catchup, note)

    @staticmethod
    def _held(model: LimitModel, user: str) -> Held:
        effective = model.effective(user)
        return effective.rate, effective.scope

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
        items = sorted((key, tuple(v)) for key, v in counts.items())
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
        # Loaded here, not by the first report (on the push server's thread).
        try:
            self.refresh_limits()
        except Exception:  # the database may be down for a while: the thread retries
            logger.exception("usage history: the limit model could not be loaded")
        # A local change reaches the model as soon as it is committed.
        self._db.on_commit.append(self._on_commit)
        self._thread = threading.Thread(target=self._run, name="output-rate-history", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._on_commit in self._db.on_commit:
            self._db.on_commit.remove(self._on_commit)
        self._flush_logged()

    def _on_commit(self, commit: Commit) -> None:
        self._wake.set()

    def _run(self) -> None:
        next_flush = time.monotonic() + self._flush_interval_s
        while not self._stop.is_set():
            self._wake.wait(min(LIMITS_REFRESH_S, max(0.0, next_flush - time.monotonic())))
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.refresh_limits()
            except Exception:  # the database may be down for a while: keep the last model
                logger.exception("usage history: the limit model could not be refreshed")
            if time.monotonic() >= next_flush:
                next_flush = time.monotonic() + self._flush_interval_s
                self._flush_logged()

    def _flush_logged(self) -> None:
        try:
            self.flush()
        except Exception:  # the database may be down for a while: keep serving
            logger.exception("usage history: flush failed; these counts are dropped")
