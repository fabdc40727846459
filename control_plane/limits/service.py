"""The rules of the limit model. Every write commits through the config log
(control_plane/config/): the version bumped once, in the same transaction as the change,
its audit entry and its change-log row; a write that changes nothing writes nothing. A
write of the configuration returns a `ConfigChange`: its view and the version it made.

Each function takes the Connection of one transaction (control_plane.db.Database runs
it where its `@service` policy says); the caller commits."""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from control_plane.audit import service as audit
from control_plane.audit.targets import (
    DEFAULT_TARGET,
    bulk_target,
    tier_target,
    user_target,
)
from control_plane.config import service as config
from control_plane.config.repository import State, UserRecord
from control_plane.db import ConfigChange, service
from control_plane.errors import Conflict, InvalidInput, InvalidLines, LineProblem, NotFound
from control_plane.fleet.view import FleetView
from control_plane.limits import repository as repo
from control_plane.limits.schemas import (
    MAX_BULK_ITEMS,
    BulkOut,
    DefaultOut,
    LimitDetail,
    LimitOut,
    LimitPage,
    ShareOut,
    TierList,
    TierOut,
)
from control_plane.usage.book import UsageSource
from output_rate_core import protocol as p
from output_rate_core.limits import FLEET, UNCONFIGURED, LimitModel
from output_rate_core.policy import NO_POLICY, Enforcement, Policy, Scope


@dataclass(frozen=True)
class UserItem:
    """One user's record as a write gives it: its tier (None: none) and its own policy
    (a field of None inherits)."""

    user: str
    tier: str | None
    policy: Policy = NO_POLICY


@dataclass(frozen=True)
class UserCounts:
    """The config version and default, and the configured users (maintained counters)."""

    version: int
    default_rate: int | None
    num_users: int
    # tier -> users assigned to it
    num_users_per_tier: dict[str, int]


# ---- views -----------------------------------------------------------------


def limit_view(user: str, record: UserRecord | None, model: LimitModel, version: int) -> LimitOut:
    """The view of `user`, whose record is `record` (None: not configured), resolved by
    `model` (which holds the record's tier and the default); `version`: the config's now."""
    tier, own = (record.tier, record.policy) if record else UNCONFIGURED
    effective = model.resolve(tier, own)
    return LimitOut(
        user=user,
        tier=tier,
        output_tokens_per_second=own.rate,
        effective_output_tokens_per_second=effective.rate,
        source=effective.source,
        scope=own.scope,
        effective_scope=effective.scope,
        enforcement=own.enforcement,
        effective_enforcement=effective.enforcement,
        # The version of the user's last change (the current one for users
        # nobody configured): once engines applied it, this view is enforced.
        version=record.version if record else version,
    )


def shares_view(view: LimitOut, fleet: FleetView) -> list[ShareOut]:
    """The shares engines hold of a fleet-scoped limit, by engine id (none otherwise:
    an engine-scoped or unlimited user is not split)."""
    if view.effective_scope != FLEET or view.effective_output_tokens_per_second is None:
        return []
    shares = sorted(fleet.shares_of(view.user).items())
    return [ShareOut(engine_id=e, output_tokens_per_second=m / p.MILLI) for e, m in shares]


def tier_view(tier: repo.TierRow) -> TierOut:
    return TierOut(
        name=tier.name,
        output_tokens_per_second=tier.policy.rate,
        scope=tier.policy.scope,
        enforcement=tier.policy.enforcement,
        description=tier.description,
        num_users=tier.num_users,
        version=tier.version,
    )


def policy_values(policy: Policy) -> dict[str, Any]:
    """A policy as the audit log and the bodies name its fields."""
    return {
        "output_tokens_per_second": policy.rate,
        "scope": policy.scope,
        "enforcement": policy.enforcement,
    }


def record_values(record: UserRecord | UserItem | None) -> dict[str, Any] | None:
    """A user's record as the audit log, the merge patch and a preview compare it (its
    version aside)."""
    return None if record is None else _user_values(record.tier, record.policy)


def _user_values(tier: str | None, policy: Policy) -> dict[str, Any]:
    return {"tier": tier, **policy_values(policy)}


def _tier_record(tier: repo.TierRow | None) -> dict[str, Any] | None:
    """A tier as the audit log sees it."""
    if tier is None:
        return None
    return {**policy_values(tier.policy), "description": tier.description}


# ---- reads -----------------------------------------------------------------


@service("read")
def get_limit(conn: Connection, *, user: str) -> LimitOut:
    row = repo.get_limit_row(conn, user)
    tier = row.record.tier if row.record else None
    tiers = {tier: row.tier} if tier is not None and row.tier is not None else {}
    return limit_view(user, row.record, LimitModel(row.state.default, tiers), row.state.version)


