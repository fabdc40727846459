"""The rules of the limit model. Every write bumps the config version once, in the same
transaction as the change, its audit entry and its change-log row; a write that changes
nothing writes nothing. A write of the configuration returns a `ConfigChange`: its view
and the version it made.

Each function takes the Connection of one transaction (control_plane.db.Database runs
it where its `@service` policy says); the caller commits."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from control_plane.audit import service as audit
from control_plane.db import ConfigChange, service
from control_plane.errors import Conflict, InvalidInput, NotFound
from control_plane.limits import repository as repo
from control_plane.limits.repository import State, UserRecord
from control_plane.limits.schemas import (
    MAX_BULK_ITEMS,
    BulkOut,
    DefaultOut,
    LimitOut,
    LimitPage,
    TierList,
    TierOut,
)
from output_rate_core import protocol as p
from output_rate_core.limits import effective_rate


@dataclass(frozen=True)
class UserCounts:
    """The config version and default, and the configured users (maintained counters)."""

    version: int
    default_rate: int | None
    num_users: int
    # tier -> users assigned to it
    num_users_per_tier: dict[str, int]


# ---- views -----------------------------------------------------------------


def limit_view(
    *,
    user: str,
    record: UserRecord | None,
    tier_rate: int | None,
    state_version: int,
    default_rate: int | None,
) -> LimitOut:
    """`tier_rate` is the rate of the record's tier (ignored without one)."""
    tier = record.tier if record else None
    override = record.rate if record else None
    effective, source = effective_rate(override, tier, tier_rate, default_rate)
    return LimitOut(
        user=user,
        tier=tier,
        output_tokens_per_second=override,
        effective_output_tokens_per_second=effective,
        source=source,
        # The version of the user's last change (the current one for users
        # nobody configured): once engines applied it, this view is enforced.
        version=record.version if record else state_version,
    )


def tier_view(tier: repo.TierRow) -> TierOut:
    return TierOut(
        name=tier.name,
        output_tokens_per_second=tier.rate,
        description=tier.description,
        num_users=tier.num_users,
        version=tier.version,
    )


def _user_record(record: UserRecord | None) -> dict[str, Any] | None:
    """A user's record as the audit log and the merge patch see it."""
    return (
        None if record is None else {"tier": record.tier, "output_tokens_per_second": record.rate}
    )


# ---- reads -----------------------------------------------------------------


@service("read")
def get_limit(conn: Connection, *, user: str) -> LimitOut:
    row = repo.get_limit_row(conn, user)
    record = None if row.user_version is None else UserRecord(row.tier, row.rate, row.user_version)
    return limit_view(
        user=user,
        record=record,
        tier_rate=row.tier_rate,
        state_version=row.version,
        default_rate=row.default_rate,
    )


@service("scan")
def list_limits(
    conn: Connection,
    *,
    offset: int,
    limit: int,
    tier: str | None,
    prefix: str | None,
    after: str | None = None,
    contains: str | None = None,
    sort: str = "user",
) -> LimitPage:
    """A page of configured users in user-id order. `total` counts every user that
    matches `tier` and `prefix` (the cursor `after` and `offset` only move the page)."""
    state = repo.get_config(conn)
    if after is not None and sort != "user":
        raise InvalidInput(
            "after: only with sort=user (use offset with other sorts)", field="after"
        )
    rows = repo.list_users(
        conn,
        offset=offset,
        limit=limit,
        tier=tier,
        prefix=prefix,
        after=after,
        contains=contains,
        sort=sort,
    )
    # Totals come from maintained counters; only a user-id filter needs a count.
    if prefix or contains:
        total = repo.count_users(conn, tier=tier, prefix=prefix, contains=contains)
    elif tier is not None:
        tier_row = repo.get_tier(conn, tier)
        total = tier_row.num_users if tier_row else 0
    else:
        total = state.num_users
    rates = repo.tier_rates(conn)
    items = [
        limit_view(
            user=user,
            record=record,
            tier_rate=rates.get(record.tier) if record.tier else None,
            state_version=state.version,
            default_rate=state.default_rate,
        )
        for user, record in rows
    ]
    return LimitPage(items=items, total=total)


