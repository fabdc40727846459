"""Live usage reported by engines, aggregated for GET /usage and /metrics: the book the
push server hands every report to, which readers see as a `UsageSource` (control_plane/deps.py).

Each engine reports, about once a second, the output tokens it granted (and of them,
those it lent beyond the user's rate: borrowed), the request-steps it refused and the
request-steps a shadow limit would have refused (it served them) per user, with the
interval the counts cover. A user's rate (and borrowed rate) is summed over engines;
each engine's share is its counts over the time its reports cover inside the window, and
never more than one engine's bound (MAX_ENGINE_TOKENS_PER_S), whatever intervals the
engine claimed.

Bounds (docs/live-push.md, "Trust model"): only bound connections report, under their
own engine id; each report is checked by the protocol (at most MAX_USAGE_USERS users
per map, no more tokens or steps than one engine makes in its interval, user ids by the
REST rules). Here, per engine and by the control plane's own clock (an engine chooses
the intervals it claims, not when its reports arrive): at most MAX_REPORTS_PER_S
reports a second (MAX_REPORT_BURST at once), and at most MAX_ENGINE_TOKENS_PER_S
tokens and MAX_ENGINE_STEPS_PER_S refused steps (and as many would-refuse steps) per
second plus USAGE_BURST_S seconds' worth. A report over a bound is refused whole and
counted by reason. The parts of a report split by the engine (`Usage.part` of
`num_parts`) are taken together when the last arrives, and every bound counts them as
one report. The book keeps at most MAX_REPORTS_PER_ENGINE reports per engine and
MAX_TRACKED_USERS distinct users (a report's new users beyond that are left out and
counted), so GET /usage and /metrics stay bounded whatever engines send.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from control_plane.deps import UserUsage
from output_rate_core import protocol as p

logger = logging.getLogger("control_plane")

WINDOW_S = 10.0
SHORT_WINDOW_S = 1.0
# The short window reads each engine's latest report if it arrived within this long.
SHORT_REACH_S = SHORT_WINDOW_S + p.HEARTBEAT_INTERVAL_S
# Engines report about once a second: twice that in the window is plenty.
MAX_REPORTS_PER_ENGINE = int(2 * WINDOW_S / p.HEARTBEAT_INTERVAL_S)
MAX_TRACKED_USERS = 50_000
# Per engine: a real one reports about once a second (and when it goes idle, at most
# every 0.5 s: engine_ext/push_client.py holds reports that come sooner).
MAX_REPORTS_PER_S = p.MAX_USAGE_REPORTS_PER_S
MAX_REPORT_BURST = p.MAX_USAGE_REPORT_BURST
# Per engine, on top of what MAX_ENGINE_TOKENS_PER_S / MAX_ENGINE_STEPS_PER_S allow for
# the time since its reports began: a first report, or one that arrives early.
USAGE_BURST_S = 1.0
# Parts of a split report arrive back to back; an interval still missing parts after
# this long is dropped (counted under REFUSED_PARTS).
PART_TIMEOUT_S = WINDOW_S

# Why a report was refused (the `reason` of output_rate_usage_refused_total).
REFUSED_REPORTS = "reports"  # over MAX_REPORTS_PER_S
REFUSED_TOKENS = "tokens"  # over MAX_ENGINE_TOKENS_PER_S, for its interval or the clock's
REFUSED_STEPS = "steps"  # the same for refused (or would-refuse) request-steps
REFUSED_USERS = "users"  # its parts together name over MAX_USAGE_USERS users in a map
REFUSED_PARTS = "parts"  # a part out of order, or an interval whose parts did not all come
REFUSAL_REASONS = (REFUSED_REPORTS, REFUSED_TOKENS, REFUSED_STEPS, REFUSED_USERS, REFUSED_PARTS)


class NoUsage:
    """The usage source of an app without a push endpoint: nothing is reported."""

    def totals(self) -> list[UserUsage]:
        return []

    def rate_1s(self, user: str) -> float | None:
        return None

    def report_ages(self) -> dict[str, float]:
        return {}


class Refusals:
    """What was refused, counted by reason; any thread (read by /metrics). The first
    refusal of each reason is logged (a flood of refusals is not a flood of lines)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, reason: str, num: int = 1, *, engine_id: str = "") -> None:
        with self._lock:
            first = reason not in self._counts
            self._counts[reason] = self._counts.get(reason, 0) + num
        if first:
            logger.warning(
                "usage refused (%s) from engine %r; further ones are only counted in "
                "output_rate_usage_refused_total",
                reason,
                engine_id,
            )

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@dataclass
class Pace:
    """GCRA on the control plane's clock: at most `rate` units a second, `burst_s`
    seconds' worth at once. `due` is when everything taken so far would be paid off."""

    rate: float
    burst_s: float
    due: float = float("-inf")

    def fits(self, now: float, num: float) -> bool:
        return max(self.due, now) + num / self.rate - now <= self.burst_s

    def take(self, now: float, num: float) -> None:
        self.due = max(self.due, now) + num / self.rate


