"""The real impact of a limit write, computed without writing it (?dry_run=true): the
diff of the write's own plan (control_plane/limits/plans.py), which validated the request
with the write's rules and errors and holds the write's ops and the limit model before
and after them.

The diff adds to both models the users the ops may move that the plan did not read (a
tier's users, or everyone for a default change), reads the last hour of their usage
history in one statement, and compares every concerned user before and after:

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
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection

from control_plane.config.repository import UserRecord
from control_plane.limits import repository as repo
from control_plane.limits.plans import Plan
from control_plane.limits.schemas import MAX_BULK_ITEMS, Change
from control_plane.usage import repository as usage
from control_plane.usage.repository import MinuteTokens
from output_rate_core import protocol as p
from output_rate_core.limits import ENFORCE, UNCONFIGURED, Effective, LimitModel, UserPolicy

# A ChangePreview as JSON-ready values (the route encodes it as is).
Preview = dict[str, Any]
HOUR_S = 3600
MINUTE_S = 60


def _held(resolved: Effective) -> int | None:
    """The rate the user is held to (None: unlimited; shadow holds nobody)."""
    return resolved.rate if resolved.enforcement == ENFORCE else None


def _state(record: UserPolicy | None, resolved: Effective) -> dict[str, Any] | None:
    """An ItemState of a record (tier, own policy; None: none)."""
    if record is None:
        return None
    return {
        "tier": record[0],
        "output_tokens_per_second": record[1].rate,
        "effective_output_tokens_per_second": resolved.rate,
        "effective_scope": resolved.scope,
        "effective_enforcement": resolved.enforcement,
        "effective_ceiling_output_tokens_per_second": resolved.ceiling,
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
    users: Iterable[str],
    named: Container[str],
    before: LimitModel,
    after: LimitModel,
    history: Mapping[str, MinuteTokens],
    items_limit: int,
) -> Preview:
    """The preview of `users` (those in `named` listed even when nothing changes for them,
    the others only when their effective values change) from `before` to `after`."""
    downs: list[tuple[float, str, dict[str, Any]]] = []
    ups: list[dict[str, Any]] = []
    sames: list[dict[str, Any]] = []
    num_created = num_dropped = num_over = num_kept = 0
    # Records resolve by their values alone: thousands of users share a few of them.
    resolved: dict[tuple[bool, UserPolicy], Effective] = {}

    def resolve(record: UserPolicy | None, model: LimitModel) -> Effective:
        key = (model is after, record or UNCONFIGURED)
        found = resolved.get(key)
        if found is None:
            found = resolved[key] = model.resolve(*key[1])
        return found

    for user in users:
        was, becomes = before.users.get(user), after.users.get(user)
        old, new = resolve(was, before), resolve(becomes, after)
        if user not in named and old == new:
            continue
        old_held, new_held = _held(old), _held(new)
        change = _order(old_held, new_held)
        created = was is None and becomes is not None
        dropped = (
            was is not None
            and was[1].rate is not None
            and (becomes is None or becomes[1].rate is None)
        )
        last_hour = _last_hour(history.get(user), new_held)
        item = {
            "user": user,
            "change": change,
            "created": created,
            "override_dropped": dropped,
            "before": _state(was, old),
            "after": _state(becomes, new),
            "last_hour": last_hour,
        }
        num_created += created
        num_dropped += dropped
        # A record the write's ops leave as it is (a bulk write skips those).
        num_kept += was == becomes
        if change == "down":
            num_over += bool(last_hour and last_hour["num_minutes_over_new_limit"])
            downs.append((_cut_key(old_held, new_held), user, item))
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


def _concerned(conn: Connection, ops: Sequence[p.Op]) -> dict[str, UserRecord]:
    """The records of the users `ops` may move that a plan does not read: everyone's for a
    default change, a tier's users for a tier change (a plan holds the users it names)."""
    if any(isinstance(op, p.SetDefault) for op in ops):
        return repo.all_records(conn)
    records: dict[str, UserRecord] = {}
    for op in ops:
        if isinstance(op, p.SetTier | p.DeleteTier):
            records.update(repo.all_records(conn, tier=op.name))
    return records


def _history(conn: Connection, users: Sequence[str] | None) -> dict[str, MinuteTokens]:
    """The last hour of usage: every minute that overlaps it (the current one included),
    of `users` (None, or more than a bulk's worth: everyone, read without a user list)."""
    if users is not None and len(users) > MAX_BULK_ITEMS:
        users = None
    now = int(time.time())
    since = (now - HOUR_S) // MINUTE_S * MINUTE_S
    return usage.minute_tokens(conn, since=since, until=now + MINUTE_S, users=users)


def diff(conn: Connection, version: int, plan: Plan[Any], items_limit: int) -> Preview:
    """What `plan` (made at `version`) would change, user by user: the users it names,
    and those whose effective rate, scope or enforcement it moves. After a default change
    also the users seen in the last hour without a record (they follow the default)."""
    before, after = plan.before, plan.after
    concerned = {u: (r.tier, r.policy) for u, r in _concerned(conn, plan.ops).items()}
    if concerned:  # the ops leave their records as they are: the same in both models
        before = LimitModel(before.default, before.tiers, {**before.users, **concerned})
        after = LimitModel(after.default, after.tiers, {**after.users, **concerned})
    users = dict.fromkeys([*plan.named, *before.users, *after.users])
    if before.default != after.default:
        history = _history(conn, None)
        users.update(dict.fromkeys(history))
    else:
        history = _history(conn, list(users)) if users else {}
    return build(
        version=version,
        users=users,
        named=set(plan.named),
        before=before,
        after=after,
        history=history,
        items_limit=items_limit,
    )