@service("read")
def get_limit_detail(
    conn: Connection, *, user: str, fleet: FleetView, usage: UsageSource
) -> LimitDetail:
    """The user's view with the shares engines hold and the rate they report now."""
    view = get_limit(conn, user=user)
    received = usage.rate_1s(user)
    return LimitDetail(
        **view.model_dump(exclude={"shares"}),
        shares=shares_view(view, fleet),
        received_output_tokens_per_second=received,
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
    state = config.state(conn)
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
    model = LimitModel(state.default, config.tier_policies(conn))
    items = [limit_view(user, record, model, state.version) for user, record in rows]
    return LimitPage(items=items, total=total)


def user_counts(conn: Connection) -> UserCounts:
    state = config.state(conn)
    return UserCounts(
        version=state.version,
        default_rate=state.default.rate,
        num_users=state.num_users,
        num_users_per_tier={tier.name: tier.num_users for tier in repo.list_tiers(conn)},
    )


@service("read")
def list_tiers(conn: Connection) -> TierList:
    return TierList(items=[tier_view(t) for t in repo.list_tiers(conn)])


@service("read")
def get_tier(conn: Connection, *, name: str) -> TierOut:
    return tier_view(existing_tier(conn, name))


@service("read")
def get_default(conn: Connection) -> DefaultOut:
    return _default_view(config.state(conn))


def _default_view(state: State) -> DefaultOut:
    return DefaultOut(**policy_values(state.default), version=state.version)


# ---- writes ----------------------------------------------------------------


def tier_policy_of(conn: Connection, tier: str | None, *, field: str = "tier") -> Policy | None:
    """The policy of `tier` (None for no tier); an unknown tier is bad input."""
    if tier is None:
        return None
    row = repo.get_tier(conn, tier)
    if row is None:
        raise InvalidInput(f"{field}: unknown tier {tier!r}", field=field)
    return row.policy


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
    conn: Connection,
    *,
    actor: str,
    user: str,
    rate: int | None,
    tier: str | None,
    scope: Scope | None = None,
    enforcement: Enforcement | None = None,
) -> ConfigChange[LimitOut]:
    state = config.lock(conn)
    tier_policy = tier_policy_of(conn, tier)
    record = repo.get_user(conn, user)
    return _set_user(
        conn,
        state,
        actor=actor,
        action="put_limit",
        item=UserItem(user, tier, Policy(rate, scope, enforcement)),
        record=record,
        tier_policy=tier_policy,
    )


@service("write")
def patch_limit(
    conn: Connection, *, actor: str, user: str, changes: dict[str, Any]
) -> ConfigChange[LimitOut]:
    """JSON merge patch of a user's record: only the keys in `changes`
    ("output_tokens_per_second", "tier", "scope", "enforcement") change; the others keep
    their value.
    A patch that changes nothing writes nothing (an unknown user stays unconfigured)."""
    state = config.lock(conn)
    record = repo.get_user(conn, user)
    item = patched_item(record, user, changes)
    tier_policy = tier_policy_of(conn, item.tier)
    if record is None and record_values(item) == record_values(UserItem(user, None)):
        model = LimitModel(state.default)
        return ConfigChange(limit_view(user, None, model, state.version), None)
    return _set_user(
        conn,
        state,
        actor=actor,
        action="patch_limit",
        item=item,
        record=record,
        tier_policy=tier_policy,
    )


def patched_item(record: UserRecord | None, user: str, changes: dict[str, Any]) -> UserItem:
    """The record a merge patch of `changes` makes of `record` (None: not configured)."""
    merged = {
        **_user_values(*((record.tier, record.policy) if record else UNCONFIGURED)),
        **changes,
    }
    policy = Policy(merged["output_tokens_per_second"], merged["scope"], merged["enforcement"])
    return UserItem(user, merged["tier"], policy)


def _set_user(
    conn: Connection,
    state: State,
    *,
    actor: str,
    action: str,
    item: UserItem,
    record: UserRecord | None,
    tier_policy: Policy | None,
) -> ConfigChange[LimitOut]:
    """Write the user's new record (if it differs) as one version; return its view."""
    user = item.user
    before = record_values(record)
    after = record_values(item)
    version = None
    if before != after:
        entry = audit.Entry(actor, action, user_target(user), before, after)
        version = config.commit(
            conn, state, [_set_user_op(item)], entry, new_users=0 if record else 1
        )
        new_record = UserRecord(item.tier, item.policy, version)
        if record is None:
            repo.insert_users(conn, [(user, new_record)])
        else:
            repo.update_users(conn, [(user, new_record)])
        repo.add_tier_users(conn, _tier_deltas([(record, item.tier)]))
        record, state = new_record, state._replace(version=version)
    tiers = {} if item.tier is None or tier_policy is None else {item.tier: tier_policy}
    model = LimitModel(state.default, tiers)
    return ConfigChange(limit_view(user, record, model, state.version), version)


