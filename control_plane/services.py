"""The rules of the limit model. Every write bumps the config version once, in
the same transaction as the change, its audit entry and its change-log row;
a write that changes nothing writes nothing."""

from __future__ import annotations

import hashlib
import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from control_plane import repository as repo
from control_plane.errors import Conflict, InvalidInput, NotFound
from control_plane.models import ConfigState, Tier, UserLimit, ViewerToken

MAX_BULK_ITEMS = 10_000
MAX_PAGE = 1_000

# session.info key: the version a write produced, for the on_commit hooks after commit.
NEW_VERSION_KEY = "output_rate_new_version"


@dataclass(frozen=True)
class Snapshot:
    """The whole limit state at one version, as engines receive it."""

    version: int
    default_rate: int | None
    tiers: dict[str, int | None]
    # user -> (tier, override rate)
    users: dict[str, tuple[str | None, int | None]]


# ---- views -----------------------------------------------------------------


def limit_view(
    *, user: str, row: UserLimit | None, tier_rates: dict[str, int | None], state: ConfigState
) -> dict[str, Any]:
    tier = row.tier if row else None
    override = row.rate if row else None
    effective: int | None
    if override is not None:
        effective, source = override, "override"
    elif tier is not None:
        effective, source = tier_rates.get(tier), "tier"
    else:
        effective, source = state.default_rate, "default"
    return {
        "user": user,
        "tier": tier,
        "output_tokens_per_second": override,
        "effective_output_tokens_per_second": effective,
        "source": source,
        # The version of the user's last change (the current one for users
        # nobody configured): once engines applied it, this view is enforced.
        "version": row.version if row else state.version,
    }


def tier_view(tier: Tier, num_users: int) -> dict[str, Any]:
    return {
        "name": tier.name,
        "output_tokens_per_second": tier.rate,
        "description": tier.description,
        "num_users": num_users,
        "version": tier.version,
    }


def _tier_rates(session: Session) -> dict[str, int | None]:
    return {t.name: t.rate for t in repo.list_tiers(session)}


def _user_record(row: UserLimit | None) -> dict[str, Any] | None:
    return None if row is None else {"tier": row.tier, "output_tokens_per_second": row.rate}


# ---- reads -----------------------------------------------------------------


def _rate_of_tier(session: Session, tier: str | None) -> dict[str, int | None]:
    row = repo.get_tier(session, tier) if tier is not None else None
    return {} if row is None else {row.name: row.rate}


def get_limit(session: Session, *, user: str) -> dict[str, Any]:
    row = repo.get_user(session, user)
    return limit_view(
        user=user,
        row=row,
        tier_rates=_rate_of_tier(session, row.tier if row else None),
        state=repo.get_config(session),
    )


def list_limits(
    session: Session, *, offset: int, limit: int, tier: str | None, prefix: str | None
) -> dict[str, Any]:
    state = repo.get_config(session)
    rows = repo.list_users(session, offset=offset, limit=limit, tier=tier, prefix=prefix)
    # Totals come from maintained counters; only a prefix filter needs an index range count.
    if prefix:
        total = repo.count_users(session, tier=tier, prefix=prefix)
    elif tier is not None:
        tier_row = repo.get_tier(session, tier)
        total = tier_row.num_users if tier_row else 0
    else:
        total = state.num_users
    tier_rates = _tier_rates(session)
    items = [limit_view(user=r.user, row=r, tier_rates=tier_rates, state=state) for r in rows]
    return {"items": items, "total": total}


def list_tiers(session: Session) -> list[dict[str, Any]]:
    return [tier_view(t, t.num_users) for t in repo.list_tiers(session)]


def get_tier(session: Session, *, name: str) -> dict[str, Any]:
    tier = repo.get_tier(session, name)
    if tier is None:
        raise NotFound(f"tier {name!r} does not exist", field="name")
    return tier_view(tier, tier.num_users)


def get_default(session: Session) -> dict[str, Any]:
    state = repo.get_config(session)
    return {"output_tokens_per_second": state.default_rate, "version": state.version}


def current_version(session: Session) -> int:
    return repo.get_config(session).version


def load_snapshot(session: Session) -> Snapshot:
    """Version, default, tiers and users as of one instant.

    PostgreSQL runs the reads in one REPEATABLE READ transaction (so a concurrent write
    is wholly in the snapshot or wholly after its version); one SQLite read transaction
    already sees a single snapshot. Give it a session that has not started yet.
    """
    if not session.in_transaction() and session.get_bind().dialect.name == "postgresql":
        session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
    state = session.get(ConfigState, repo.CONFIG_ROW_ID, populate_existing=True)
    assert state is not None, "config_state row is created by the initial migration"
    return Snapshot(
        version=state.version,
        default_rate=state.default_rate,
        tiers=_tier_rates(session),
        users=repo.all_user_records(session),
    )


