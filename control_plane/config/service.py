"""The rules of the config log. Every write of the configuration (limits, API keys)
takes the writers' lock first (`lock`), then, if it changes something, `commit`s its ops:
one new version, its change-log row and its audit entry, in the writer's transaction. So
versions are unique and gap-free under any concurrency, on both databases, and the log
replays version n-1 into n.

Readers: `current_version`, `changes_since` and `load_snapshot` (what engines are
pushed), and the follower (control_plane/config/follower.py) that keeps a limit model at
the newest version."""

from __future__ import annotations

from sqlalchemy import Connection

from control_plane.audit import service as audit
from control_plane.config import repository as repo
from control_plane.config.repository import Change, State, TierLimit
from control_plane.db import service
from output_rate_core import protocol as p


def lock(conn: Connection) -> State:
    """Take the writers' lock, as the first statement of a write of the configuration, so
    that writers queue before they read what they change; the state to `commit` after."""
    return repo.lock_config(conn)


def commit(
    conn: Connection, state: State, ops: list[p.Op], entry: audit.Entry, *, new_users: int = 0
) -> int:
    """The version after `state`, made of `ops`: the version bumped once (and the user
    count by `new_users`), its change-log row and its audit entry, in the caller's
    transaction (which holds the lock `state` came from)."""
    version = state.version + 1
    repo.bump_config(conn, version=version, new_users=new_users)
    repo.add_change(conn, version=version, ops=ops)
    audit.record(conn, version=version, entry=entry)
    return version


def state(conn: Connection) -> State:
    """The config row now, without the lock (reads)."""
    return repo.get_config(conn)


def tier_limits(conn: Connection) -> dict[str, TierLimit]:
    """Every tier's limit."""
    return repo.tier_limits(conn)


@service("read")
def current_version(conn: Connection) -> int:
    return repo.get_config(conn).version


@service("read")
def changes_since(conn: Connection, version: int) -> list[Change]:
    """The log after `version`, in version order (empty: nothing newer)."""
    return repo.changes_since(conn, version)


@service("read")
def load_snapshot(conn: Connection) -> p.Snapshot:
    """Version, default, tiers and users as of one instant, as engines receive them.

    PostgreSQL runs the reads in one REPEATABLE READ transaction (so a concurrent write
    is wholly in the snapshot or wholly after its version); one SQLite read transaction
    already sees a single snapshot. Give it a connection whose transaction has not begun.
    """
    if not conn.in_transaction() and conn.dialect.name == "postgresql":
        conn.execution_options(isolation_level="REPEATABLE READ")
    state = repo.get_config(conn)
    tier_limits = repo.tier_limits(conn)
    users = repo.all_users(conn)
    return p.Snapshot(
        version=state.version,
        default_rate=state.default_rate,
        tiers={name: tier.rate for name, tier in tier_limits.items()},
        users=users.records,
        default_scope=state.default_scope,
        tier_scopes={name: t.scope for name, t in tier_limits.items() if t.scope is not None},
        user_scopes=users.scopes,
        default_enforcement=state.default_enforcement,
        tier_enforcements={
            name: t.enforcement for name, t in tier_limits.items() if t.enforcement is not None
        },
        user_enforcements=users.enforcements,
    )
