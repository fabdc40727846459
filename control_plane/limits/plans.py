"""What each of the eight limit writes would do, decided before anything is written: a
`Plan` (its ops, and the limit model before and after them).

The write commits the plan's ops through the config log, which also writes them onto the
tables (control_plane/limits/service.py, control_plane/config/service.py); `?dry_run=true`
diffs the very same plan instead (control_plane/limits/preview.py). So a write and its
preview read, check and refuse alike (422 naming the field or the line, 404, 409): the
plan is the only code that does.

Each plan takes the Connection of one transaction and the config row it plans at (the
write's, taken with the writers' lock; the preview's, read). It reads the default, the
tiers and the users the write names; the version it answers with is the one a commit of
its ops makes, the next one (the log's versions are gap-free).
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sqlalchemy import Connection

from control_plane.audit import service as audit
from control_plane.audit.targets import (
    DEFAULT_TARGET,
    AuditTarget,
    bulk_target,
    tier_target,
    user_target,
)
from control_plane.config import service as config
from control_plane.config.repository import State, UserRecord
from control_plane.errors import Conflict, InvalidInput, InvalidLines, LineProblem, NotFound
from control_plane.limits import repository as repo
from control_plane.limits.repository import TierRow
from control_plane.limits.schemas import (
    CEILING,
    MAX_BULK_ITEMS,
    BulkOut,
    DefaultOut,
    LimitOut,
    TierOut,
)
from control_plane.limits.views import default_view, limit_view, tier_view
from output_rate_core import protocol as p
from output_rate_core.limits import UNCONFIGURED, LimitModel
from output_rate_core.policy import NO_POLICY, Enforcement, Policy, Scope

T = TypeVar("T")


@dataclass(frozen=True)
class Plan(Generic[T]):
    """A limit write, planned: its ops in order (none: it changes nothing), the limit model
    before and after them, what its audit entry says, and what the write answers once
    committed. The models hold the default, the users the write names, and the tiers of
    every user the ops may move (a tier's users and, for a default change, everyone are
    added by a preview, which needs them; a write does not)."""

    ops: list[p.Op]
    before: LimitModel
    after: LimitModel
    answer: T
    # The audit entry's target, and the target's values before and after.
    target: AuditTarget
    was: Any
    becomes: Any
    # The users the write names: a preview lists them whether or not anything changes.
    named: Sequence[str] = ()
    # tier -> the description its SetTier writes (a tier's description is no limit: no op
    # carries it)
    descriptions: Mapping[str, str] = field(default_factory=dict)
    # The version of the record the write replaces, which a versioned write's If-Match
    # must name (its ETag), and the record's version once the write is committed. None:
    # there is no such record (a tier that does not exist, or no longer does; a bulk
    # write, which is not versioned). A user always has one: NO_RECORD without a record.
    version_before: int | None = None
    version_after: int | None = None


def _applied(before: LimitModel, ops: list[p.Op]) -> LimitModel:
    after = before.copy()
    for op in ops:
        after.apply(op)
    return after


def _next_version(state: State, ops: list[p.Op]) -> int:
    """The version a write of `ops` leaves (a commit takes the next one)."""
    return state.version + 1 if ops else state.version


# The version of a user without a record, as its ETag names it: versions start at 1, so
# If-Match: "0" holds only while nobody has configured the user (docs/control-plane.md,
# "Versioned writes").
NO_RECORD = 0


def user_version(record: UserRecord | None) -> int:
    """The version a user's ETag names: its record's last change, NO_RECORD without one."""
    return NO_RECORD if record is None else record.version


def default_version(conn: Connection) -> int:
    """The version of the default limit's last change (NO_RECORD: never set): the config
    row keeps only the newest version of all, its audit entries keep the default's."""
    version = audit.last_version(conn, DEFAULT_TARGET)
    return NO_RECORD if version is None else version


# ---- records as the audit log and merge patches see them --------------------------


@dataclass(frozen=True)
class UserItem:
    """One user's record as a write gives it: its tier (None: none) and its own policy
    (a field of None inherits)."""

    user: str
    tier: str | None
    policy: Policy = NO_POLICY