@dataclass
class _EngineBounds:
    """One engine's paces, and the parts of a split report that are still arriving."""

    reports: Pace = field(
        default_factory=lambda: Pace(MAX_REPORTS_PER_S, MAX_REPORT_BURST / MAX_REPORTS_PER_S)
    )
    tokens: Pace = field(default_factory=lambda: Pace(p.MAX_ENGINE_TOKENS_PER_S, USAGE_BURST_S))
    steps: Pace = field(default_factory=lambda: Pace(p.MAX_ENGINE_STEPS_PER_S, USAGE_BURST_S))
    would_steps: Pace = field(default_factory=lambda: Pace(p.MAX_ENGINE_STEPS_PER_S, USAGE_BURST_S))
    parts: list[p.Usage] = field(default_factory=list)
    parts_since: float = 0.0

    def is_fresh(self, now: float) -> bool:
        """Nothing owed and no parts waiting: the same as a new engine's bounds."""
        paces = (self.reports, self.tokens, self.steps, self.would_steps)
        return not self.parts and max(pace.due for pace in paces) < now


@dataclass(frozen=True)
class Interval:
    """One accepted report (all its parts), as the book keeps it (and as replicas share
    it: control_plane/replicas/live_usage.py)."""

    received: float
    interval_s: float
    parts: tuple[p.Usage, ...]
    # Tokens granted over every part (what the rate cap divides by).
    tokens: int


def would_throttle_fraction(granted: int, throttled: int, would_throttle: int) -> float:
    """Of a user's request-steps (tokens granted + steps refused), the share a shadow
    limit would have refused; at most 1 whatever engines claim."""
    total = granted + throttled
    return min(1.0, would_throttle / total) if total else 0.0


_NO_STEPS = (0, 0, 0)


