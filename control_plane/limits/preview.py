"""The real impact of a limit write, computed without writing it (?dry_run=true).

Each preview validates its input with the same rules as the write (the service's checks,
raising the same errors), reads what the write would change in a few bulk statements
(the config state, the tiers, the records concerned, one read of the last hour of usage
history) and compares every concerned user before and after:

- by the *held* rate: the effective rate where the effective enforcement is "enforce",
  unlimited under "shadow" (a shadow limit holds nobody back), so a shadow -> enforce
  flip is a cut and enforce -> shadow a raise;
- against the last hour of usage_minutes: a minute's rate is its tokens (summed over
  engines) / 60, "over" when it exceeds the new held rate. For an engine-scoped limit the
  stored history is still the fleet's sum while each engine enforces the full rate, so
  its over-limit figures are an upper bound (docs/control-plane.md, "Previewing a
  change").

Nothing here writes: no version, no audit entry, no change-log row (so no delta).
A preview is a plain dict of the ChangePreview shape (control_plane/limits/schemas.py,
which documents it): every value is computed here, and building and validating 10,000
pydantic items cost more than the whole computation.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from control_plane.config import service as config
from control_plane.config.repository import UserRecord
from control_plane.db import service
from control_plane.limits import repository as repo
from control_plane.limits import service as limits
from control_plane.limits.schemas import MAX_BULK_ITEMS, Change
from control_plane.limits.service import BulkInput, UserItem
from control_plane.usage import repository as usage
from control_plane.usage.repository import MinuteTokens
from output_rate_core.limits import ENFORCE, UNCONFIGURED, Effective, LimitModel
from output_rate_core.policy import Enforcement, Policy, Scope

# A ChangePreview as JSON-ready values (the route encodes it as is).
Preview = dict[str, Any]
HOUR_S = 3600
MINUTE_S = 60


@dataclass(frozen=True)
class Candidate:
    """A user the change may concern: its record before and after (None: no record);
    `listed`: shown even when nothing changes for it (the write names it)."""

    user: str
    before: UserRecord | None
    after: UserRecord | None
    listed: bool


def _resolve(record: UserRecord | None, world: LimitModel) -> Effective:
    """What a record (None: none, the default's) resolves to in `world`."""
    return world.resolve(*((record.tier, record.policy) if record else UNCONFIGURED))


def _held(resolved: Effective) -> int | None:
    """The rate the user is held to (None: unlimited; shadow holds nobody)."""
    return resolved.rate if resolved.enforcement == ENFORCE else None


def _state(record: UserRecord | None, resolved: Effective) -> dict[str, Any] | None:
    """An ItemState."""
    if record is None:
        return None
    return {
        "tier": record.tier,
        "output_tokens_per_second": record.policy.rate,
        "effective_output_tokens_per_second": resolved.rate,
        "effective_scope": resolved.scope,
        "effective_enforcement": resolved.enforcement,
    }


def _last_hour(minutes: MinuteTokens | None, held: int | None) -> dict[str, Any] | None:
    """A LastHour."""
    if minutes is None:
        return None
    # Integer comparison (tokens > rate * 60): exact, no float rounding at the edge. The
    # minutes are read only when the peak is over.
    over = (
        []
        if held is None or minutes.peak <= held * MINUTE_S
        else [t for t in minutes.values() if t > held * MINUTE_S]
    )
    return {
        "peak_output_tokens_per_second": minutes.peak / MINUTE_S,
        "num_minutes_over_new_limit": len(over),
        "max_over_new_limit_output_tokens_per_second": (
            max(over) / MINUTE_S - held if over and held is not None else 0.0
        ),
    }


def _order(before: int | None, after: int | None) -> Change:
    if before == after:
        return "same"
    if after is None:
        return "up"
    if before is None:
        return "down"
    return "down" if after < before else "up"


def _cut_key(before: int | None, after: int | None) -> float:
    """The share of the old held rate that remains (smaller: a larger relative cut);
    unlimited -> a limit remains nothing."""
    return 0.0 if before is None or after is None else after / before


def build(
    *,
    version: int,
    candidates: Iterable[Candidate],
    before: LimitModel,
    after: LimitModel,
    history: Mapping[str, MinuteTokens],
    items_limit: int,
) -> Preview:
    downs: list[tuple[float, str, dict[str, Any]]] = []
    ups: list[dict[str, Any]] = []
    sames: list[dict[str, Any]] = []
    num_created = num_dropped = num_over = num_kept = 0
    # Records resolve by their values alone: thousands of users share a few of them.
    resolved: dict[tuple[bool, Any], Effective] = {}

    def resolve(record: UserRecord | None, world: LimitModel) -> Effective:
        key = (world is after, record and record._replace(version=0))
        found = resolved.get(key)
        if found is None:
            found = resolved[key] = _resolve(record, world)
        return found

    for c in candidates:
        old = resolve(c.before, before)
        new = resolve(c.after, after)
        if not c.listed and old == new:
            continue
        old_held, new_held = _held(old), _held(new)
        change = _order(old_held, new_held)
        created = c.before is None and c.after is not None
        dropped = (
            c.before is not None
            and c.before.policy.rate is not None
            and (c.after is None or c.after.policy.rate is None)
        )
        last_hour = _last_hour(history.get(c.user), new_held)
        item = {
            "user": c.user,
            "change": change,
            "created": created,
            "override_dropped": dropped,
            "before": _state(c.before, old),
            "after": _state(c.after, new),
            "last_hour": last_hour,
        }
        num_created += created
        num_dropped += dropped
        # The write's own rule for a record it leaves as it is (a bulk write skips those).
        num_kept += limits.record_values(c.before) == limits.record_values(c.after)
        if change == "down":
            num_over += bool(last_hour and last_hour["num_minutes_over_new_limit"])
            downs.append((_cut_key(old_held, new_held), c.user, item))
        else:
            (ups if change == "up" else sames).append(item)
    downs.sort(key=lambda d: (d[0], d[1]))
    ups.sort(key=lambda i: str(i["user"]))
    sames.sort(key=lambda i: str(i["user"]))
    items = [d[2] for d in downs] + ups + sames
    return {
        "dry_run": True,
        "version": version,
        "num_users": len(items),
        "num_down": len(downs),
        "num_up": len(ups),
        "num_same": len(sames),
        "num_created": num_created,
        "num_overrides_dropped": num_dropped,
        "num_records_unchanged": num_kept,
        "num_over_new_limit": num_over,
        "items": items[:items_limit],
        "items_truncated": len(items) > items_limit,
    }


# ---- what each write would do ----------------------------------------------


def _world(conn: Connection) -> tuple[int, LimitModel]:
    """The config version, and the model records resolve in: the default and the tiers."""
    state = config.state(conn)
    return state.version, LimitModel(state.default, config.tier_policies(conn))


def _history(conn: Connection, users: Sequence[str] | None) -> dict[str, MinuteTokens]:
    """The last hour of usage: every minute that overlaps it (the current one included),
    of `users` (None, or more than a bulk's worth: everyone, read without a user list)."""
    if users is not None and len(users) > MAX_BULK_ITEMS:
        users = None
    now = int(time.time())
    since = (now - HOUR_S) // MINUTE_S * MINUTE_S
    return usage.minute_tokens(conn, since=since, until=now + MINUTE_S, users=users)


def _record(item: UserItem, version: int) -> UserRecord:
    return UserRecord(item.tier, item.policy, version)


def _users_preview(
    conn: Connection,
    version: int,
    world: LimitModel,
    pairs: Sequence[tuple[str, UserRecord | None, UserRecord | None]],
    items_limit: int,
) -> Preview:
    """Users named by the write, each with its record before and after."""
    users = [user for user, _, _ in pairs]
    history = _history(conn, users)
    candidates = [Candidate(u, b, a, listed=True) for u, b, a in pairs]
    return build(
        version=version,
        candidates=candidates,
        before=world,
        after=world,
        history=history,
        items_limit=items_limit,
    )


@service("read")
def put_limit(
    conn: Connection,
    *,
    user: str,
    rate: int | None,
    tier: str | None,
    scope: Scope | None,
    enforcement: Enforcement | None,
    items_limit: int,
) -> Preview:
    version, world = _world(conn)
    limits.tier_policy_of(conn, tier)
    record = repo.get_user(conn, user)
    after = _record(UserItem(user, tier, Policy(rate, scope, enforcement)), version)
    return _users_preview(conn, version, world, [(user, record, after)], items_limit)


@service("read")
def patch_limit(
    conn: Connection, *, user: str, changes: dict[str, Any], items_limit: int
) -> Preview:
    version, world = _world(conn)
    record = repo.get_user(conn, user)
    item = limits.patched_item(record, user, changes)
    limits.tier_policy_of(conn, item.tier)
    # A patch that sets nothing on an unconfigured user creates no record (as the write).
    unchanged = record is None and item == UserItem(user, None)
    after = None if unchanged else _record(item, version)
    return _users_preview(conn, version, world, [(user, record, after)], items_limit)


@service("read")
def delete_limit(conn: Connection, *, user: str, items_limit: int) -> Preview:
    version, world = _world(conn)
    record = repo.get_user(conn, user)
    return _users_preview(conn, version, world, [(user, record, None)], items_limit)


@service("scan")
def bulk_put_limits(
    conn: Connection,
    *,
    items: Sequence[UserItem],
    lines: Sequence[int] | None = None,
    problems: Sequence[Any] = (),
    items_limit: int,
) -> Preview:
    version, world = _world(conn)
    limits.check_bulk(BulkInput(items, lines, problems), world.tiers)
    records = config.user_records(conn, [i.user for i in items])
    pairs = [(i.user, records.get(i.user), _record(i, version)) for i in items]
    return _users_preview(conn, version, world, pairs, items_limit)


def _tier_preview(
    conn: Connection,
    *,
    name: str,
    tier: repo.TierRow | None,
    policy: Policy,
    items_limit: int,
) -> Preview:
    """The users of tier `name` (now `tier`, None: new) whose values change with `policy`."""
    version, world = _world(conn)
    after = LimitModel(world.default, {**world.tiers, name: policy})
    records = repo.all_records(conn, tier=name) if tier and tier.num_users else {}
    users = list(records)
    history = _history(conn, users) if users else {}
    return build(
        version=version,
        candidates=[Candidate(u, r, r, listed=False) for u, r in records.items()],
        before=world,
        after=after,
        history=history,
        items_limit=items_limit,
    )


@service("scan")
def put_tier(
    conn: Connection,
    *,
    name: str,
    rate: int | None,
    scope: Scope | None,
    enforcement: Enforcement | None,
    items_limit: int,
) -> Preview:
    policy = Policy(rate, scope, enforcement)
    tier = repo.get_tier(conn, name)
    return _tier_preview(conn, name=name, tier=tier, policy=policy, items_limit=items_limit)


@service("scan")
def patch_tier(
    conn: Connection, *, name: str, changes: dict[str, Any], items_limit: int
) -> Preview:
    tier = limits.existing_tier(conn, name)
    policy = limits.patched_tier_policy(tier, changes)
    return _tier_preview(conn, name=name, tier=tier, policy=policy, items_limit=items_limit)


@service("read")
def delete_tier(conn: Connection, *, name: str, items_limit: int) -> Preview:
    version, world = _world(conn)
    limits.deletable_tier(conn, name)
    # A tier is deleted only without users: nobody's limit changes.
    return build(
        version=version,
        candidates=(),
        before=world,
        after=world,
        history={},
        items_limit=items_limit,
    )


@service("scan")
def put_default(
    conn: Connection,
    *,
    rate: int | None,
    scope: Scope | None,
    enforcement: Enforcement | None,
    items_limit: int,
) -> Preview:
    """Every configured user whose effective values change, and the users seen in the
    last hour with no record (they follow the default)."""
    version, world = _world(conn)
    after = LimitModel(Policy(rate, scope, enforcement), world.tiers)
    records = repo.all_records(conn)
    history = _history(conn, None)
    candidates = [Candidate(u, r, r, listed=False) for u, r in records.items()]
    candidates += [Candidate(u, None, None, listed=False) for u in history if u not in records]
    return build(
        version=version,
        candidates=candidates,
        before=world,
        after=after,
        history=history,
        items_limit=items_limit,
    )