def effective_rates(conn: Connection, users: Sequence[str]) -> dict[str, int | None]:
    """Each user's effective rate (None: unlimited)."""
    state = repo.get_config(conn)
    rates = repo.tier_rates(conn)
    records = repo.get_users(conn, users)
    result: dict[str, int | None] = {}
    for user in users:
        record = records.get(user)
        if record is None:
            result[user] = state.default_rate
        else:
            tier_rate = rates.get(record.tier) if record.tier else None
            result[user] = effective_rate(record.rate, record.tier, tier_rate, state.default_rate)[
                0
            ]
    return result


def tiers_of(conn: Connection, users: Sequence[str]) -> dict[str, str | None]:
    """Each configured user's tier (None: no tier); unconfigured users are left out."""
    return {user: record.tier for user, record in repo.get_users(conn, users).items()}


def user_counts(conn: Connection) -> UserCounts:
    state = repo.get_config(conn)
    return UserCounts(
        version=state.version,
        default_rate=state.default_rate,
        num_users=state.num_users,
        num_users_per_tier={tier.name: tier.num_users for tier in repo.list_tiers(conn)},
    )


@service("read")
def list_tiers(conn: Connection) -> TierList:
    return TierList(items=[tier_view(t) for t in repo.list_tiers(conn)])


@service("read")
def get_tier(conn: Connection, *, name: str) -> TierOut:
    tier = repo.get_tier(conn, name)
    if tier is None:
        raise NotFound(f"tier {name!r} does not exist", field="name")
    return tier_view(tier)


@service("read")
def get_default(conn: Connection) -> DefaultOut:
    state = repo.get_config(conn)
    return DefaultOut(output_tokens_per_second=state.default_rate, version=state.version)


@service("read")
def current_version(conn: Connection) -> int:
    return repo.get_config(conn).version


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
    return p.Snapshot(
        version=state.version,
        default_rate=state.default_rate,
        tiers=repo.tier_rates(conn),
        users=repo.all_user_records(conn),
    )


@service("read")
def load_changes_since(conn: Connection, version: int) -> list[tuple[int, list[dict[str, Any]]]]:
    return repo.changes_since(conn, version)


# ---- writes ----------------------------------------------------------------


def _record(
    conn: Connection,
    state: State,
    *,
    actor: str,
    action: str,
    target: str,
    before: Any,
    after: Any,
    ops: list[p.Op],
    new_users: int = 0,
) -> int:
    """The new version: bumped once, with its change-log row and its audit entry."""
    version = state.version + 1
    repo.bump_config(conn, version=version, new_users=new_users)
    repo.add_change(conn, version=version, ops=ops)
    audit.record(
        conn,
        version=version,
        actor=actor,
        action=action,
        target=target,
        before=before,
        after=after,
    )
    return version


def _tier_rate(conn: Connection, tier: str | None, *, field: str = "tier") -> int | None:
    """The rate of `tier` (None for no tier); an unknown tier is bad input."""
    if tier is None:
        return None
    row = repo.get_tier(conn, tier)
    if row is None:
        raise InvalidInput(f"{field}: unknown tier {tier!r}", field=field)
    return row.rate


def _tier_deltas(changes: Iterable[tuple[UserRecord | None, str | None]]) -> dict[str, int]:
    """tier -> change in its user count, for (old record, new tier) pairs."""
    deltas: Counter[str] = Counter()
    for old, new_tier in changes:
        if old is not None and old.tier is not None:
            deltas[old.tier] -= 1
        if new_tier is not None:
            deltas[new_tier] += 1
    return dict(deltas)


@service("write")
def put_limit(
    conn: Connection, *, actor: str, user: str, rate: int | None, tier: str | None
) -> ConfigChange[LimitOut]:
    state = repo.lock_config(conn)
    tier_rate = _tier_rate(conn, tier)
    record = repo.get_user(conn, user)
    return _set_user(
        conn,
        state,
        actor=actor,
        action="put_limit",
        user=user,
        record=record,
        rate=rate,
        tier=tier,
        tier_rate=tier_rate,
    )


