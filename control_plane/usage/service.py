"""Usage: live figures from a usage source, and the per-minute history in the database."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Connection

from control_plane.config import service as config
from control_plane.db import service
from control_plane.deps import UsageSource, UserUsage
from control_plane.errors import InvalidInput
from control_plane.fencing import LEADER, check_fence
from control_plane.usage import repository as repo
from control_plane.usage.book import would_throttle_fraction
from control_plane.usage.schemas import (
    FleetHistory,
    HistorySeries,
    UsageHistoryOut,
    UsageList,
    UsageOut,
)

MINUTE_S = 60
MAX_HISTORY_POINTS = 1440
# GET /usage/history without since: this long before now.
DEFAULT_HISTORY_S = 3600
# A bucket's rate is over at least this many seconds (a report claims at least 1 ms).
MIN_COVERED_S = 1e-3


# The sums recorded per (user, minute) (UsageRecorder in history.py adds them up,
# record_usage writes them): tokens granted, request-steps throttled, request-steps a
# shadow limit would have throttled, seconds covered, seconds under a limit, limit x
# seconds, tokens granted under a limit, tokens borrowed beyond the limit (a part of the
# granted).
TOKENS, THROTTLED, WOULD, REPORTED_S, LIMITED_S, WEIGHT, LIMITED_TOKENS, BORROWED = range(8)
NUM_SUMS = BORROWED + 1


@service("scan")
def live_usage(conn: Connection, *, source: UsageSource) -> UsageList:
    """GET /usage rows: per user, tokens/s over the last 1 s and 10 s (and of them the
    tokens borrowed beyond its rate), the limit and ceiling, and the fraction of
    request-steps that were throttled (and that a shadow limit would have throttled)."""
    totals = source.totals()
    if not totals:
        return UsageList(items=[])
    held = config.effective_of(conn, [u.user for u in totals])
    return UsageList(
        items=[
            UsageOut(
                user=u.user,
                output_tokens_per_second_1s=round(u.tokens_per_s_1s, 3),
                output_tokens_per_second_10s=round(u.tokens_per_s_10s, 3),
                borrowed_output_tokens_per_second_1s=round(u.borrowed_per_s_1s, 3),
                borrowed_output_tokens_per_second_10s=round(u.borrowed_per_s_10s, 3),
                limit=held[u.user].rate,
                ceiling=held[u.user].ceiling,
                throttled_fraction=round(u.throttled_fraction, 4),
                would_throttle_fraction=round(u.would_throttle_fraction, 4),
            )
            for u in totals
        ]
    )


def tier_rates(conn: Connection, usage: list[UserUsage]) -> dict[str | None, float]:
    """Tokens/s over the last 10 s per tier (None: users without a tier)."""
    tiers = config.tiers_of(conn, [u.user for u in usage]) if usage else {}
    per_tier: dict[str | None, float] = {}
    for u in usage:
        tier = tiers.get(u.user) or None
        per_tier[tier] = per_tier.get(tier, 0.0) + u.tokens_per_s_10s
    return per_tier


@service("write")
def record_usage(conn: Connection, *, counts: dict[tuple[str, int], tuple[float, ...]]) -> None:
    """Add (user, minute start) -> the sums named by TOKENS ... BORROWED (0 for those left
    out at the end; control_plane/usage/history.py weighs them) to the per-minute rollups,
    each with the user's effective limit now."""
    if not counts:
        return
    users = sorted({user for user, _ in counts})
    rates = config.effective_rates(conn, users)
    rows = []
    for (user, minute), values in sorted(counts.items()):
        tokens, throttled, would, reported, limited, weight, limited_tokens, borrowed = (
            *values,
            *(0.0,) * (NUM_SUMS - len(values)),
        )
        rows.append(
            repo.UsageRow(
                user,
                minute,
                int(tokens),
                int(throttled),
                rates[user],
                int(would),
                reported,
                limited,
                weight,
                limited_tokens,
                int(borrowed),
            )
        )
    repo.add_usage(conn, rows)


@service("write")
def prune_usage(
    conn: Connection, *, now: float, retention_days: int, fence: int | None = None
) -> int:
    """Drop the rollups of minutes that ended more than `retention_days` before `now`
    (``fence``: the leader's token, refused unless it still holds the lease)."""
    if fence is not None:
        check_fence(conn, name=LEADER, token=fence)
    cutoff = int(now) - retention_days * 86_400 - MINUTE_S
    return repo.delete_usage_before(conn, cutoff)


@service("scan")
def usage_history(
    conn: Connection,
    *,
    now: float,
    since: datetime | None,
    step: int,
    user: str | None,
    top: int,
    order: str,
    retention_days: int,
) -> UsageHistoryOut:
    """Reported usage in buckets of `step` seconds from `since` (default: an hour before
    `now`; a time without a zone is UTC) to `now`.

    Per user and bucket: output tokens/s while reported (tokens over the seconds the
    reports covered; a bucket with no report is null, a gap), the throttled and
    would-throttle fractions of request-steps, the limit in force (time-weighted over the
    bucket's limited seconds; null: unlimited throughout), the share of it used (tokens
    granted under a limit over what the limit allowed then) and the share of the covered
    seconds under a limit. Without `user`, the `top` users by throttled steps
    ("throttled") or tokens ("tokens"). `fleet`: every user's tokens per bucket over the
    seconds covered (one grouped query, a row per minute)."""
    window = _Window.of(now=now, since=since, step=step)
    users = (
        [user]
        if user is not None
        else repo.top_usage_users(
            conn, since=window.start, until=window.end, order=order, limit=top
        )
    )
    buckets = _user_buckets(conn, users, window)
    return UsageHistoryOut(
        since=window.start,
        until=window.end,
        step=step,
        retention_days=retention_days,
        times=[window.start + i * step for i in range(window.num_points)],
        items=[_series(name, buckets[name], window.num_points) for name in users],
        fleet=_fleet_history(conn, window),
    )


