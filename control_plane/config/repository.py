"""The config log's queries: the one `config_state` row (the writers' lock, the version,
the default, the user count), the `config_changes` rows, the tiers' and users' limits as
the log reads them, and the statements a commit projects ops with. No rules here: the
service decides, this module reads and writes rows.

SQLAlchemy Core on a Connection: the hot statements are built once at import (their
compiled form is cached), and rows come back as tuples, not ORM objects.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

import msgspec
from sqlalchemy import Connection, bindparam, delete, insert, select, update

from control_plane.db import one_of
from control_plane.models import ConfigChange, ConfigState, Tier, UserLimit, table
from output_rate_core import protocol as p
from output_rate_core.limits import UserPolicy
from output_rate_core.policy import Policy

CONFIG_ROW_ID = 1

config_state = table(ConfigState)
config_changes = table(ConfigChange)
tiers = table(Tier)
user_limits = table(UserLimit)

# version -> its ops as config_changes stores them (the wire protocol's JSON)
Change = tuple[int, list[dict[str, Any]]]


class State(NamedTuple):
    """The config row: the version, the default's policy, the configured users."""

    version: int
    default: Policy
    num_users: int


# The columns `state_of` reads: other reads join them to theirs (one statement).
STATE_COLUMNS = (
    config_state.c.version,
    config_state.c.default_rate,
    config_state.c.default_scope,
    config_state.c.default_enforcement,
    config_state.c.default_ceiling,
    config_state.c.num_users,
)


def state_of(row: Any) -> State:
    assert row is not None, "config_state row is created by the initial migration"
    version, rate, scope, enforcement, ceiling, num_users = row
    return State(version, Policy(rate, scope, enforcement, ceiling), num_users)


_GET_STATE = select(*STATE_COLUMNS).where(config_state.c.id == CONFIG_ROW_ID)
# The no-op UPDATE is the first statement of every write transaction: on PostgreSQL it
# takes the config row's lock, so concurrent writers queue before they read anything
# they will change (SQLite writers already hold the lock from BEGIN IMMEDIATE).
_LOCK_STATE = (
    update(config_state)
    .where(config_state.c.id == CONFIG_ROW_ID)
    .values(version=config_state.c.version)
    .returning(*STATE_COLUMNS)
)
_BUMP_STATE = (
    update(config_state)
    .where(config_state.c.id == CONFIG_ROW_ID)
    .values(
        version=bindparam("new_version"),
        num_users=config_state.c.num_users + bindparam("new_users"),
        updated_at=bindparam("now"),
    )
)


def lock_config(conn: Connection) -> State:
    return state_of(conn.execute(_LOCK_STATE).one_or_none())


def get_config(conn: Connection) -> State:
    return state_of(conn.execute(_GET_STATE).one_or_none())


def bump_config(conn: Connection, *, version: int, new_users: int) -> None:
    conn.execute(
        _BUMP_STATE, {"new_version": version, "new_users": new_users, "now": datetime.now(UTC)}
    )


def set_default(conn: Connection, policy: Policy) -> None:
    conn.execute(
        update(config_state)
        .where(config_state.c.id == CONFIG_ROW_ID)
        .values(
            default_rate=policy.rate,
            default_scope=policy.scope,
            default_enforcement=policy.enforcement,
            default_ceiling=policy.ceiling,
        )
    )


# ---- the configuration: tiers and users ------------------------------------------


_TIER_POLICIES = select(
    tiers.c.name, tiers.c.rate, tiers.c.scope, tiers.c.enforcement, tiers.c.ceiling
)
_TIER_POLICY = _TIER_POLICIES.where(tiers.c.name == bindparam("name"))


def tier_policies(conn: Connection, names: Collection[str] | None = None) -> dict[str, Policy]:
    """tier -> its policy: of every tier, or of those of `names` that exist."""
    if names is None:
        rows = conn.execute(_TIER_POLICIES)
    elif len(names) == 1:  # the point query built once: a PUT of one user's hot path
        rows = conn.execute(_TIER_POLICY, {"name": next(iter(names))})
    elif names:
        rows = conn.execute(_TIER_POLICIES.where(tiers.c.name.in_(list(names))))
    else:
        return {}
    return {name: Policy(*policy) for name, *policy in rows}


class UserRecord(NamedTuple):
    """A configured user's row: its tier (None: none), its own policy, the version of its
    last change."""

    tier: str | None
    policy: Policy
    version: int


# The columns `user_record` reads, in its order.
RECORD_COLUMNS = (
    user_limits.c.tier,
    user_limits.c.rate,
    user_limits.c.scope,
    user_limits.c.enforcement,
    user_limits.c.ceiling,
    user_limits.c.version,
)


def user_record(row: Any) -> UserRecord:
    tier, rate, scope, enforcement, ceiling, version = row
    return UserRecord(tier, Policy(rate, scope, enforcement, ceiling), version)


_GET_USER = select(*RECORD_COLUMNS).where(user_limits.c.user == bindparam("user"))
# Ids per statement: SQLite binds at most 32,766 parameters; PostgreSQL gets one array.
_IDS_PER_STATEMENT = 10_000