class UsageBook:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # engine id -> its accepted reports (received, interval, parts), oldest first
        self._reports: dict[str, deque[Interval]] = {}
        # engine id -> when its last report arrived (kept past the window; /metrics)
        self._last_report_at: dict[str, float] = {}
        # engine id -> its paces and waiting parts (dropped once fresh again)
        self._bounds: dict[str, _EngineBounds] = {}
        self._next_sweep = 0.0
        # user -> number of stored parts naming it
        self._users: dict[str, int] = {}
        self.num_users_left_out = 0
        self.refused = Refusals()
        # Also called with every part of every accepted report
        # (control_plane/usage/history.py keeps the history).
        self.on_report: list[Callable[[p.Usage], None]] = []

    def add(self, report: p.Usage, *, engine_id: str | None = None) -> bool:
        """Store a report (or one part of it) under `engine_id` (the connection's bound id;
        default: the report's own, for callers that checked it). False: refused, or a
        part of a report that is not complete yet."""
        engine_id = engine_id or report.engine_id
        now = self._clock()
        with self._lock:
            self._expire(now)
            self._last_report_at[engine_id] = now
            bounds = self._bounds.setdefault(engine_id, _EngineBounds())
            parts = self._assemble(engine_id, bounds, report, now)
            if parts is None:
                return False
            tokens = sum(sum(part.granted.values()) for part in parts)
            reason = self._over_bounds(bounds, parts, tokens, now)
            if reason is not None:
                self.refused.add(reason, engine_id=engine_id)
                return False
            parts = self._admit(parts)
            reports = self._reports.setdefault(engine_id, deque())
            reports.append(Interval(now, parts[0].interval_s, parts, tokens))
            for part in parts:
                self._count(part, +1)
            while len(reports) > MAX_REPORTS_PER_ENGINE:
                self._uncount(reports.popleft())
        for hook in self.on_report:
            for part in parts:
                hook(part)
        return True

    def _assemble(
        self, engine_id: str, bounds: _EngineBounds, report: p.Usage, now: float
    ) -> tuple[p.Usage, ...] | None:
        """The whole report once its last part is here (None: not yet, or refused)."""
        waiting = bounds.parts
        if report.part == 0:
            if waiting:  # the previous split report never completed
                self.refused.add(REFUSED_PARTS, engine_id=engine_id)
            if report.num_parts == 1:
                bounds.parts = []
                return (report,)
            bounds.parts, bounds.parts_since = [report], now
            return None
        first = waiting[0] if waiting else None
        if (
            first is None
            or report.part != len(waiting)
            or (report.num_parts, report.interval_s) != (first.num_parts, first.interval_s)
        ):
            self.refused.add(REFUSED_PARTS, engine_id=engine_id)
            bounds.parts = []
            return None
        waiting.append(report)
        # Checked as they come, so waiting parts never hold more than one report's users.
        if max(self._num_users(waiting)) > p.MAX_USAGE_USERS:
            self.refused.add(REFUSED_USERS, engine_id=engine_id)
            bounds.parts = []
            return None
        if len(waiting) < report.num_parts:
            return None
        bounds.parts = []
        return tuple(waiting)

    @staticmethod
    def _num_users(parts: list[p.Usage] | tuple[p.Usage, ...]) -> tuple[int, int, int, int]:
        return (
            sum(len(r.granted) for r in parts),
            sum(len(r.throttled) for r in parts),
            sum(len(r.would_throttle) for r in parts),
            sum(len(r.borrowed_counts) for r in parts),
        )

    def _over_bounds(
        self, bounds: _EngineBounds, parts: tuple[p.Usage, ...], tokens: int, now: float
    ) -> str | None:
        """Why the report breaks a bound (None: it does not; its paces are taken)."""
        if not bounds.reports.fits(now, 1):
            return REFUSED_REPORTS
        if max(self._num_users(parts)) > p.MAX_USAGE_USERS:
            return REFUSED_USERS
        steps = sum(sum(part.throttled.values()) for part in parts)
        would = sum(sum(part.would_throttle.values()) for part in parts)
        # The protocol checks each part against its interval; here all parts together.
        interval_s = parts[0].interval_s
        if tokens > p.MAX_ENGINE_TOKENS_PER_S * interval_s + 1 or not bounds.tokens.fits(
            now, tokens
        ):
            return REFUSED_TOKENS
        # Borrowed tokens are a part of the granted ones (paced with them): no more.
        lent = sum(sum(part.borrowed_counts.values()) for part in parts)
        if lent > p.MAX_ENGINE_TOKENS_PER_S * interval_s + 1:
            return REFUSED_TOKENS
        for num, pace in ((steps, bounds.steps), (would, bounds.would_steps)):
            if num > p.MAX_ENGINE_STEPS_PER_S * interval_s + 1 or not pace.fits(now, num):
                return REFUSED_STEPS
        bounds.reports.take(now, 1)
        bounds.tokens.take(now, tokens)
        bounds.steps.take(now, steps)
        bounds.would_steps.take(now, would)
        return None

    def _admit(self, parts: tuple[p.Usage, ...]) -> tuple[p.Usage, ...]:
        """The parts without the new users that would take the book over its bound."""
        users = self._users
        room = MAX_TRACKED_USERS - len(users)
        new = {
            u
            for r in parts
            for u in (*r.granted, *r.throttled, *r.would_throttle, *r.borrowed_counts)
            if u not in users
        }
        if len(new) <= room:
            return parts
        keep = set(sorted(new)[:room])
        self.num_users_left_out += len(new) - len(keep)

        def kept(counts: dict[str, int]) -> dict[str, int]:
            return {u: n for u, n in counts.items() if u in users or u in keep}

        return tuple(
            p.Usage(
                r.engine_id,
                r.interval_s,
                kept(r.granted),
                kept(r.throttled),
                r.part,
                r.num_parts,
                kept(r.would_throttle),
                kept(r.borrowed_counts),
            )
            for r in parts
        )

    def _count(self, report: p.Usage, step: int) -> None:
        users = self._users
        names = {*report.granted, *report.throttled}
        if report.would_throttle:
            names.update(report.would_throttle)
        if report.borrowed:
            names.update(report.borrowed_counts)
        for user in names:
            n = users.get(user, 0) + step
            if n > 0:
                users[user] = n
            else:
                users.pop(user, None)

    def _uncount(self, interval: Interval) -> None:
        for part in interval.parts:
            self._count(part, -1)

    def _expire(self, now: float) -> None:
        for engine_id, reports in list(self._reports.items()):
            while reports and reports[0].received < now - WINDOW_S:
                self._uncount(reports.popleft())
            if not reports:
                del self._reports[engine_id]
        if now < self._next_sweep:
            return
        # Engines come and go (each connection may claim a new id): forget their bounds
        # once they hold nothing an engine could not start again with.
        self._next_sweep = now + WINDOW_S
        for engine_id, bounds in list(self._bounds.items()):
            if bounds.parts and bounds.parts_since < now - PART_TIMEOUT_S:
                self.refused.add(REFUSED_PARTS, engine_id=engine_id)
                bounds.parts = []
            if bounds.is_fresh(now):
                del self._bounds[engine_id]

    def report_ages(self) -> dict[str, float]:
        """Seconds since each engine's last usage report."""
        now = self._clock()
        with self._lock:
            return {engine: now - at for engine, at in self._last_report_at.items()}

    def windows(self) -> tuple[float, dict[str, EngineWindow]]:
        """(now, engine id -> its reports in the window and when its last one arrived):
        what `totals` reads, for a view of the whole fleet to merge with other replicas'."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            return now, {
                engine_id: EngineWindow(tuple(reports), now, self._last_report_at[engine_id])
                for engine_id, reports in self._reports.items()
            }

    def totals(self) -> list[UserUsage]:
        _, windows = self.windows()
        return combine(windows.values())

    def rate_1s(self, user: str) -> float | None:
        now = self._clock()
        with self._lock:
            self._expire(now)
            if user not in self._users:
                return None
            latest = [
                EngineWindow((reports[-1],), now, now)
                for reports in self._reports.values()
                if reports
            ]
        return rate_1s_of(latest, user)


@dataclass(frozen=True)
class EngineWindow:
    """One engine's reports (oldest first) as seen at `at` (the clock of the book): its
    figures are what a book holding them shows at that moment."""

    intervals: tuple[Interval, ...]
    at: float
    last_report_at: float


def combine(windows: Iterable[EngineWindow]) -> list[UserUsage]:
    """Per user, summed over engines: each engine's rates (granted and borrowed) as of
    its window's `at`, and the fractions of the request-steps of all of them. A borrowed
    rate is never shown above the user's whole rate, whatever engines claim."""
    granted_1: dict[str, float] = {}
    granted_10: dict[str, float] = {}
    borrowed_1: dict[str, float] = {}
    borrowed_10: dict[str, float] = {}
    # user -> (tokens granted, steps refused, steps a shadow limit would have refused)
    steps: dict[str, tuple[int, int, int]] = {}
    for window in windows:
        intervals = [i for i in window.intervals if i.received >= window.at - WINDOW_S]
        _add_rates(intervals, window.at - WINDOW_S, granted_10)
        # The short window: the engine's latest report, if it is recent.
        _add_rates(intervals[-1:], window.at - SHORT_REACH_S, granted_1)
        if any(part.borrowed for i in intervals for part in i.parts):
            _add_rates(intervals, window.at - WINDOW_S, borrowed_10, lent=True)
            _add_rates(intervals[-1:], window.at - SHORT_REACH_S, borrowed_1, lent=True)
        for interval in intervals:
            for report in interval.parts:
                for user, n in report.granted.items():
                    g, t, w = steps.get(user, _NO_STEPS)
                    steps[user] = (g + n, t, w)
                for user, n in report.throttled.items():
                    g, t, w = steps.get(user, _NO_STEPS)
                    steps[user] = (g, t + n, w)
                for user, n in report.would_throttle.items():
                    g, t, w = steps.get(user, _NO_STEPS)
                    steps[user] = (g, t, w + n)
    return [
        UserUsage(
            user=user,
            tokens_per_s_1s=granted_1.get(user, 0.0),
            tokens_per_s_10s=granted_10.get(user, 0.0),
            throttled_fraction=t / (g + t) if g + t else 0.0,
            would_throttle_fraction=would_throttle_fraction(g, t, w),
            borrowed_per_s_1s=min(borrowed_1.get(user, 0.0), granted_1.get(user, 0.0)),
            borrowed_per_s_10s=min(borrowed_10.get(user, 0.0), granted_10.get(user, 0.0)),
        )
        for user, (g, t, w) in sorted(steps.items())
    ]