def load_changes_since(session: Session, version: int) -> list[tuple[int, list[dict[str, Any]]]]:
    return [(c.version, c.ops) for c in repo.changes_since(session, version)]


# ---- writes ----------------------------------------------------------------


def _record(
    session: Session,
    state: ConfigState,
    *,
    actor: str,
    action: str,
    target: str,
    before: Any,
    after: Any,
    ops: list[dict[str, Any]],
) -> int:
    state.version += 1
    state.updated_at = datetime.now(UTC)
    repo.add_change(session, version=state.version, ops=ops)
    repo.add_audit(
        session,
        version=state.version,
        actor=actor,
        action=action,
        target=target,
        before=before,
        after=after,
    )
    session.info[NEW_VERSION_KEY] = state.version
    return state.version


def _count_users(
    session: Session, state: ConfigState, *, new_users: int, tier_deltas: Counter[str | None]
) -> None:
    """Keep the user counters (total and per tier) in step with a user write."""
    state.num_users += new_users
    for name, delta in tier_deltas.items():
        if name is not None and delta:
            repo.add_tier_users(session, name, delta)


def _require_tier(session: Session, tier: str | None) -> None:
    if tier is not None and repo.get_tier(session, tier) is None:
        raise InvalidInput(f"tier: unknown tier {tier!r}", field="tier")


def put_limit(
    session: Session, *, actor: str, user: str, rate: int | None, tier: str | None
) -> dict[str, Any]:
    state = repo.lock_config(session)
    _require_tier(session, tier)
    row = repo.get_user(session, user)
    before = _user_record(row)
    after = {"tier": tier, "output_tokens_per_second": rate}
    if before != after:
        version = _record(
            session,
            state,
            actor=actor,
            action="put_limit",
            target=user,
            before=before,
            after=after,
            ops=[{"op": "set_user", "user": user, "tier": tier, "rate": rate}],
        )
        deltas: Counter[str | None] = Counter({tier: 1})
        if row is None:
            row = UserLimit(user=user, tier=tier, rate=rate, version=version)
            session.add(row)
        else:
            deltas[row.tier] -= 1
            row.tier, row.rate, row.version = tier, rate, version
            row.updated_at = datetime.now(UTC)
        _count_users(session, state, new_users=0 if before else 1, tier_deltas=deltas)
        session.flush()
    return limit_view(user=user, row=row, tier_rates=_rate_of_tier(session, tier), state=state)


def delete_limit(session: Session, *, actor: str, user: str) -> None:
    state = repo.lock_config(session)
    row = repo.get_user(session, user)
    if row is None:
        return
    _record(
        session,
        state,
        actor=actor,
        action="delete_limit",
        target=user,
        before=_user_record(row),
        after=None,
        ops=[{"op": "delete_user", "user": user}],
    )
    _count_users(session, state, new_users=-1, tier_deltas=Counter({row.tier: -1}))
    session.delete(row)
    session.flush()


def bulk_put_limits(
    session: Session, *, actor: str, items: Sequence[tuple[str, int | None, str | None]]
) -> dict[str, Any]:
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
    state = repo.lock_config(session)
    tiers = _tier_rates(session)
    for index, (_, _, tier) in enumerate(items):
        if tier is not None and tier not in tiers:
            raise InvalidInput(
                f"items.{index}.tier: unknown tier {tier!r}", field=f"items.{index}.tier"
            )
    existing = repo.get_users(session, users)
    changed = [
        (user, rate, tier)
        for user, rate, tier in items
        if _user_record(existing.get(user)) != {"tier": tier, "output_tokens_per_second": rate}
    ]
    if not changed:
        return {"version": state.version, "num_changed": 0}
    version = _record(
        session,
        state,
        actor=actor,
        action="bulk_put_limits",
        target=f"{len(changed)} users",
        # One entry for one version, with every changed user's record before and after.
        before={u: _user_record(existing.get(u)) for u, _, _ in changed},
        after={u: {"tier": t, "output_tokens_per_second": r} for u, r, t in changed},
        ops=[{"op": "set_user", "user": u, "tier": t, "rate": r} for u, r, t in changed],
    )
    now = datetime.now(UTC)
    deltas: Counter[str | None] = Counter()
    new_users = 0
    for user, rate, tier in changed:
        row = existing.get(user)
        deltas[tier] += 1
        if row is None:
            new_users += 1
            session.add(UserLimit(user=user, tier=tier, rate=rate, version=version))
        else:
            deltas[row.tier] -= 1
            row.tier, row.rate, row.version, row.updated_at = tier, rate, version, now
    _count_users(session, state, new_users=new_users, tier_deltas=deltas)
    session.flush()
    return {"version": version, "num_changed": len(changed)}