def user_records(conn: Connection, users: Sequence[str]) -> dict[str, UserRecord]:
    """The records of those of `users` who have one (a statement per 10,000 ids)."""
    if len(users) == 1:  # the point query built once: a PUT of one user's hot path
        row = conn.execute(_GET_USER, {"user": users[0]}).one_or_none()
        return {} if row is None else {users[0]: user_record(row)}
    found: dict[str, UserRecord] = {}
    for start in range(0, len(users), _IDS_PER_STATEMENT):
        chunk = list(users[start : start + _IDS_PER_STATEMENT])
        query = select(user_limits.c.user, *RECORD_COLUMNS).where(
            one_of(conn, user_limits.c.user, chunk)
        )
        for user, *record in conn.execute(query):
            found[user] = user_record(record)
    return found


def all_user_rows(conn: Connection) -> Iterable[p.UserRow]:
    """Every configured user's row, its policy flat (what a snapshot is built from)."""
    columns = (
        user_limits.c.user,
        user_limits.c.tier,
        user_limits.c.rate,
        user_limits.c.scope,
        user_limits.c.enforcement,
        user_limits.c.ceiling,
    )
    return conn.execute(select(*columns)).tuples()


# ---- what a commit writes: the ops projected onto the tables --------------------

_INSERT_USER = insert(user_limits)
_UPDATE_USER = (
    update(user_limits)
    .where(user_limits.c.user == bindparam("user_id"))
    .values(
        tier=bindparam("tier"),
        rate=bindparam("rate"),
        scope=bindparam("scope"),
        enforcement=bindparam("enforcement"),
        ceiling=bindparam("ceiling"),
        version=bindparam("version"),
        updated_at=bindparam("updated_at"),
    )
)
_DELETE_USER = delete(user_limits).where(user_limits.c.user == bindparam("user_id"))
_ADD_TIER_USERS = (
    update(tiers)
    .where(tiers.c.name == bindparam("tier_name"))
    .values(num_users=tiers.c.num_users + bindparam("delta"))
)


def insert_users(conn: Connection, records: Mapping[str, UserPolicy], *, version: int) -> None:
    _write_users(conn, _INSERT_USER, records, version=version, user_key="user")


def update_users(conn: Connection, records: Mapping[str, UserPolicy], *, version: int) -> None:
    _write_users(conn, _UPDATE_USER, records, version=version, user_key="user_id")


def _write_users(
    conn: Connection,
    statement: Any,
    records: Mapping[str, UserPolicy],
    *,
    version: int,
    user_key: str,
) -> None:
    """One executemany; `user_key` is the statement's parameter for the user id."""
    now = datetime.now(UTC)
    params = [
        {
            user_key: user,
            "tier": tier,
            "rate": policy.rate,
            "scope": policy.scope,
            "enforcement": policy.enforcement,
            "ceiling": policy.ceiling,
            "version": version,
            "updated_at": now,
        }
        for user, (tier, policy) in records.items()
    ]
    if params:
        conn.execute(statement, params)


def delete_users(conn: Connection, users: Iterable[str]) -> None:
    params = [{"user_id": user} for user in users]
    if params:
        conn.execute(_DELETE_USER, params)


def add_tier_users(conn: Connection, deltas: Mapping[str, int]) -> None:
    """Move each tier's maintained user count by its delta."""
    params = [{"tier_name": name, "delta": delta} for name, delta in deltas.items() if delta]
    if params:
        conn.execute(_ADD_TIER_USERS, params)


def insert_tier(
    conn: Connection, *, name: str, policy: Policy, description: str, version: int
) -> None:
    conn.execute(
        insert(tiers).values(
            name=name,
            rate=policy.rate,
            scope=policy.scope,
            enforcement=policy.enforcement,
            ceiling=policy.ceiling,
            description=description,
            version=version,
            num_users=0,
            updated_at=datetime.now(UTC),
        )
    )


def update_tier(
    conn: Connection, *, name: str, policy: Policy, description: str, version: int
) -> None:
    conn.execute(
        update(tiers)
        .where(tiers.c.name == name)
        .values(
            rate=policy.rate,
            scope=policy.scope,
            enforcement=policy.enforcement,
            ceiling=policy.ceiling,
            description=description,
            version=version,
            updated_at=datetime.now(UTC),
        )
    )


def delete_tier(conn: Connection, name: str) -> None:
    conn.execute(delete(tiers).where(tiers.c.name == name))


# ---- the change log ----------------------------------------------------------------

_INSERT_CHANGE = insert(config_changes)


def add_change(conn: Connection, *, version: int, ops: list[p.Op]) -> None:
    """The change-log row of ``version``: its ops as the wire protocol's JSON."""
    rows = msgspec.to_builtins(ops)
    conn.execute(_INSERT_CHANGE, {"version": version, "ops": rows, "at": datetime.now(UTC)})


def changes_since(conn: Connection, version: int) -> list[Change]:
    query = (
        select(config_changes.c.version, config_changes.c.ops)
        .where(config_changes.c.version > version)
        .order_by(config_changes.c.version)
    )
    return [(v, ops) for v, ops in conn.execute(query)]
