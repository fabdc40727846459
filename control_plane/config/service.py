"""The rules of the config log. Every write of the configuration (limits, API keys)
takes the writers' lock first (`lock`), then, if it changes something, `commit`s its ops:
one new version, its change-log row, its audit entry and the ops' limit changes on the
tables, in the writer's transaction. So versions are unique and gap-free under any
concurrency, on both databases, the log replays version n-1 into n, and the tables are
written from the very ops the log keeps.

Readers: `current_version`, `changes_since` and `load_snapshot` (what engines are
pushed), the follower (control_plane/config/follower.py) that keeps a limit model at the
newest version, and the reads of the configuration other domains resolve with
(`tier_policies`, `user_records`, `effective_rates`, `tiers_of`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from sqlalchemy import Connection

from control_plane.audit import service as audit
from control_plane.config import repository as repo
from control_plane.config.repository import Change, State, UserRecord
from control_plane.db import Commit, service
from output_rate_core import protocol as p
from output_rate_core.limits import Effective, LimitModel, UserPolicy
from output_rate_core.policy import Policy


def lock(conn: Connection) -> State:
    """Take the writers' lock, as the first statement of a write of the configuration, so
    that writers queue before they read what they change; the state to `commit` after."""
    return repo.lock_config(conn)


def commit(
    conn: Connection,
    state: State,
    ops: list[p.Op],
    entry: audit.Entry,
    *,
    model: LimitModel | None = None,
    descriptions: Mapping[str, str] | None = None,
) -> Commit:
    """The version after `state`, made of `ops`: the version bumped once, its change-log
    row, its audit entry, and the ops' limit changes written onto the tables, in the
    caller's transaction (which holds the lock `state` came from). Returned with its
    ops, for the push to engines (control_plane/push/log_reader.py sends them as they
    are when it has every version before).

    `model`: the limit model before the ops, holding every user and tier they name (what
    each had decides between insert and update, and the user counts); `descriptions`:
    tier -> the description its SetTier writes. API key ops change no limit table: the
    keys service writes their rows (a key's row holds what its op does not)."""
    version = state.version + 1
    num_new_users = 0
    if model is not None:
        num_new_users = _project(conn, version, ops, model, descriptions or {})
    else:
        assert all(isinstance(op, p.KeyOp) for op in ops), "limit ops need the model before"
    repo.bump_config(conn, version=version, new_users=num_new_users)
    repo.add_change(conn, version=version, ops=ops)
    audit.record(conn, version=version, entry=entry)
    return Commit(version, tuple(ops))


def _project(
    conn: Connection,
    version: int,
    ops: list[p.Op],
    model: LimitModel,
    descriptions: Mapping[str, str],
) -> int:
    """Write what `ops` make of `model` onto the tables, at most one statement per kind of
    row (a bulk change of 10,000 users is one insert and one update); the change in the
    number of configured users."""
    # user / tier -> what the ops leave of it (None: deleted)
    users: dict[str, UserPolicy | None] = {}
    tiers: dict[str, Policy | None] = {}
    for op in ops:
        if isinstance(op, p.SetUser):
            users[op.user] = (op.tier, op.policy)
        elif isinstance(op, p.DeleteUser):
            users[op.user] = None
        elif isinstance(op, p.SetTier):
            tiers[op.name] = op.policy
        elif isinstance(op, p.DeleteTier):
            tiers[op.name] = None
        elif isinstance(op, p.SetDefault):
            repo.set_default(conn, op.policy)
    # Tiers first: a user row may name a new tier.
    for name, policy in tiers.items():
        if policy is None:
            repo.delete_tier(conn, name)
            continue
        write = repo.update_tier if name in model.tiers else repo.insert_tier
        write(conn, name=name, policy=policy, description=descriptions[name], version=version)
    inserted = {u: r for u, r in users.items() if r is not None and u not in model.users}
    updated = {u: r for u, r in users.items() if r is not None and u in model.users}
    deleted = [u for u, r in users.items() if r is None and u in model.users]
    repo.insert_users(conn, inserted, version=version)
    repo.update_users(conn, updated, version=version)
    repo.delete_users(conn, deleted)
    # tier -> the change in its user count
    deltas: Counter[str] = Counter()
    for user, record in users.items():
        old_tier = model.tier_of(user)
        if old_tier is not None:
            deltas[old_tier] -= 1
        if record is not None and record[0] is not None:
            deltas[record[0]] += 1
    repo.add_tier_users(conn, deltas)
    return len(inserted) - len(deleted)


def state(conn: Connection) -> State:
    """The config row now, without the lock (reads)."""
    return repo.get_config(conn)


def tier_policies(conn: Connection, names: Collection[str] | None = None) -> dict[str, Policy]:
    """tier -> its policy: of every tier, or of those of `names` that exist."""
    return repo.tier_policies(conn, names)


def user_records(conn: Connection, users: Sequence[str]) -> dict[str, UserRecord]:
    """The records of those of `users` who have one (any number of users)."""
    return repo.user_records(conn, users)


def effective_rates(conn: Connection, users: Sequence[str]) -> dict[str, int | None]:
    """Each user's effective rate (None: unlimited)."""
    return {user: e.rate for user, e in effective_of(conn, users).items()}


def effective_of(conn: Connection, users: Sequence[str]) -> dict[str, Effective]:
    """What each user is held to, resolved in the limit model of the default, every tier
    and the records of these users."""
    records = repo.user_records(conn, users)
    model = LimitModel(
        repo.get_config(conn).default,
        repo.tier_policies(conn),
        {user: (r.tier, r.policy) for user, r in records.items()},
    )
    return {user: model.effective(user) for user in users}


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
    return p.Snapshot.of_rows(
        state.version, state.default, repo.tier_policies(conn), repo.all_user_rows(conn)
    )
