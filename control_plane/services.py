"""The rules of the limit model. Every write bumps the config version once, in
the same transaction as the change, its audit entry and its change-log row;
a write that changes nothing writes nothing. A write of the configuration returns
a `ConfigChange`: its view and the version it made.

Each function takes the Connection of one transaction (control_plane.db.Database runs
it); the caller commits."""

from __future__ import annotations

import hashlib
import json
import secrets
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection

from control_plane import repository as repo
from control_plane.db import ConfigChange
from control_plane.errors import Conflict, InvalidInput, NotFound
from control_plane.repository import State, UserRecord
from output_rate_core import protocol as p
from output_rate_core.limits import effective_rate

MAX_BULK_ITEMS = 10_000
# GET /audit: a page is at most about this big; larger before/after are paged apart.
MAX_AUDIT_PAGE_BYTES = 1024 * 1024
MAX_AUDIT_INLINE_BYTES = 64 * 1024


@dataclass(frozen=True)
class EngineSeen:
    """An engine the push endpoint heard from."""

    engine_id: str
    model: str
    applied_version: int
    first_seen: datetime


# ---- views -----------------------------------------------------------------


def limit_view(
    *,
    user: str,
    record: UserRecord | None,
    tier_rate: int | None,
    state_version: int,
    default_rate: int | None,
) -> dict[str, Any]:
    """`tier_rate` is the rate of the record's tier (ignored without one)."""
    tier = record.tier if record else None
    override = record.rate if record else None
    effective, source = effective_rate(override, tier, tier_rate, default_rate)
    return {
        "user": user,
        "tier": tier,
        "output_tokens_per_second": override,
        "effective_output_tokens_per_second": effective,
        "source": source,
        # The version of the user's last change (the current one for users
        # nobody configured): once engines applied it, this view is enforced.
        "version": record.version if record else state_version,
    }


def tier_view(tier: repo.TierRow) -> dict[str, Any]:
    return {
        "name": tier.name,
        "output_tokens_per_second": tier.rate,
        "description": tier.description,
        "num_users": tier.num_users,
        "version": tier.version,
    }


def _user_record(record: UserRecord | None) -> dict[str, Any] | None:
    return (
        None if record is None else {"tier": record.tier, "output_tokens_per_second": record.rate}
    )


# ---- reads -----------------------------------------------------------------


def get_limit(conn: Connection, *, user: str) -> dict[str, Any]:
    row = repo.get_limit_row(conn, user)
    record = None if row.user_version is None else UserRecord(row.tier, row.rate, row.user_version)
    return limit_view(
        user=user,
        record=record,
        tier_rate=row.tier_rate,
        state_version=row.version,
        default_rate=row.default_rate,
    )


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
) -> dict[str, Any]:
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
    return {"items": items, "total": total}


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


def list_tiers(conn: Connection) -> list[dict[str, Any]]:
    return [tier_view(t) for t in repo.list_tiers(conn)]


def get_tier(conn: Connection, *, name: str) -> dict[str, Any]:
    tier = repo.get_tier(conn, name)
    if tier is None:
        raise NotFound(f"tier {name!r} does not exist", field="name")
    return tier_view(tier)


def get_default(conn: Connection) -> dict[str, Any]:
    state = repo.get_config(conn)
    return {"output_tokens_per_second": state.default_rate, "version": state.version}


def current_version(conn: Connection) -> int:
    return repo.get_config(conn).version


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
    repo.add_audit(
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


def put_limit(
    conn: Connection, *, actor: str, user: str, rate: int | None, tier: str | None
) -> ConfigChange[dict[str, Any]]:
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


def patch_limit(
    conn: Connection, *, actor: str, user: str, changes: dict[str, Any]
) -> ConfigChange[dict[str, Any]]:
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
) -> ConfigChange[dict[str, Any]]:
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


def bulk_put_limits(
    conn: Connection, *, actor: str, items: Sequence[tuple[str, int | None, str | None]]
) -> ConfigChange[dict[str, Any]]:
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
        return ConfigChange({"version": state.version, "num_changed": 0}, None)
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
    return ConfigChange({"version": version, "num_changed": len(changed)}, version)


def put_tier(
    conn: Connection, *, actor: str, name: str, rate: int | None, description: str | None
) -> ConfigChange[dict[str, Any]]:
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


def patch_tier(
    conn: Connection, *, actor: str, name: str, changes: dict[str, Any]
) -> ConfigChange[dict[str, Any]]:
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
) -> ConfigChange[dict[str, Any]]:
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


def put_default(conn: Connection, *, actor: str, rate: int | None) -> ConfigChange[dict[str, Any]]:
    state = repo.lock_config(conn)
    if state.default_rate == rate:
        return ConfigChange({"output_tokens_per_second": rate, "version": state.version}, None)
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
    return ConfigChange({"output_tokens_per_second": rate, "version": version}, version)


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")))


