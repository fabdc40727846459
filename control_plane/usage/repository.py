"""Usage history queries: per-minute rollups of what engines reported."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import Connection, String, cast, delete, func, select
from sqlalchemy.dialects import postgresql, sqlite

from control_plane.db import one_of
from control_plane.models import UsageMinute, table

usage_minutes = table(UsageMinute)
SUMMED_SECONDS = ("reported_seconds", "limited_seconds", "limit_weight", "limited_tokens")


class UsageRow(NamedTuple):
    user: str
    minute: int
    tokens: int
    throttled: int
    limit_rate: int | None
    would_throttle: int = 0
    # What control_plane/usage/history.py weighs (the columns of models.UsageMinute).
    reported_seconds: float = 0.0
    limited_seconds: float = 0.0
    limit_weight: float = 0.0
    limited_tokens: float = 0.0
    # Of the tokens, those lent beyond the user's rate (borrowed up to its ceiling).
    borrowed: int = 0


def add_usage(conn: Connection, rows: Sequence[UsageRow]) -> None:
    """Add the counts and seconds to each (user, minute) row, creating it if new; the
    limit is replaced."""
    if not rows:
        return
    dialect_insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    statement = dialect_insert(usage_minutes)
    statement = statement.on_conflict_do_update(
        index_elements=[usage_minutes.c.user, usage_minutes.c.minute],
        set_={
            "tokens": usage_minutes.c.tokens + statement.excluded.tokens,
            "throttled": usage_minutes.c.throttled + statement.excluded.throttled,
            "would_throttle": usage_minutes.c.would_throttle + statement.excluded.would_throttle,
            "borrowed": usage_minutes.c.borrowed + statement.excluded.borrowed,
            "limit_rate": statement.excluded.limit_rate,
            **{name: usage_minutes.c[name] + statement.excluded[name] for name in SUMMED_SECONDS},
        },
    )
    conn.execute(statement, [r._asdict() for r in rows])


def delete_usage_before(conn: Connection, minute: int) -> int:
    result = conn.execute(delete(usage_minutes).where(usage_minutes.c.minute < minute))
    return int(result.rowcount or 0)


def usage_rows(
    conn: Connection, *, users: Sequence[str] | None, since: int, until: int
) -> list[UsageRow]:
    """Rows with since <= minute < until (of these users; None: every user), by minute."""
    query = select(
        usage_minutes.c.user,
        usage_minutes.c.minute,
        usage_minutes.c.tokens,
        usage_minutes.c.throttled,
        usage_minutes.c.limit_rate,
        usage_minutes.c.would_throttle,
        *(usage_minutes.c[name] for name in SUMMED_SECONDS),
        usage_minutes.c.borrowed,
    ).where(usage_minutes.c.minute >= since, usage_minutes.c.minute < until)
    if users is not None:
        query = query.where(usage_minutes.c.user.in_(list(users)))
    return [UsageRow(*r) for r in conn.execute(query.order_by(usage_minutes.c.minute))]


def top_usage_users(
    conn: Connection, *, since: int, until: int, order: str, limit: int
) -> list[str]:
    """The users with the most throttled request-steps ("throttled", then tokens) or the
    most tokens ("tokens") in the range."""
    throttled = func.sum(usage_minutes.c.throttled)
    tokens = func.sum(usage_minutes.c.tokens)
    keys = (throttled.desc(), tokens.desc()) if order == "throttled" else (tokens.desc(),)
    query = (
        select(usage_minutes.c.user)
        .where(usage_minutes.c.minute >= since, usage_minutes.c.minute < until)
        .group_by(usage_minutes.c.user)
        .order_by(*keys, usage_minutes.c.user)
        .limit(limit)
    )
    return list(conn.execute(query).scalars())


def fleet_minutes(conn: Connection, *, since: int, until: int) -> list[tuple[int, int, float]]:
    """Per minute with since <= minute < until: (minute, tokens of every user, the most
    seconds one user's reports covered), one grouped query (a row per minute)."""
    query = (
        select(
            usage_minutes.c.minute,
            func.sum(usage_minutes.c.tokens),
            func.max(usage_minutes.c.reported_seconds),
        )
        .where(usage_minutes.c.minute >= since, usage_minutes.c.minute < until)
        .group_by(usage_minutes.c.minute)
        .order_by(usage_minutes.c.minute)
    )
    return [(int(m), int(t), float(s)) for m, t, s in conn.execute(query)]


class MinuteTokens(NamedTuple):
    """A user's minutes in a range: the most tokens of one, and all of them joined by the
    database (`values()` reads them; most previews only need the peak)."""

    peak: int
    joined: str

    def values(self) -> list[int]:
        return [int(t) for t in self.joined.split(",")]


def minute_tokens(
    conn: Connection, *, since: int, until: int, users: Sequence[str] | None
) -> dict[str, MinuteTokens]:
    """user -> its minutes with since <= minute < until that have tokens (of these users,
    in one statement; None: every user), summed over engines as stored.

    One row per user, its minutes joined into one string by the database: an hour of
    5,000 users is 300,000 minutes, and fetching them as rows cost five times more."""
    joined = func.aggregate_strings(cast(usage_minutes.c.tokens, String), ",")
    query = (
        select(usage_minutes.c.user, func.max(usage_minutes.c.tokens), joined)
        .where(
            usage_minutes.c.minute >= since,
            usage_minutes.c.minute < until,
            usage_minutes.c.tokens > 0,
        )
        .group_by(usage_minutes.c.user)
    )
    if users is not None:
        query = query.where(one_of(conn, usage_minutes.c.user, list(users)))
    return {user: MinuteTokens(peak, tokens) for user, peak, tokens in conn.execute(query)}
