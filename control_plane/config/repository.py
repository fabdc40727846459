"""The config log's queries: the one `config_state` row (the writers' lock, the version,
the default, the user count), the `config_changes` rows, and the whole configuration as a
snapshot reads it. No rules here: the service decides, this module reads and writes rows.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, NamedTuple

import msgspec
from sqlalchemy import Connection, bindparam, insert, select, update

from control_plane.models import ConfigChange, ConfigState, Tier, UserLimit, table
from output_rate_core import protocol as p
from output_rate_core.limits import Enforcement, Scope

CONFIG_ROW_ID = 1

config_state = table(ConfigState)
config_changes = table(ConfigChange)
tiers = table(Tier)
user_limits = table(UserLimit)

# version -> its ops as config_changes stores them (the wire protocol's JSON)
Change = tuple[int, list[dict[str, Any]]]


class State(NamedTuple):
    version: int
    default_rate: int | None
    default_scope: Scope | None
    num_users: int
    default_enforcement: Enforcement | None = None


# The columns of State, in its order: other reads join them to theirs (one statement).
STATE_COLUMNS = (
    config_state.c.version,
    config_state.c.default_rate,
    config_state.c.default_scope,
    config_state.c.num_users,
    config_state.c.default_enforcement,
)


def state_of(row: Any) -> State:
    assert row is not None, "config_state row is created by the initial migration"
    return State._make(row)


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


# ---- the whole configuration, as a snapshot carries it ---------------------------


class TierLimit(NamedTuple):
    """What a tier gives its users: its rate (None: unlimited), its scope and enforcement
    (None: inherit)."""

    rate: int | None
    scope: Scope | None
    enforcement: Enforcement | None = None


def tier_limits(conn: Connection) -> dict[str, TierLimit]:
    rows = conn.execute(select(tiers.c.name, tiers.c.rate, tiers.c.scope, tiers.c.enforcement))
    return {name: TierLimit(rate, scope, mode) for name, rate, scope, mode in rows}


class AllUsers(NamedTuple):
    """Every configured user, as a snapshot carries them."""

    # user -> (tier, override rate)
    records: dict[str, tuple[str | None, int | None]]
    # user -> its own scope / enforcement (users that inherit are left out)
    scopes: dict[str, Scope]
    enforcements: dict[str, Enforcement]


def all_users(conn: Connection) -> AllUsers:
    columns = (
        user_limits.c.user,
        user_limits.c.tier,
        user_limits.c.rate,
        user_limits.c.scope,
        user_limits.c.enforcement,
    )
    records: dict[str, tuple[str | None, int | None]] = {}
    scopes: dict[str, Scope] = {}
    enforcements: dict[str, Enforcement] = {}
    for user, tier, rate, scope, enforcement in conn.execute(select(*columns)):
        records[user] = (tier, rate)
        if scope is not None:
            scopes[user] = scope
        if enforcement is not None:
            enforcements[user] = enforcement
    return AllUsers(records, scopes, enforcements)


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