def _set_user_op(item: UserItem) -> p.SetUser:
    return p.SetUser.of(item.user, item.tier, item.policy)


@service("write")
def delete_limit(conn: Connection, *, actor: str, user: str) -> ConfigChange[None]:
    state = config.lock(conn)
    record = repo.get_user(conn, user)
    if record is None:
        return ConfigChange(None, None)
    version = config.commit(
        conn,
        state,
        [p.DeleteUser(user=user)],
        audit.Entry(actor, "delete_limit", user_target(user), record_values(record), None),
        new_users=-1,
    )
    repo.delete_user(conn, user)
    repo.add_tier_users(conn, _tier_deltas([(record, None)]))
    return ConfigChange(None, version)


@dataclass(frozen=True)
class BulkInput:
    """The records of a bulk write, as a JSON body (`lines` None) or a CSV body gave them:
    `lines` then holds each item's line and `problems` the lines that were not items."""

    items: Sequence[UserItem]
    lines: Sequence[int] | None = None
    problems: Sequence[LineProblem] = ()


def check_bulk(bulk: BulkInput, known_tiers: Container[str]) -> None:
    """Refuse a bulk write over MAX_BULK_ITEMS, naming a user twice or an unknown tier:
    a JSON body by its first bad item (`items.3.tier`), a CSV body by all its bad lines."""
    items, lines = bulk.items, bulk.lines
    if len(items) > MAX_BULK_ITEMS:
        raise InvalidInput(f"items: at most {MAX_BULK_ITEMS} per request", field="items")

    def where(index: int) -> str:
        return f"items.{index}" if lines is None else f"line {lines[index]}"

    problems: list[tuple[int, str, str]] = []
    first_index: dict[str, int] = {}
    for index, item in enumerate(items):
        if item.user in first_index:
            seen = where(first_index[item.user])
            problems.append((index, "user", f"user {item.user!r} already appears at {seen}"))
        else:
            first_index[item.user] = index
    for index, item in enumerate(items):
        if item.tier is not None and item.tier not in known_tiers:
            problems.append((index, "tier", f"unknown tier {item.tier!r}"))
    if lines is None:
        if problems:
            index, field, reason = problems[0]
            raise InvalidInput(f"items.{index}.{field}: {reason}", field=f"items.{index}.{field}")
        return
    found = [LineProblem(lines[i], field, reason) for i, field, reason in problems]
    if found or bulk.problems:
        raise InvalidLines([*bulk.problems, *found])


@service("write_batch")
def bulk_put_limits(
    conn: Connection,
    *,
    actor: str,
    items: Sequence[UserItem],
    lines: Sequence[int] | None = None,
    problems: Sequence[LineProblem] = (),
) -> ConfigChange[BulkOut]:
    """Apply up to MAX_BULK_ITEMS user records as one version (`lines` and `problems`:
    see BulkInput)."""
    state = config.lock(conn)
    check_bulk(BulkInput(items, lines, problems), config.tier_policies(conn))
    existing = config.user_records(conn, [item.user for item in items])
    changed = [i for i in items if record_values(existing.get(i.user)) != record_values(i)]
    if not changed:
        return ConfigChange(BulkOut(version=state.version, num_changed=0), None)
    num_new = sum(1 for i in changed if i.user not in existing)
    version = config.commit(
        conn,
        state,
        [_set_user_op(i) for i in changed],
        # One entry for one version, with every changed user's record before and after.
        audit.Entry(
            actor,
            "bulk_put_limits",
            bulk_target(len(changed)),
            {i.user: record_values(existing.get(i.user)) for i in changed},
            {i.user: record_values(i) for i in changed},
        ),
        new_users=num_new,
    )
    records = [(i.user, UserRecord(i.tier, i.policy, version)) for i in changed]
    repo.insert_users(conn, [(u, r) for u, r in records if u not in existing])
    repo.update_users(conn, [(u, r) for u, r in records if u in existing])
    repo.add_tier_users(conn, _tier_deltas((existing.get(i.user), i.tier) for i in changed))
    return ConfigChange(BulkOut(version=version, num_changed=len(changed)), version)


