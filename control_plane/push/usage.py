"""Live usage reported by engines, aggregated for GET /usage and /metrics.

Each engine reports, about once a second, the output tokens it granted and the
request-steps it refused per user, with the interval the counts cover. A
user's rate is summed over engines; each engine's share is its counts over the
time its reports cover inside the window.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from control_plane import services
from engine_ext import protocol as p

WINDOW_S = 10.0
SHORT_WINDOW_S = 1.0


@dataclass(frozen=True)
class UserUsage:
    user: str
    tokens_per_s_1s: float
    tokens_per_s_10s: float
    throttled_fraction: float


class UsageBook:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # engine id -> (time received, report), oldest first
        self._reports: dict[str, deque[tuple[float, p.Usage]]] = {}
        # engine id -> when its last report arrived (kept past the window; /metrics)
        self._last_report_at: dict[str, float] = {}

    def add(self, report: p.Usage) -> None:
        now = self._clock()
        with self._lock:
            self._last_report_at[report.engine_id] = now
            reports = self._reports.setdefault(report.engine_id, deque())
            reports.append((now, report))
            self._expire(now)

    def _expire(self, now: float) -> None:
        for engine_id, reports in list(self._reports.items()):
            while reports and reports[0][0] < now - WINDOW_S:
                reports.popleft()
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
            self._add_rates(reports[-1:], now - SHORT_WINDOW_S - p.HEARTBEAT_INTERVAL_S, granted_1)
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

    @staticmethod
    def _add_rates(
        reports: list[tuple[float, p.Usage]], since: float, into: dict[str, float]
    ) -> None:
        recent = [r for received, r in reports if received >= since]
        covered = sum(r.interval_s for r in recent)
        if not covered:
            return
        for report in recent:
            for user, n in report.granted.items():
                into[user] = into.get(user, 0.0) + n / covered

    def usage_items(self, conn: Connection) -> list[dict[str, Any]]:
        """GET /usage rows: per user, tokens/s over the last 1 s and 10 s, the limit and
        the fraction of request-steps that were throttled."""
        totals = self.totals()
        if not totals:
            return []
        limits = services.effective_rates(conn, [u.user for u in totals])
        return [
            {
                "user": u.user,
                "output_tokens_per_second_1s": round(u.tokens_per_s_1s, 3),
                "output_tokens_per_second_10s": round(u.tokens_per_s_10s, 3),
                "limit": limits[u.user],
                "throttled_fraction": round(u.throttled_fraction, 4),
            }
            for u in totals
        ]