@dataclass(frozen=True)
class _Window:
    """The buckets of a history: `num_points` of `step` seconds from `start` to `end`
    (through the current minute)."""

    start: int
    end: int
    step: int
    num_points: int

    @classmethod
    def of(cls, *, now: float, since: datetime | None, step: int) -> _Window:
        if since is not None and since.tzinfo is None:
            since = since.replace(tzinfo=UTC)
        since_s = now - DEFAULT_HISTORY_S if since is None else since.timestamp()
        if step % MINUTE_S:
            raise InvalidInput(
                "step: must be a whole number of minutes (60, 120, ...)", field="step"
            )
        start = int(since_s) // step * step
        end = int(now) // MINUTE_S * MINUTE_S + MINUTE_S
        if start >= end:
            raise InvalidInput("since: must be in the past", field="since")
        num_points = -(-(end - start) // step)
        if num_points > MAX_HISTORY_POINTS:
            raise InvalidInput(
                f"step: {num_points} points from since to now; at most {MAX_HISTORY_POINTS} "
                "(choose a larger step or a later since)",
                field="step",
            )
        return cls(start, end, step, num_points)

    def index(self, minute: int) -> int:
        """The bucket a minute (its start, Unix s) falls in."""
        return (minute - self.start) // self.step


@dataclass
class _Bucket:
    """One user's minutes in one bucket, summed (the columns control_plane/usage/history.py
    writes)."""

    tokens: int = 0
    throttled: int = 0
    would_throttle: int = 0
    reported_seconds: float = 0
    limited_seconds: float = 0
    limit_weight: float = 0
    limited_tokens: float = 0
    borrowed: int = 0

    def add(self, row: repo.UsageRow) -> None:
        self.tokens += row.tokens
        self.throttled += row.throttled
        self.would_throttle += row.would_throttle
        self.reported_seconds += row.reported_seconds
        self.limited_seconds += row.limited_seconds
        self.limit_weight += row.limit_weight
        self.limited_tokens += row.limited_tokens
        self.borrowed += row.borrowed


def _user_buckets(
    conn: Connection, users: list[str], window: _Window
) -> dict[str, dict[int, _Bucket]]:
    """user -> bucket index -> its minutes summed (a bucket nothing was reported in is absent)."""
    buckets: dict[str, dict[int, _Bucket]] = {u: {} for u in users}
    if users:
        for row in repo.usage_rows(conn, users=users, since=window.start, until=window.end):
            buckets[row.user].setdefault(window.index(row.minute), _Bucket()).add(row)
    return buckets


def _series(user: str, buckets: dict[int, _Bucket], num_points: int) -> HistorySeries:
    rates: list[float | None] = [None] * num_points
    borrowed_rates: list[float | None] = [None] * num_points
    throttled: list[float | None] = [None] * num_points
    would_fractions: list[float | None] = [None] * num_points
    limits_in_force: list[float | None] = [None] * num_points
    shares: list[float | None] = [None] * num_points
    limited_fractions: list[float | None] = [None] * num_points
    for index, b in buckets.items():
        tokens, steps, seconds = b.tokens, b.throttled, b.reported_seconds
        # Tokens over the seconds the reports covered: the current minute is as long as
        # what has been written of it, not a dip.
        rates[index] = round(tokens / max(seconds, MIN_COVERED_S), 3)
        # A part of the tokens (never shown above them, whatever engines claimed).
        borrowed_rates[index] = round(min(b.borrowed, tokens) / max(seconds, MIN_COVERED_S), 3)
        throttled[index] = round(steps / (tokens + steps), 4) if tokens + steps else 0.0
        would = would_throttle_fraction(tokens, steps, b.would_throttle)
        would_fractions[index] = round(would, 4)
        limited = b.limited_seconds
        limited_fractions[index] = round(min(1.0, limited / seconds), 4) if seconds else 0.0
        if limited > 0 and b.limit_weight > 0:
            limits_in_force[index] = round(b.limit_weight / limited, 3)
            shares[index] = round(b.limited_tokens / b.limit_weight, 4)
    return HistorySeries(
        user=user,
        output_tokens_per_second=rates,
        borrowed_output_tokens_per_second=borrowed_rates,
        throttled_fraction=throttled,
        would_throttle_fraction=would_fractions,
        limit=limits_in_force,
        share_of_limit=shares,
        limited_fraction=limited_fractions,
        tokens=sum(b.tokens for b in buckets.values()),
        throttled=sum(b.throttled for b in buckets.values()),
        would_throttle=sum(b.would_throttle for b in buckets.values()),
        borrowed=sum(min(b.borrowed, b.tokens) for b in buckets.values()),
    )


def _fleet_history(conn: Connection, window: _Window) -> FleetHistory:
    tokens_in = [0] * window.num_points
    seconds_in = [0.0] * window.num_points
    for minute, tokens, seconds in repo.fleet_minutes(conn, since=window.start, until=window.end):
        tokens_in[window.index(minute)] += tokens
        seconds_in[window.index(minute)] += seconds
    return FleetHistory(
        output_tokens_per_second=[
            round(tokens / max(seconds, MIN_COVERED_S), 3) if seconds else None
            for tokens, seconds in zip(tokens_in, seconds_in, strict=True)
        ],
        tokens=sum(tokens_in),
    )