@service("write")
def put_tier(
    conn: Connection,
    *,
    actor: str,
    name: str,
    rate: int | None,
    description: str | None,
    scope: Scope | None = None,
    enforcement: Enforcement | None = None,
) -> ConfigChange[TierOut]:
    """Set a tier's rate, scope and enforcement (None: inherit the default's); a
    description of None keeps the one it had."""
    state = config.lock(conn)
    tier = repo.get_tier(conn, name)
    new_description = description if description is not None else (tier.description if tier else "")
    return _set_tier(
        conn,
        state,
        actor=actor,
        action="put_tier",
        name=name,
        tier=tier,
        policy=Policy(rate, scope, enforcement),
        description=new_description,
    )


@service("write")
def patch_tier(
    conn: Connection, *, actor: str, name: str, changes: dict[str, Any]
) -> ConfigChange[TierOut]:
    """JSON merge patch of an existing tier: only the keys in `changes`
    ("output_tokens_per_second", "scope", "enforcement", "description") change. A
    description of null is
    empty. An unknown tier is 404: a patch never creates one (its rate would be a guess)."""
    state = config.lock(conn)
    tier = existing_tier(conn, name)
    description = changes.get("description", tier.description)
    return _set_tier(
        conn,
        state,
        actor=actor,
        action="patch_tier",
        name=name,
        tier=tier,
        policy=patched_tier_policy(tier, changes),
        description=description if description is not None else "",
    )


def existing_tier(conn: Connection, name: str) -> repo.TierRow:
    tier = repo.get_tier(conn, name)
    if tier is None:
        raise NotFound(f"tier {name!r} does not exist", field="name")
    return tier


def patched_tier_policy(tier: repo.TierRow, changes: dict[str, Any]) -> Policy:
    """The policy a merge patch of `changes` gives `tier`."""
    merged = {**policy_values(tier.policy), **changes}
    return Policy(merged["output_tokens_per_second"], merged["scope"], merged["enforcement"])


def _set_tier(
    conn: Connection,
    state: State,
    *,
    actor: str,
    action: str,
    name: str,
    tier: repo.TierRow | None,
    policy: Policy,
    description: str,
) -> ConfigChange[TierOut]:
    """Write the tier's new policy and description (if they differ) as one version."""
    num_users = tier.num_users if tier else 0
    new_tier = repo.TierRow(name, policy, description, version=0, num_users=num_users)
    before = _tier_record(tier)
    if before == _tier_record(new_tier):
        assert tier is not None
        return ConfigChange(tier_view(tier), None)
    version = config.commit(
        conn,
        state,
        [p.SetTier.of(name, policy)],
        audit.Entry(actor, action, tier_target(name), before, _tier_record(new_tier)),
    )
    write = repo.insert_tier if tier is None else repo.update_tier
    write(conn, name=name, policy=policy, description=description, version=version)
    return ConfigChange(tier_view(new_tier._replace(version=version)), version)


def deletable_tier(conn: Connection, name: str) -> repo.TierRow:
    """The tier `name`; unknown: 404; with users assigned: 409."""
    tier = existing_tier(conn, name)
    # The EXISTS (one index probe) guards against the counter ever drifting.
    if tier.num_users or repo.tier_has_users(conn, name):
        raise Conflict(f"tier {name!r} still has {tier.num_users} users assigned", field="name")
    return tier


@service("write")
def delete_tier(conn: Connection, *, actor: str, name: str) -> ConfigChange[None]:
    state = config.lock(conn)
    tier = deletable_tier(conn, name)
    version = config.commit(
        conn,
        state,
        [p.DeleteTier(name=name)],
        audit.Entry(actor, "delete_tier", tier_target(name), _tier_record(tier), None),
    )
    repo.delete_tier(conn, name)
    return ConfigChange(None, version)


@service("write")
def put_default(
    conn: Connection,
    *,
    actor: str,
    rate: int | None,
    scope: Scope | None = None,
    enforcement: Enforcement | None = None,
) -> ConfigChange[DefaultOut]:
    """Replace the default rate, scope (None: "fleet") and enforcement (None: "enforce")."""
    state = config.lock(conn)
    policy = Policy(rate, scope, enforcement)
    if policy == state.default:
        return ConfigChange(_default_view(state), None)
    version = config.commit(
        conn,
        state,
        [p.SetDefault.of(policy)],
        audit.Entry(
            actor,
            "put_default",
            DEFAULT_TARGET,
            policy_values(state.default),
            policy_values(policy),
        ),
    )
    repo.set_default(conn, policy)
    return ConfigChange(_default_view(state._replace(version=version, default=policy)), version)
