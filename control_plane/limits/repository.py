"""Limit reads: one user's limit, tiers, pages of users. No rules here: the service
decides, this module reads rows. A write's rows are written by the config log's commit
(control_plane/config/), from the write's ops; the one-statement reads here join the
config row's columns.

SQLAlchemy Core on a Connection: the hot statements are built once at import (their
compiled form is cached), and rows come back as named tuples, not ORM objects
(docs/control-plane.md, "How a request runs").
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sqlalchemy import Connection, bindparam, func, select

from control_plane.config.repository import (
    CONFIG_ROW_ID,
    RECORD_COLUMNS,
    STATE_COLUMNS,
    State,
    UserRecord,
    config_state,
    state_of,
    user_record,
)
from control_plane.db import unicode_lower
from control_plane.models import Tier, UserLimit, table
from output_rate_core.policy import Policy

tiers = table(Tier)
user_limits = table(UserLimit)


# ---- one user's limit, in one statement --------------------------------------


class LimitRow(NamedTuple):
    """What a LimitView needs: the config state, the user's row (None: not configured),
    its tier's policy (None: no tier)."""

    state: State
    record: UserRecord | None
    tier: Policy | None


_GET_LIMIT = (
    select(
        *STATE_COLUMNS,
        *RECORD_COLUMNS,
        tiers.c.rate,
        tiers.c.scope,
        tiers.c.enforcement,
        tiers.c.ceiling,
    )
    .select_from(
        config_state.outerjoin(user_limits, user_limits.c.user == bindparam("user")).outerjoin(
            tiers, tiers.c.name == user_limits.c.tier
        )
    )
    .where(config_state.c.id == CONFIG_ROW_ID)
)


def get_limit_row(conn: Connection, user: str) -> LimitRow:
    row = conn.execute(_GET_LIMIT, {"user": user}).one_or_none()
    assert row is not None, "config_state row is created by the initial migration"
    num_state, num_record = len(STATE_COLUMNS), len(RECORD_COLUMNS)
    state = state_of(row[:num_state])
    record_row = row[num_state : num_state + num_record]
    if record_row[-1] is None:  # no version: the user has no row (the outer join's nulls)
        return LimitRow(state, None, None)
    record = user_record(record_row)
    tier = None if record.tier is None else Policy(*row[num_state + num_record :])
    return LimitRow(state, record, tier)


# ---- tiers -------------------------------------------------------------------


class TierRow(NamedTuple):
    name: str
    policy: Policy
    description: str
    version: int
    num_users: int


_TIER_COLUMNS = (
    tiers.c.name,
    tiers.c.rate,
    tiers.c.scope,
    tiers.c.enforcement,
    tiers.c.ceiling,
    tiers.c.description,
    tiers.c.version,
    tiers.c.num_users,
)


def _tier_row(row: Any) -> TierRow:
    name, rate, scope, enforcement, ceiling, description, version, num_users = row
    policy = Policy(rate, scope, enforcement, ceiling)
    return TierRow(name, policy, description, version, num_users)


_GET_TIER = select(*_TIER_COLUMNS).where(tiers.c.name == bindparam("name"))


def get_tier(conn: Connection, name: str) -> TierRow | None:
    row = conn.execute(_GET_TIER, {"name": name}).one_or_none()
    return None if row is None else _tier_row(row)


def list_tiers(conn: Connection) -> list[TierRow]:
    return [_tier_row(r) for r in conn.execute(select(*_TIER_COLUMNS).order_by(tiers.c.name))]


def tier_has_users(conn: Connection, name: str) -> bool:
    query = select(user_limits.c.user).where(user_limits.c.tier == name).limit(1)
    return conn.execute(query).first() is not None


# ---- users -------------------------------------------------------------------


def all_records(conn: Connection, *, tier: str | None = None) -> dict[str, UserRecord]:
    """Every configured user's record (only those of `tier`, if given)."""
    query = select(user_limits.c.user, *RECORD_COLUMNS)
    if tier is not None:
        query = query.where(user_limits.c.tier == tier)
    return {user: user_record(record) for user, *record in conn.execute(query)}


def prefix_upper_bound(prefix: str) -> str | None:
    """The smallest string above every string that starts with `prefix` (None: unbounded)."""
    chars = list(prefix)
    while chars:
        last = ord(chars[-1])
        if last < 0x10FFFF and not 0xD7FF <= last < 0xDFFF:
            chars[-1] = chr(last + 1)
            return "".join(chars)
        chars.pop()
    return None


# GET /limits?sort=: column, descending. The user id breaks ties (a stable order).
SORT_KEYS: dict[str, tuple[Any, bool]] = {
    "user": (user_limits.c.user, False),
    "-user": (user_limits.c.user, True),
    "tier": (user_limits.c.tier, False),
    "-tier": (user_limits.c.tier, True),
    "override": (user_limits.c.rate, False),
    "-override": (user_limits.c.rate, True),
}


def _filter(
    query: Any, *, tier: str | None, prefix: str | None, contains: str | None = None
) -> Any:
    if contains:
        # Case-insensitive substring (any letter, "MÜLLER" finds "müller", on both
        # databases): a scan, fine for the thousands of users one browses.
        query = query.where(
            unicode_lower(user_limits.c.user).contains(contains.lower(), autoescape=True)
        )
    if tier is not None:
        query = query.where(user_limits.c.tier == tier)
    if prefix:
        # A range on the (byte-ordered) key instead of LIKE: one index range on both
        # databases, and no escaping of % and _.
        query = query.where(user_limits.c.user >= prefix)
        upper = prefix_upper_bound(prefix)
        if upper is not None:
            query = query.where(user_limits.c.user < upper)
    return query


def list_users(
    conn: Connection,
    *,
    offset: int,
    limit: int,
    tier: str | None,
    prefix: str | None,
    after: str | None,
    contains: str | None = None,
    sort: str = "user",
) -> list[tuple[str, UserRecord]]:
    query = _filter(
        select(user_limits.c.user, *RECORD_COLUMNS), tier=tier, prefix=prefix, contains=contains
    )
    if after is not None:
        # Keyset paging: a seek into the index, as fast at user 900,000 as at the first.
        query = query.where(user_limits.c.user > after)
    column, descending = SORT_KEYS[sort]
    # NULLs (no tier, no override) last either way.
    key = column.desc().nulls_last() if descending else column.asc().nulls_last()
    order = (key,) if column is user_limits.c.user else (key, user_limits.c.user)
    rows = conn.execute(query.order_by(*order).offset(offset).limit(limit))
    return [(user, user_record(record)) for user, *record in rows]


def count_users(
    conn: Connection, *, tier: str | None, prefix: str | None, contains: str | None = None
) -> int:
    query = _filter(
        select(func.count()).select_from(user_limits), tier=tier, prefix=prefix, contains=contains
    )
    return int(conn.execute(query).scalar() or 0)
