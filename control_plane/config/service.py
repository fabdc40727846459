"""The rules of the config log. Every write of the configuration (limits, API keys)
takes the writers' lock first (`lock`), then, if it changes something, `commit`s its ops:
one new version, its change-log row and its audit entry, in the writer's transaction. So
versions are unique and gap-free under any concurrency, on both databases, and the log
replays version n-1 into n.

Readers: `current_version`, `changes_since` and `load_snapshot` (what engines are
pushed), and the follower (control_plane/config/follower.py) that keeps a limit model at
the newest version."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection

from control_plane.audit import service as audit
from control_plane.config import repository as repo
from control_plane.config.repository import Change, State, UserRecord
from control_plane.db import service
from output_rate_core import protocol as p
from output_rate_core.limits import LimitModel
from output_rate_core.policy import Policy


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


def tier_policies(conn: Connection) -> dict[str, Policy]:
    """tier -> its policy, every tier."""
    return repo.tier_policies(conn)


def user_records(conn: Connection, users: Sequence[str]) -> dict[str, UserRecord]:
    """The records of those of `users` who have one (any number of users)."""
    return repo.user_records(conn, users)


def load_model(conn: Connection, users: Sequence[str]) -> LimitModel:
    """The limit model of `users`: the default, every tier, and the records of those of
    them who have one."""
    records = repo.user_records(conn, users)
    return LimitModel(
        repo.get_config(conn).default,
        repo.tier_policies(conn),
        {user: (r.tier, r.policy) for user, r in records.items()},
    )


def effective_rates(conn: Connection, users: Sequence[str]) -> dict[str, int | None]:
    """Each user's effective rate (None: unlimited)."""
    model = load_model(conn, users)
    return {user: model.effective(user).rate for user in users}


def tiers_of(conn: Connection, users: Sequence[str]) -> dict[str, str | None]:
    """Each configured user's tier (None: no tier); unconfigured users are left out."""
    return {user: record.tier for user, record in repo.user_records(conn, users).items()}


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
    return p.Snapshot.of(
        state.version, state.default, repo.tier_policies(conn), repo.all_users(conn)
    )