def put_tier(
    session: Session, *, actor: str, name: str, rate: int | None, description: str | None
) -> dict[str, Any]:
    state = repo.lock_config(session)
    tier = repo.get_tier(session, name)
    before = (
        None
        if tier is None
        else {"output_tokens_per_second": tier.rate, "description": tier.description}
    )
    new_description = description if description is not None else (tier.description if tier else "")
    after = {"output_tokens_per_second": rate, "description": new_description}
    if before != after:
        version = _record(
            session,
            state,
            actor=actor,
            action="put_tier",
            target=name,
            before=before,
            after=after,
            ops=[{"op": "set_tier", "name": name, "rate": rate}],
        )
        if tier is None:
            tier = Tier(
                name=name, rate=rate, description=new_description, version=version, num_users=0
            )
            session.add(tier)
        else:
            tier.rate, tier.description, tier.version = rate, new_description, version
            tier.updated_at = datetime.now(UTC)
        session.flush()
    assert tier is not None
    return tier_view(tier, tier.num_users)


def delete_tier(session: Session, *, actor: str, name: str) -> None:
    state = repo.lock_config(session)
    tier = repo.get_tier(session, name)
    if tier is None:
        raise NotFound(f"tier {name!r} does not exist", field="name")
    # The EXISTS (one index probe) guards against the counter ever drifting.
    num_users = tier.num_users
    if num_users or repo.tier_has_users(session, name):
        raise Conflict(f"tier {name!r} still has {num_users} users assigned", field="name")
    _record(
        session,
        state,
        actor=actor,
        action="delete_tier",
        target=name,
        before={"output_tokens_per_second": tier.rate, "description": tier.description},
        after=None,
        ops=[{"op": "delete_tier", "name": name}],
    )
    session.delete(tier)
    session.flush()


def put_default(session: Session, *, actor: str, rate: int | None) -> dict[str, Any]:
    state = repo.lock_config(session)
    if state.default_rate != rate:
        before = {"output_tokens_per_second": state.default_rate}
        _record(
            session,
            state,
            actor=actor,
            action="put_default",
            target="default",
            before=before,
            after={"output_tokens_per_second": rate},
            ops=[{"op": "set_default", "rate": rate}],
        )
        state.default_rate = rate
        session.flush()
    return {"output_tokens_per_second": state.default_rate, "version": state.version}


def list_audit(session: Session, *, limit: int) -> list[dict[str, Any]]:
    return [
        {
            "at": e.at.isoformat(),
            "version": e.version,
            "actor": e.actor,
            "action": e.action,
            "target": e.target,
            "before": e.before,
            "after": e.after,
        }
        for e in repo.list_audit(session, limit=limit)
    ]


# ---- tokens ----------------------------------------------------------------


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _audit_token(session: Session, *, actor: str, action: str, row: ViewerToken) -> None:
    """Tokens are not limit configuration: audited, but the version does not move."""
    repo.add_audit(
        session,
        version=repo.get_config(session).version,
        actor=actor,
        action=action,
        target=f"token:{row.id}",
        before=None if action == "create_token" else {"name": row.name, "revoked": False},
        after={"name": row.name, "revoked": action == "revoke_token"},
    )


def create_viewer_token(session: Session, *, actor: str, name: str) -> dict[str, Any]:
    token = "orv_" + secrets.token_urlsafe(32)
    row = ViewerToken(name=name, token_hash=hash_token(token))
    session.add(row)
    session.flush()
    _audit_token(session, actor=actor, action="create_token", row=row)
    return {"id": row.id, "name": name, "token": token}


def list_viewer_tokens(session: Session) -> list[dict[str, Any]]:
    return [
        {
            "id": t.id,
            "name": t.name,
            "created_at": t.created_at.isoformat(),
            "revoked": t.revoked_at is not None,
        }
        for t in repo.list_viewer_tokens(session)
    ]


def revoke_viewer_token(session: Session, *, actor: str, token_id: int) -> None:
    """Idempotent: revoking a revoked token changes nothing."""
    row = session.get(ViewerToken, token_id)
    if row is None:
        raise NotFound(f"token {token_id} does not exist", field="token_id")
    if row.revoked_at is None:
        row.revoked_at = datetime.now(UTC)
        _audit_token(session, actor=actor, action="revoke_token", row=row)
        session.flush()


def viewer_token_name(session: Session, *, token: str) -> str | None:
    row = repo.find_viewer_token(session, hash_token(token))
    return None if row is None else row.name


def list_engines(session: Session, *, timeout_s: float) -> dict[str, Any]:
    now = datetime.now(UTC)
    items = []
    for e in repo.list_engines(session):
        last_seen = e.last_seen if e.last_seen.tzinfo else e.last_seen.replace(tzinfo=UTC)
        items.append(
            {
                "engine_id": e.engine_id,
                "model": e.model,
                "applied_version": e.applied_version,
                "connected": e.connected and (now - last_seen).total_seconds() <= timeout_s,
                "last_seen": last_seen.isoformat(),
                "first_seen": e.first_seen.isoformat(),
            }
        )
    return {"version": current_version(session), "items": items}