def list_audit(
    conn: Connection, *, limit: int, before_id: int | None = None, target: str | None = None
) -> dict[str, Any]:
    """Newest first, at most `limit` entries and about MAX_AUDIT_PAGE_BYTES (at least one
    entry), optionally only those about `target`. An entry whose before/after are over
    MAX_AUDIT_INLINE_BYTES (a large bulk change) comes with `truncated: true` and null
    before/after: read them page by page with `audit_changes`. `next_before_id` continues
    the listing (null: the end)."""
    items: list[dict[str, Any]] = []
    size = 0
    rows = repo.list_audit(conn, limit=limit, before_id=before_id, target=target)
    for e in rows:
        entry_size = _json_size(e.before) + _json_size(e.after)
        truncated = entry_size > MAX_AUDIT_INLINE_BYTES
        if items and size + min(entry_size, MAX_AUDIT_INLINE_BYTES) > MAX_AUDIT_PAGE_BYTES:
            break
        size += min(entry_size, MAX_AUDIT_INLINE_BYTES)
        items.append(
            {
                "id": e.id,
                "at": e.at.isoformat(),
                "version": e.version,
                "actor": e.actor,
                "action": e.action,
                "target": e.target,
                "before": None if truncated else e.before,
                "after": None if truncated else e.after,
                "truncated": truncated,
            }
        )
    more = len(items) < len(rows) or len(rows) == limit
    return {"items": items, "next_before_id": items[-1]["id"] if items and more else None}


def audit_changes(
    conn: Connection, *, entry_id: int, after: str | None, limit: int
) -> dict[str, Any]:
    """One audit entry's before/after, per target, in target order, a page at a time.

    A bulk entry's before/after map each user to its record; any other entry is one
    item for its target. `next_after` continues (null: the end)."""
    e = repo.get_audit(conn, entry_id)
    if e is None:
        raise NotFound(f"audit entry {entry_id} does not exist", field="entry_id")
    if e.action == "bulk_put_limits" and isinstance(e.after, dict):
        before = e.before if isinstance(e.before, dict) else {}
        targets = sorted(set(before) | set(e.after))
        changes = [(t, before.get(t), e.after.get(t)) for t in targets]
    else:
        changes = [(e.target, e.before, e.after)]
    if after is not None:
        changes = [c for c in changes if c[0] > after]
    page = changes[:limit]
    return {
        "id": e.id,
        "version": e.version,
        "action": e.action,
        "items": [{"target": t, "before": b, "after": a} for t, b, a in page],
        "next_after": page[-1][0] if len(changes) > limit else None,
    }


# ---- tokens ----------------------------------------------------------------


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _audit_token(conn: Connection, *, actor: str, action: str, token_id: int, name: str) -> None:
    """Tokens are not limit configuration: audited, but the version does not move."""
    repo.add_audit(
        conn,
        version=repo.get_config(conn).version,
        actor=actor,
        action=action,
        target=f"token:{token_id}",
        before=None if action == "create_token" else {"name": name, "revoked": False},
        after={"name": name, "revoked": action == "revoke_token"},
    )


def create_viewer_token(conn: Connection, *, actor: str, name: str) -> dict[str, Any]:
    token = "orv_" + secrets.token_urlsafe(32)
    token_id = repo.insert_viewer_token(conn, name=name, token_hash=hash_token(token))
    _audit_token(conn, actor=actor, action="create_token", token_id=token_id, name=name)
    return {"id": token_id, "name": name, "token": token}


def list_viewer_tokens(conn: Connection) -> list[dict[str, Any]]:
    return [
        {
            "id": t.id,
            "name": t.name,
            "created_at": t.created_at.isoformat(),
            "revoked": t.revoked_at is not None,
        }
        for t in repo.list_viewer_tokens(conn)
    ]


def revoke_viewer_token(conn: Connection, *, actor: str, token_id: int) -> None:
    """Idempotent: revoking a revoked token changes nothing."""
    row = repo.get_viewer_token(conn, token_id)
    if row is None:
        raise NotFound(f"token {token_id} does not exist", field="token_id")
    if row.revoked_at is None:
        repo.revoke_viewer_token(conn, token_id)
        _audit_token(conn, actor=actor, action="revoke_token", token_id=token_id, name=row.name)


def viewer_token_name(conn: Connection, *, token: str) -> str | None:
    return repo.find_viewer_token(conn, hash_token(token))


# ---- engines ---------------------------------------------------------------


def list_engines(
    conn: Connection, *, timeout_s: float, retention_s: float = float("inf")
) -> dict[str, Any]:
    """Engines seen within `retention_s` (older rows are deleted by the push server)."""
    now = datetime.now(UTC)
    items = [
        {
            "engine_id": e.engine_id,
            "model": e.model,
            "applied_version": e.applied_version,
            "connected": e.connected and (now - e.last_seen).total_seconds() <= timeout_s,
            "last_seen": e.last_seen.isoformat(),
            "first_seen": e.first_seen.isoformat(),
        }
        for e in repo.list_engines(conn)
        if (now - e.last_seen).total_seconds() <= retention_s
    ]
    return {"version": current_version(conn), "items": items}