def _policy_values(policy: Policy) -> dict[str, Any]:
    """A policy as the audit log and the bodies name its fields."""
    return {
        "output_tokens_per_second": policy.rate,
        "scope": policy.scope,
        "enforcement": policy.enforcement,
        CEILING: policy.ceiling,
    }


def _record_values(record: UserRecord | UserItem | None) -> dict[str, Any] | None:
    """A user's record as the audit log records it and a write compares it (its version
    aside; None: no record)."""
    if record is None:
        return None
    return {"tier": record.tier, **_policy_values(record.policy)}


def _tier_values(tier: TierRow | None) -> dict[str, Any] | None:
    """A tier as the audit log records it and a write compares it."""
    if tier is None:
        return None
    return {**_policy_values(tier.policy), "description": tier.description}


def _merged_policy(current: Policy, changes: Mapping[str, Any]) -> Policy:
    """`current` with the fields a merge patch sends (by their body names) replaced."""
    merged = {**_policy_values(current), **changes}
    return Policy(
        merged["output_tokens_per_second"], merged["scope"], merged["enforcement"], merged[CEILING]
    )


def ceiling_problem(ceiling: int | None, rate: int | None) -> str | None:
    """Why a level's own `ceiling` may not go with `rate`, the effective rate the write
    leaves that level (a user's resolved rate; a tier's or the default's own rate), or
    None: it may. Only a ceiling that is set is checked, at the level that sets it: a
    ceiling inherited, or one that a later change of a rate elsewhere leaves at or below
    the user's rate, borrows nothing (output_rate_core.limits.LimitModel.resolve)."""
    if ceiling is None:
        return None
    if rate is None:
        return f"{ceiling} is set where the effective rate is unlimited (a ceiling needs a rate)"
    if ceiling < rate:
        return f"{ceiling} is below the effective rate {rate} (a ceiling is at least the rate)"
    return None


def _check_ceiling(ceiling: int | None, rate: int | None) -> None:
    problem = ceiling_problem(ceiling, rate)
    if problem is not None:
        raise InvalidInput(f"{CEILING}: {problem}", field=CEILING)


# ---- one user -----------------------------------------------------------------------


def _known_tier(model: LimitModel, tier: str | None) -> None:
    if tier is not None and tier not in model.tiers:
        raise InvalidInput(f"tier: unknown tier {tier!r}", field="tier")


def _user_model(
    conn: Connection, state: State, user: str, old: UserRecord | None, new: UserItem | None
) -> LimitModel:
    """The default, `user` (`old`, None: no record) and the tiers of `old` and `new`."""
    names = {r.tier for r in (old, new) if r is not None and r.tier is not None}
    users = {} if old is None else {user: (old.tier, old.policy)}
    return LimitModel(state.default, config.tier_policies(conn, names), users)


def _user_ops(user: str, record: UserRecord | None, new: UserItem | None) -> list[p.Op]:
    """What makes `record` (None: none) `new` (None: none): nothing when they are equal."""
    if _record_values(record) == _record_values(new):
        return []
    if new is None:
        return [p.DeleteUser(user=user)]
    return [p.SetUser.of(user, new.tier, new.policy)]


def _set_user(
    conn: Connection, state: State, user: str, old: UserRecord | None, new: UserItem | None
) -> Plan[LimitOut]:
    """`user`'s record `old` becomes `new` (None: none); the answer is the user's view."""
    before = _user_model(conn, state, user, old, new)
    _known_tier(before, new.tier if new else None)
    if new is not None:
        _check_ceiling(new.policy.ceiling, before.resolve(new.tier, new.policy).rate)
    ops = _user_ops(user, old, new)
    after = _applied(before, ops)
    version = _next_version(state, ops)
    record = old
    if ops:
        record = None if new is None else UserRecord(new.tier, new.policy, version)
    return Plan(
        ops,
        before,
        after,
        limit_view(user, record, after, version),
        user_target(user),
        _record_values(old),
        _record_values(new),
        named=(user,),
        version_before=user_version(old),
        version_after=user_version(record),
    )