@service("write")
def patch_limit(
    conn: Connection, *, actor: str, user: str, changes: dict[str, Any]
) -> ConfigChange[LimitOut]:
    """JSON merge patch of a user's record: only the keys in `changes`
    ("output_tokens_per_second", "tier") change; the others keep their value.
    A patch that changes nothing writes nothing (an unknown user stays unconfigured)."""
    state = repo.lock_config(conn)
    record = repo.get_user(conn, user)
    current = _user_record(record) or {"tier": None, "output_tokens_per_second": None}
    merged = {**current, **changes}
    tier = merged["tier"]
    tier_rate = _tier_rate(conn, tier)
    if record is None and merged == current:
        view = limit_view(
            user=user,
            record=None,
            tier_rate=None,
            state_version=state.version,
            default_rate=state.default_rate,
        )
        return ConfigChange(view, None)
    return _set_user(
        conn,
        state,
        actor=actor,
        action="patch_limit",
        user=user,
        record=record,
        rate=merged["output_tokens_per_second"],
        tier=tier,
        tier_rate=tier_rate,
    )


def _set_user(
    conn: Connection,
    state: State,
    *,
    actor: str,
    action: str,
    user: str,
    record: UserRecord | None,
    rate: int | None,
    tier: str | None,
    tier_rate: int | None,
) -> ConfigChange[LimitOut]:
    """Write the user's new record (if it differs) as one version; return its view."""
    before = _user_record(record)
    after = {"tier": tier, "output_tokens_per_second": rate}
    version = None
    if before != after:
        version = _record(
            conn,
            state,
            actor=actor,
            action=action,
            target=user,
            before=before,
            after=after,
            ops=[p.SetUser(user=user, tier=tier, rate=rate)],
            new_users=0 if record else 1,
        )
        new_record = UserRecord(tier, rate, version)
        if record is None:
            repo.insert_users(conn, [(user, new_record)])
        else:
            repo.update_users(conn, [(user, new_record)])
        repo.add_tier_users(conn, _tier_deltas([(record, tier)]))
        record, state = new_record, state._replace(version=version)
    view = limit_view(
        user=user,
        record=record,
        tier_rate=tier_rate,
        state_version=state.version,
        default_rate=state.default_rate,
    )
    return ConfigChange(view, version)


@service("write")
def delete_limit(conn: Connection, *, actor: str, user: str) -> ConfigChange[None]:
    state = repo.lock_config(conn)
    record = repo.get_user(conn, user)
    if record is None:
        return ConfigChange(None, None)
    version = _record(
        conn,
        state,
        actor=actor,
        action="delete_limit",
        target=user,
        before=_user_record(record),
        after=None,
        ops=[p.DeleteUser(user=user)],
        new_users=-1,
    )
    repo.delete_user(conn, user)
    repo.add_tier_users(conn, _tier_deltas([(record, None)]))
    return ConfigChange(None, version)


@service("write_batch")
def bulk_put_limits(
    conn: Connection, *, actor: str, items: Sequence[tuple[str, int | None, str | None]]
) -> ConfigChange[BulkOut]:
    """Apply up to MAX_BULK_ITEMS (user, rate, tier) records as one version."""
    if len(items) > MAX_BULK_ITEMS:
        raise InvalidInput(f"items: at most {MAX_BULK_ITEMS} per request", field="items")
    users = [user for user, _, _ in items]
    first_index: dict[str, int] = {}
    for index, user in enumerate(users):
        if user in first_index:
            raise InvalidInput(
                f"items.{index}.user: user {user!r} already appears at items.{first_index[user]}",
                field=f"items.{index}.user",
            )
        first_index[user] = index
    state = repo.lock_config(conn)
    known_tiers = repo.tier_rates(conn)
    for index, (_, _, tier) in enumerate(items):
        if tier is not None and tier not in known_tiers:
            raise InvalidInput(
                f"items.{index}.tier: unknown tier {tier!r}", field=f"items.{index}.tier"
            )
    existing = repo.get_users(conn, users)
    changed = [
        (user, rate, tier)
        for user, rate, tier in items
        if _user_record(existing.get(user)) != {"tier": tier, "output_tokens_per_second": rate}
    ]
    if not changed:
        return ConfigChange(BulkOut(version=state.version, num_changed=0), None)
    num_new = sum(1 for user, _, _ in changed if user not in existing)
    version = _record(
        conn,
        state,
        actor=actor,
        action="bulk_put_limits",
        target=f"{len(changed)} users",
        # One entry for one version, with every changed user's record before and after.
        before={u: _user_record(existing.get(u)) for u, _, _ in changed},
        after={u: {"tier": t, "output_tokens_per_second": r} for u, r, t in changed},
        ops=[p.SetUser(user=u, tier=t, rate=r) for u, r, t in changed],
        new_users=num_new,
    )
    repo.insert_users(
        conn,
        [(u, UserRecord(t, r, version)) for u, r, t in changed if u not in existing],
    )
    repo.update_users(
        conn,
        [(u, UserRecord(t, r, version)) for u, r, t in changed if u in existing],
    )
    repo.add_tier_users(conn, _tier_deltas((existing.get(u), t) for u, _, t in changed))
    return ConfigChange(BulkOut(version=version, num_changed=len(changed)), version)


