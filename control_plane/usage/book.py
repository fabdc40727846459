"""Live usage reported by engines, aggregated for GET /usage and /metrics: the book the
push server hands every report to, and what readers of live usage see of it.

Each engine reports, about once a second, the output tokens it granted and the
request-steps it refused per user, with the interval the counts cover. A
user's rate is summed over engines; each engine's share is its counts over the
time its reports cover inside the window.

Bounds (docs/live-push.md, "Trust model"): only bound connections report, under their
own engine id; each report is checked by the protocol (at most MAX_USAGE_USERS users
per map, no more tokens or steps than one engine makes in its interval, user ids by the
REST rules); the book keeps at most MAX_REPORTS_PER_ENGINE reports per engine and
MAX_TRACKED_USERS distinct users (a report's new users beyond that are left out and
counted), so GET /usage and /metrics stay bounded whatever engines send.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from output_rate_core import protocol as p

WINDOW_S = 10.0
SHORT_WINDOW_S = 1.0
# The short window reads each engine's latest report if it arrived within this long.
SHORT_REACH_S = SHORT_WINDOW_S + p.HEARTBEAT_INTERVAL_S
# Engines report about once a second: twice that in the window is plenty.
MAX_REPORTS_PER_ENGINE = int(2 * WINDOW_S / p.HEARTBEAT_INTERVAL_S)
MAX_TRACKED_USERS = 50_000


@dataclass(frozen=True)
class UserUsage:
    user: str
    tokens_per_s_1s: float
    tokens_per_s_10s: float
    throttled_fraction: float


class UsageSource(Protocol):
    """What GET /usage and /metrics read of live usage."""

    def totals(self) -> list[UserUsage]:
        """Per user, over the window: tokens/s and the throttled fraction."""
        ...

    def report_ages(self) -> dict[str, float]:
        """Seconds since each engine's last usage report."""
        ...

    def rate_1s(self, user: str) -> float | None:
        """One user's tokens/s over the short window, as `totals` has it (None: no report
        in the window names the user); without computing everyone's."""
        ...


class NoUsage:
    """The usage source of an app without a push endpoint: nothing is reported."""

    def totals(self) -> list[UserUsage]:
        return []

    def rate_1s(self, user: str) -> float | None:
        return None

    def report_ages(self) -> dict[str, float]:
        return {}


class UsageBook:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # engine id -> (time received, report), oldest first
        self._reports: dict[str, deque[tuple[float, p.Usage]]] = {}
        # engine id -> when its last report arrived (kept past the window; /metrics)
        self._last_report_at: dict[str, float] = {}
        # user -> number of stored reports naming it
        self._users: dict[str, int] = {}
        self.num_users_left_out = 0
        # Also called with every report (control_plane/usage/history.py keeps the history).
        self.on_report: list[Callable[[p.Usage], None]] = []

    def add(self, report: p.Usage, *, engine_id: str | None = None) -> None:
        """Store a report under `engine_id` (the connection's bound id; default: the
        report's own, for callers that checked it)."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            self._last_report_at[engine_id or report.engine_id] = now
            report = self._admit(report)
            reports = self._reports.setdefault(engine_id or report.engine_id, deque())
            reports.append((now, report))
            self._count(report, +1)
            while len(reports) > MAX_REPORTS_PER_ENGINE:
                self._count(reports.popleft()[1], -1)
        for hook in self.on_report:
            hook(report)

    def _admit(self, report: p.Usage) -> p.Usage:
        """The report without the new users that would take the book over its bound."""
        users = self._users
        room = MAX_TRACKED_USERS - len(users)
        new = {u for u in (*report.granted, *report.throttled) if u not in users}
        if len(new) <= room:
            return report
        keep = set(sorted(new)[:room])
        self.num_users_left_out += len(new) - len(keep)

        def kept(counts: dict[str, int]) -> dict[str, int]:
            return {u: n for u, n in counts.items() if u in users or u in keep}

        return p.Usage(
            report.engine_id, report.interval_s, kept(report.granted), kept(report.throttled)
        )

    def _count(self, report: p.Usage, step: int) -> None:
        users = self._users
        for user in {*report.granted, *report.throttled}:
            n = users.get(user, 0) + step
            if n > 0:
                users[user] = n
            else:
                users.pop(user, None)

    def _expire(self, now: float) -> None:
        for engine_id, reports in list(self._reports.items()):
            while reports and reports[0][0] < now - WINDOW_S:
                self._count(reports.popleft()[1], -1)
            if not reports:
                del self._reports[engine_id]

    def report_ages(self) -> dict[str, float]:
        """Seconds since each engine's last usage report."""
        now = self._clock()
        with self._lock:
            return {engine: now - at for engine, at in self._last_report_at.items()}

    def totals(self) -> list[UserUsage]:
        now = self._clock()
        with self._lock:
            self._expire(now)
            per_engine = [list(r) for r in self._reports.values()]
        granted_1: dict[str, float] = {}
        granted_10: dict[str, float] = {}
        steps: dict[str, tuple[int, int]] = {}
        for reports in per_engine:
            self._add_rates(reports, now - WINDOW_S, granted_10)
            # The short window: the engine's latest report, if it is recent.
            self._add_rates(reports[-1:], now - SHORT_REACH_S, granted_1)
            for _, report in reports:
                for user, n in report.granted.items():
                    g, t = steps.get(user, (0, 0))
                    steps[user] = (g + n, t)
                for user, n in report.throttled.items():
                    g, t = steps.get(user, (0, 0))
                    steps[user] = (g, t + n)
        return [
            UserUsage(
                user=user,
                tokens_per_s_1s=granted_1.get(user, 0.0),
                tokens_per_s_10s=granted_10.get(user, 0.0),
                throttled_fraction=t / (g + t) if g + t else 0.0,
            )
            for user, (g, t) in sorted(steps.items())
        ]

    def rate_1s(self, user: str) -> float | None:
        now = self._clock()
        with self._lock:
            self._expire(now)
            if user not in self._users:
                return None
            latest = [reports[-1] for reports in self._reports.values() if reports]
        rate: dict[str, float] = {}
        for report in latest:
            self._add_rates([report], now - SHORT_REACH_S, rate, only=user)
        return rate.get(user, 0.0)

    @staticmethod
    def _add_rates(
        reports: list[tuple[float, p.Usage]],
        since: float,
        into: dict[str, float],
        *,
        only: str | None = None,
    ) -> None:
        """Add each user's (only `only`'s) granted tokens over the time the reports
        received since `since` cover."""
        recent = [r for received, r in reports if received >= since]
        covered = sum(r.interval_s for r in recent)
        if not covered:
            return
        for report in recent:
            granted = report.granted
            if only is not None:
                granted = {only: granted[only]} if only in granted else {}
            for user, n in granted.items():
                into[user] = into.get(user, 0.0) + n / covered