def put_limit(
    conn: Connection,
    state: State,
    *,
    user: str,
    rate: int | None,
    tier: str | None,
    scope: Scope | None = None,
    enforcement: Enforcement | None = None,
    ceiling: int | None = None,
) -> Plan[LimitOut]:
    """Replace the user's record (an absent field is null)."""
    old = config.user_records(conn, [user]).get(user)
    new = UserItem(user, tier, Policy(rate, scope, enforcement, ceiling))
    return _set_user(conn, state, user, old, new)


def patch_limit(
    conn: Connection, state: State, *, user: str, changes: Mapping[str, Any]
) -> Plan[LimitOut]:
    """JSON merge patch of a user's record: only the keys in `changes`
    ("output_tokens_per_second", "tier", "scope", "enforcement",
    "ceiling_output_tokens_per_second") change; the others keep their value."""
    old = config.user_records(conn, [user]).get(user)
    tier, own = (old.tier, old.policy) if old else UNCONFIGURED
    new = UserItem(user, changes.get("tier", tier), _merged_policy(own, changes))
    # A patch that sets nothing on a user without a record makes none: the user stays
    # unconfigured, and nothing is written.
    unset = old is None and new == UserItem(user, None)
    return _set_user(conn, state, user, old, None if unset else new)


def delete_limit(conn: Connection, state: State, *, user: str) -> Plan[None]:
    """Drop the user's record (its tier and override); nothing when it has none."""
    old = config.user_records(conn, [user]).get(user)
    before = _user_model(conn, state, user, old, None)
    ops = _user_ops(user, old, None)
    return Plan(
        ops,
        before,
        _applied(before, ops),
        None,
        user_target(user),
        _record_values(old),
        None,
        named=(user,),
        version_before=user_version(old),
        version_after=NO_RECORD,
    )


# ---- many users ---------------------------------------------------------------------


@dataclass(frozen=True)
class BulkInput:
    """The records of a bulk write, as a JSON body (`lines` None) or a CSV body gave them:
    `lines` then holds each item's line and `problems` the lines that were not items."""

    items: Sequence[UserItem]
    lines: Sequence[int] | None = None
    problems: Sequence[LineProblem] = ()