@service("write")
def put_tier(
    conn: Connection, *, actor: str, name: str, rate: int | None, description: str | None
) -> ConfigChange[TierOut]:
    state = repo.lock_config(conn)
    tier = repo.get_tier(conn, name)
    new_description = description if description is not None else (tier.description if tier else "")
    return _set_tier(
        conn,
        state,
        actor=actor,
        action="put_tier",
        name=name,
        tier=tier,
        rate=rate,
        description=new_description,
    )


@service("write")
def patch_tier(
    conn: Connection, *, actor: str, name: str, changes: dict[str, Any]
) -> ConfigChange[TierOut]:
    """JSON merge patch of an existing tier: only the keys in `changes`
    ("output_tokens_per_second", "description") change. A description of null is empty.
    An unknown tier is 404: a patch never creates one (its rate would be a guess)."""
    state = repo.lock_config(conn)
    tier = repo.get_tier(conn, name)
    if tier is None:
        raise NotFound(f"tier {name!r} does not exist", field="name")
    rate = changes.get("output_tokens_per_second", tier.rate)
    description = changes.get("description", tier.description)
    return _set_tier(
        conn,
        state,
        actor=actor,
        action="patch_tier",
        name=name,
        tier=tier,
        rate=rate,
        description=description if description is not None else "",
    )


def _set_tier(
    conn: Connection,
    state: State,
    *,
    actor: str,
    action: str,
    name: str,
    tier: repo.TierRow | None,
    rate: int | None,
    description: str,
) -> ConfigChange[TierOut]:
    """Write the tier's new rate and description (if they differ) as one version."""
    before = (
        None
        if tier is None
        else {"output_tokens_per_second": tier.rate, "description": tier.description}
    )
    after = {"output_tokens_per_second": rate, "description": description}
    if before == after:
        assert tier is not None
        return ConfigChange(tier_view(tier), None)
    version = _record(
        conn,
        state,
        actor=actor,
        action=action,
        target=name,
        before=before,
        after=after,
        ops=[p.SetTier(name=name, rate=rate)],
    )
    if tier is None:
        repo.insert_tier(conn, name=name, rate=rate, description=description, version=version)
        tier = repo.TierRow(name, rate, description, version, 0)
    else:
        repo.update_tier(conn, name=name, rate=rate, description=description, version=version)
        tier = tier._replace(rate=rate, description=description, version=version)
    return ConfigChange(tier_view(tier), version)


@service("write")
def delete_tier(conn: Connection, *, actor: str, name: str) -> ConfigChange[None]:
    state = repo.lock_config(conn)
    tier = repo.get_tier(conn, name)
    if tier is None:
        raise NotFound(f"tier {name!r} does not exist", field="name")
    # The EXISTS (one index probe) guards against the counter ever drifting.
    if tier.num_users or repo.tier_has_users(conn, name):
        raise Conflict(f"tier {name!r} still has {tier.num_users} users assigned", field="name")
    version = _record(
        conn,
        state,
        actor=actor,
        action="delete_tier",
        target=name,
        before={"output_tokens_per_second": tier.rate, "description": tier.description},
        after=None,
        ops=[p.DeleteTier(name=name)],
    )
    repo.delete_tier(conn, name)
    return ConfigChange(None, version)


@service("write")
def put_default(conn: Connection, *, actor: str, rate: int | None) -> ConfigChange[DefaultOut]:
    state = repo.lock_config(conn)
    if state.default_rate == rate:
        return ConfigChange(DefaultOut(output_tokens_per_second=rate, version=state.version), None)
    version = _record(
        conn,
        state,
        actor=actor,
        action="put_default",
        target="default",
        before={"output_tokens_per_second": state.default_rate},
        after={"output_tokens_per_second": rate},
        ops=[p.SetDefault(rate=rate)],
    )
    repo.set_default_rate(conn, rate)
    return ConfigChange(DefaultOut(output_tokens_per_second=rate, version=version), version)