def forget_engines(conn: Connection, *, retention_s: float) -> int:
    """Delete the rows of engines not seen for `retention_s`; how many went."""
    return repo.delete_engines_seen_before(conn, datetime.now(UTC) - timedelta(seconds=retention_s))


def delete_engine(conn: Connection, *, engine_id: str) -> None:
    """Forget an engine's row (it comes back if that engine is still connected)."""
    if not repo.delete_engine(conn, engine_id):
        raise NotFound(f"engine {engine_id!r} is not known", field="engine_id")


def record_engines(conn: Connection, *, seen: Sequence[EngineSeen]) -> None:
    """Engines that are connected now, as last seen (one row per engine_id)."""
    now = datetime.now(UTC)
    known = repo.engine_ids(conn, [e.engine_id for e in seen])
    rows = [
        {
            "engine_id": e.engine_id,
            "model": e.model,
            "applied_version": e.applied_version,
            "connected": True,
            "first_seen": e.first_seen,
            "last_seen": now,
        }
        for e in seen
    ]
    repo.insert_engines(conn, [r for r in rows if r["engine_id"] not in known])
    repo.update_engines(conn, [r for r in rows if r["engine_id"] in known])


def disconnect_engines(conn: Connection, *, engine_ids: Sequence[str] | None) -> None:
    """Mark these engines (None: every engine) disconnected."""
    repo.set_engines_disconnected(conn, engine_ids)


# ---- usage history -----------------------------------------------------------

MINUTE_S = 60
MAX_HISTORY_POINTS = 1440


def record_usage(conn: Connection, *, counts: dict[tuple[str, int], tuple[int, int]]) -> None:
    """Add (user, minute start) -> (tokens granted, request-steps throttled) to the
    per-minute rollups, each with the user's effective limit now."""
    if not counts:
        return
    users = sorted({user for user, _ in counts})
    limits = effective_rates(conn, users)
    repo.add_usage(
        conn,
        [
            repo.UsageRow(user, minute, tokens, throttled, limits[user])
            for (user, minute), (tokens, throttled) in sorted(counts.items())
        ],
    )


def prune_usage(conn: Connection, *, now: float, retention_days: int) -> int:
    """Drop the rollups of minutes that ended more than `retention_days` before `now`."""
    cutoff = int(now) - retention_days * 86_400 - MINUTE_S
    return repo.delete_usage_before(conn, cutoff)


def usage_history(
    conn: Connection,
    *,
    now: float,
    since: float,
    step: int,
    user: str | None,
    top: int,
    order: str,
) -> dict[str, Any]:
    """Reported usage in buckets of `step` seconds from `since` to `now`.

    Per user and bucket: output tokens/s while reported (tokens over the reported
    minutes; a bucket with no report is null, a gap), the throttled fraction of
    request-steps, and the limit in force (null: unlimited). Without `user`, the `top`
    users by throttled steps ("throttled") or tokens ("tokens")."""
    if step % MINUTE_S:
        raise InvalidInput("step: must be a whole number of minutes (60, 120, ...)", field="step")
    start = int(since) // step * step
    end = int(now) // MINUTE_S * MINUTE_S + MINUTE_S  # through the current minute
    if start >= end:
        raise InvalidInput("since: must be in the past", field="since")
    num_points = -(-(end - start) // step)
    if num_points > MAX_HISTORY_POINTS:
        raise InvalidInput(
            f"step: {num_points} points from since to now; at most {MAX_HISTORY_POINTS} "
            "(choose a larger step or a later since)",
            field="step",
        )
    users = (
        [user]
        if user is not None
        else repo.top_usage_users(conn, since=start, until=end, order=order, limit=top)
    )
    rows = repo.usage_rows(conn, users=users, since=start, until=end) if users else []
    times = [start + i * step for i in range(num_points)]
    # user -> bucket -> [tokens, throttled, reported seconds, limit]
    buckets: dict[str, dict[int, list[Any]]] = {u: {} for u in users}
    for row in rows:
        index = (row.minute - start) // step
        bucket = buckets[row.user].setdefault(index, [0, 0, 0.0, None])
        bucket[0] += row.tokens
        bucket[1] += row.throttled
        # The current minute is only partly over.
        bucket[2] += min(MINUTE_S, max(1.0, now - row.minute))
        bucket[3] = row.limit_rate
    items = []
    for name in users:
        rates: list[float | None] = [None] * num_points
        throttled: list[float | None] = [None] * num_points
        limits: list[int | None] = [None] * num_points
        total_tokens = total_throttled = 0
        for index, (tokens, steps, seconds, limit) in buckets[name].items():
            rates[index] = round(tokens / seconds, 3)
            throttled[index] = round(steps / (tokens + steps), 4) if tokens + steps else 0.0
            limits[index] = limit
            total_tokens += tokens
            total_throttled += steps
        items.append(
            {
                "user": name,
                "output_tokens_per_second": rates,
                "throttled_fraction": throttled,
                "limit": limits,
                "tokens": total_tokens,
                "throttled": total_throttled,
            }
        )
    return {"since": start, "until": end, "step": step, "times": times, "items": items}