def check_bulk(bulk: BulkInput, known_tiers: Container[str], model: LimitModel) -> None:
    """Refuse a bulk write over MAX_BULK_ITEMS, naming a user twice, an unknown tier or a
    ceiling below the rate its record resolves to by `model` (the default and the tiers):
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
        elif item.policy.ceiling is not None:
            rate = model.resolve(item.tier, item.policy).rate
            problem = ceiling_problem(item.policy.ceiling, rate)
            if problem is not None:
                problems.append((index, CEILING, problem))
    if lines is None:
        if problems:
            index, field, reason = problems[0]
            raise InvalidInput(f"items.{index}.{field}: {reason}", field=f"items.{index}.{field}")
        return
    found = [LineProblem(lines[i], field, reason) for i, field, reason in problems]
    if found or bulk.problems:
        raise InvalidLines([*bulk.problems, *found])


def bulk_put_limits(
    conn: Connection,
    state: State,
    *,
    items: Sequence[UserItem],
    lines: Sequence[int] | None = None,
    problems: Sequence[LineProblem] = (),
) -> Plan[BulkOut]:
    """Up to MAX_BULK_ITEMS users' records replaced as one version (`lines` and
    `problems`: see BulkInput); items equal to the stored record are left out."""
    tiers = config.tier_policies(conn)
    check_bulk(BulkInput(items, lines, problems), tiers, LimitModel(state.default, tiers))
    users = [item.user for item in items]
    old = config.user_records(conn, users)
    before = LimitModel(state.default, tiers, {u: (r.tier, r.policy) for u, r in old.items()})
    changed = [i for i in items if _record_values(old.get(i.user)) != _record_values(i)]
    ops: list[p.Op] = [p.SetUser.of(i.user, i.tier, i.policy) for i in changed]
    version = _next_version(state, ops)
    return Plan(
        ops,
        before,
        _applied(before, ops),
        BulkOut(version=version, num_changed=len(changed)),
        bulk_target(len(changed)),
        # One entry for one version, with every changed user's record before and after.
        {i.user: _record_values(old.get(i.user)) for i in changed},
        {i.user: _record_values(i) for i in changed},
        named=users,
    )


# ---- tiers --------------------------------------------------------------------------


def _tier_model(state: State, tier: TierRow | None) -> LimitModel:
    """The default and this tier (None: it does not exist)."""
    return LimitModel(state.default, {} if tier is None else {tier.name: tier.policy})


def _set_tier(
    state: State, name: str, tier: TierRow | None, policy: Policy, description: str
) -> Plan[TierOut]:
    """Tier `name` (now `tier`, None: none) gets `policy` and `description`."""
    _check_ceiling(policy.ceiling, policy.rate)
    before = _tier_model(state, tier)
    num_users = tier.num_users if tier else 0
    ops: list[p.Op] = [p.SetTier.of(name, policy)]
    new_tier = TierRow(name, policy, description, _next_version(state, ops), num_users)
    if _tier_values(tier) == _tier_values(new_tier):
        assert tier is not None
        ops, new_tier = [], tier
    return Plan(
        ops,
        before,
        _applied(before, ops),
        tier_view(new_tier),
        tier_target(name),
        _tier_values(tier),
        _tier_values(new_tier),
        descriptions={name: description},
        version_before=tier.version if tier else None,
        version_after=new_tier.version,
    )


def put_tier(
    conn: Connection,
    state: State,
    *,
    name: str,
    rate: int | None,
    description: str | None,
    scope: Scope | None = None,
    enforcement: Enforcement | None = None,
    ceiling: int | None = None,
) -> Plan[TierOut]:
    """Set a tier's rate, scope, enforcement and ceiling (None: inherit the default's);
    a description of None keeps the one it had."""
    tier = repo.get_tier(conn, name)
    if description is None:
        description = tier.description if tier else ""
    return _set_tier(state, name, tier, Policy(rate, scope, enforcement, ceiling), description)


def patch_tier(
    conn: Connection, state: State, *, name: str, changes: Mapping[str, Any]
) -> Plan[TierOut]:
    """JSON merge patch of an existing tier: only the keys in `changes`
    ("output_tokens_per_second", "scope", "enforcement", "ceiling_output_tokens_per_second",
    "description") change; a
    description of null is empty. An unknown tier is 404: a patch never creates one (its
    rate would be a guess)."""
    tier = existing_tier(conn, name)
    description = changes.get("description", tier.description)
    policy = _merged_policy(tier.policy, changes)
    return _set_tier(state, name, tier, policy, description if description is not None else "")


def existing_tier(conn: Connection, name: str) -> TierRow:
    tier = repo.get_tier(conn, name)
    if tier is None:
        raise NotFound(f"tier {name!r} does not exist", field="name")
    return tier


def delete_tier(conn: Connection, state: State, *, name: str) -> Plan[None]:
    """Delete a tier; unknown: 404; with users assigned: 409."""
    tier = existing_tier(conn, name)
    # The EXISTS (one index probe) guards against the counter ever drifting.
    if tier.num_users or repo.tier_has_users(conn, name):
        raise Conflict(f"tier {name!r} still has {tier.num_users} users assigned", field="name")
    before = _tier_model(state, tier)
    ops: list[p.Op] = [p.DeleteTier(name=name)]
    return Plan(
        ops,
        before,
        _applied(before, ops),
        None,
        tier_target(name),
        _tier_values(tier),
        None,
        version_before=tier.version,
    )


# ---- the default --------------------------------------------------------------------


def put_default(
    conn: Connection,
    state: State,
    *,
    rate: int | None,
    scope: Scope | None = None,
    enforcement: Enforcement | None = None,
    ceiling: int | None = None,
) -> Plan[DefaultOut]:
    """Replace the default rate, scope (None: "fleet"), enforcement (None: "enforce") and
    ceiling (None: no borrowing)."""
    policy = Policy(rate, scope, enforcement, ceiling)
    _check_ceiling(policy.ceiling, policy.rate)
    before = LimitModel(state.default, config.tier_policies(conn))
    ops: list[p.Op] = [] if policy == state.default else [p.SetDefault.of(policy)]
    version = default_version(conn)
    return Plan(
        ops,
        before,
        _applied(before, ops),
        default_view(policy, _next_version(state, ops)),
        DEFAULT_TARGET,
        _policy_values(state.default),
        _policy_values(policy),
        version_before=version,
        version_after=_next_version(state, ops) if ops else version,
    )
