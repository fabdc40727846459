"""The rules of users' limits, tiers and the default limit: the reads, and the eight
writes, each made of its plan (control_plane/limits/plans.py). A write commits its plan's
ops through the config log (control_plane/config/): the version bumped once, in the same
transaction as the tables written from the ops, its audit entry and its change-log row;
a write that changes nothing writes nothing. It returns a `ConfigChange`: its answer and
the version it made. Its `preview` (?dry_run=true) diffs the same plan instead.

Versioned writes: a write of a user, a tier or the default may carry the If-Match its
client read as the record's ETag (`Versioned.version`); it is checked against the plan's
`version_before`, after the writers' lock and the plan's own checks, so no other writer
can slip in between, and a write whose condition fails writes nothing (412).

Each function takes the Connection of one transaction (control_plane.db.Database runs
it where its `@service` policy says); the caller commits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

from sqlalchemy import Connection

from control_plane import db
from control_plane.audit import service as audit
from control_plane.config import service as config
from control_plane.db import ConfigChange, Service, service
from control_plane.deps import FleetView, UsageSource
from control_plane.errors import InvalidInput
from control_plane.limits import plans
from control_plane.limits import repository as repo
from control_plane.limits.plans import Plan
from control_plane.limits.preview import Preview, diff
from control_plane.limits.schemas import (
    BulkOut,
    DefaultOut,
    LimitDetail,
    LimitOut,
    LimitPage,
    TierList,
    TierOut,
)
from control_plane.limits.views import default_view, limit_view, shares_view, tier_view
from control_plane.preconditions import IfMatch, PreconditionFailed, etag
from output_rate_core.limits import LimitModel

T = TypeVar("T")


@dataclass(frozen=True)
class UserCounts:
    """The config version and default, and the configured users (maintained counters)."""

    version: int
    default_rate: int | None
    num_users: int
    # tier -> users assigned to it
    num_users_per_tier: dict[str, int]


class Versioned(NamedTuple, Generic[T]):
    """A record's view and the version its ETag names (what a write's If-Match must say)."""

    view: T
    version: int


# ---- reads -----------------------------------------------------------------


def _limit(conn: Connection, user: str) -> Versioned[LimitOut]:
    row = repo.get_limit_row(conn, user)
    tier = row.record.tier if row.record else None
    tiers = {tier: row.tier} if tier is not None and row.tier is not None else {}
    model = LimitModel(row.state.default, tiers)
    view = limit_view(user, row.record, model, row.state.version)
    return Versioned(view, plans.user_version(row.record))


@service("read")
def get_limit(conn: Connection, *, user: str) -> LimitOut:
    return _limit(conn, user).view


@service("read")
def get_limit_detail(
    conn: Connection, *, user: str, fleet: FleetView, usage: UsageSource
) -> Versioned[LimitDetail]:
    """The user's view with the shares engines hold and the rate they report now."""
    view, version = _limit(conn, user)
    received = usage.rate_1s(user)
    detail = LimitDetail(
        **view.model_dump(exclude={"shares"}),
        shares=shares_view(view, fleet),
        received_output_tokens_per_second=received,
    )
    return Versioned(detail, version)


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
def get_tier(conn: Connection, *, name: str) -> Versioned[TierOut]:
    tier = plans.existing_tier(conn, name)
    return Versioned(tier_view(tier), tier.version)


@service("read")
def get_default(conn: Connection) -> Versioned[DefaultOut]:
    """The default and the version of its last change (the `version` field is the
    config's now: once engines applied it, the default shown is enforced)."""
    state = config.state(conn)
    return Versioned(default_view(state.default, state.version), plans.default_version(conn))


# ---- writes ----------------------------------------------------------------


def check_precondition(if_match: IfMatch | None, plan: Plan[Any]) -> None:
    """Refuse (412) a versioned write whose If-Match does not name the version of the
    record it replaces; None: an unconditional write."""
    if if_match is None or if_match.matches(plan.version_before):
        return
    current = plan.version_before
    kind, name = plan.target.kind, plan.target.id
    what = "the default limit" if kind == "default" else f"{kind} {name!r}"
    if current is None:
        message = f"If-Match: {if_match}: {what} does not exist; nothing was written"
    else:
        message = (
            f"If-Match: {if_match} is not the version of {what}, which is now "
            f"{etag(current)} (it changed since it was read); nothing was written"
        )
    raise PreconditionFailed(message, current_version=current)


class LimitWrite(Service[..., ConfigChange[T]], Generic[T]):
    """One limit write, made of its plan: `plan(conn, state, **request)` says what the
    write would do, or raises its errors. Run where `write` says, it takes the writers'
    lock, plans, checks the request's If-Match (`if_match`, check_precondition) and
    commits the plan's ops as the audit action `action`; its `preview`, run where
    `preview` says, plans at the version it reads, checks alike and answers the diff.
    A request that would fail anyway (404, 409, 422) fails so, whatever its If-Match
    (RFC 9110 section 13.2.1)."""

    def __init__(
        self,
        plan: Callable[..., Plan[T]],
        *,
        action: str,
        write: db.Policy = "write",
        preview: db.Policy = "read",
    ) -> None:
        super().__init__(self._commit, write)
        self.plan = plan
        self.action = action
        self.preview: Service[..., Preview] = Service(self._preview, preview)

    def _commit(
        self, conn: Connection, /, *, actor: str, if_match: IfMatch | None = None, **request: Any
    ) -> ConfigChange[T]:
        state = config.lock(conn)
        plan = self.plan(conn, state, **request)
        check_precondition(if_match, plan)
        if not plan.ops:
            return ConfigChange(plan.answer, None, plan.version_after)
        entry = audit.Entry(actor, self.action, plan.target, plan.was, plan.becomes)
        commit = config.commit(
            conn, state, plan.ops, entry, model=plan.before, descriptions=plan.descriptions
        )
        return ConfigChange(plan.answer, commit, plan.version_after)

    def _preview(
        self,
        conn: Connection,
        /,
        *,
        items_limit: int,
        if_match: IfMatch | None = None,
        **request: Any,
    ) -> Preview:
        state = config.state(conn)
        plan = self.plan(conn, state, **request)
        check_precondition(if_match, plan)
        return diff(conn, state.version, plan, items_limit)


put_limit: LimitWrite[LimitOut] = LimitWrite(plans.put_limit, action="put_limit")
patch_limit: LimitWrite[LimitOut] = LimitWrite(plans.patch_limit, action="patch_limit")
delete_limit: LimitWrite[None] = LimitWrite(plans.delete_limit, action="delete_limit")
# Up to 10,000 users: on the writer thread, and its preview off the event loop.
bulk_put_limits: LimitWrite[BulkOut] = LimitWrite(
    plans.bulk_put_limits, action="bulk_put_limits", write="write_batch", preview="scan"
)
# A tier's or the default's preview reads the users it moves: as many as there are.
put_tier: LimitWrite[TierOut] = LimitWrite(plans.put_tier, action="put_tier", preview="scan")
patch_tier: LimitWrite[TierOut] = LimitWrite(plans.patch_tier, action="patch_tier", preview="scan")
delete_tier: LimitWrite[None] = LimitWrite(plans.delete_tier, action="delete_tier")
put_default: LimitWrite[DefaultOut] = LimitWrite(
    plans.put_default, action="put_default", preview="scan"
)