def rate_1s_of(windows: Iterable[EngineWindow], user: str) -> float:
    """One user's tokens/s over the short window, as `combine` has it."""
    rate: dict[str, float] = {}
    for window in windows:
        _add_rates(window.intervals[-1:], window.at - SHORT_REACH_S, rate, only=user)
    return rate.get(user, 0.0)


def _add_rates(
    intervals: Sequence[Interval],
    since: float,
    into: dict[str, float],
    *,
    only: str | None = None,
    lent: bool = False,
) -> None:
    """Add each user's (only `only`'s) granted tokens (`lent`: borrowed tokens) over
    the time one engine's reports received since `since` cover: at least the time one
    engine needs for their granted tokens, so no rate exceeds MAX_ENGINE_TOKENS_PER_S per
    engine."""
    recent = [i for i in intervals if i.received >= since]
    if not recent:
        return
    covered = max(
        sum(i.interval_s for i in recent),
        sum(i.tokens for i in recent) / p.MAX_ENGINE_TOKENS_PER_S,
    )
    for interval in recent:
        for report in interval.parts:
            granted = report.borrowed_counts if lent else report.granted
            if only is not None:
                granted = {only: granted[only]} if only in granted else {}
            for user, n in granted.items():
                into[user] = into.get(user, 0.0) + n / covered
