"""The rules of users' limits, tiers and the default limit: the reads, and the eight
writes, each made of its plan (control_plane/limits/plans.py). A write commits its plan's
ops through the config log (control_plane/config/): the version bumped once, in the same
transaction as the tables written from the ops, its audit entry and its change-log row;
a write that changes nothing writes nothing. It returns a `ConfigChange`: its answer and
the version it made. Its `preview` (?dry_run=true) diffs the same plan instead.

Each function takes the Connection of one transaction (control_plane.db.Database runs
it where its `@service` policy says); the caller commits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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
    return tier_view(plans.existing_tier(conn, name))


@service("read")
def get_default(conn: Connection) -> DefaultOut:
    state = config.state(conn)
    return default_view(state.default, state.version)


# ---- writes ----------------------------------------------------------------


class LimitWrite(Service[..., ConfigChange[T]], Generic[T]):
    """One limit write, made of its plan: `plan(conn, state, **request)` says what the
    write would do, or raises its errors. Run where `write` says, it takes the writers'
    lock, plans, and commits the plan's ops as the audit action `action`; its `preview`,
    run where `preview` says, plans at the version it reads and answers the diff."""

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

    def _commit(self, conn: Connection, /, *, actor: str, **request: Any) -> ConfigChange[T]:
        state = config.lock(conn)
        plan = self.plan(conn, state, **request)
        if not plan.ops:
            return ConfigChange(plan.answer, None)
        entry = audit.Entry(actor, self.action, plan.target, plan.was, plan.becomes)
        version = config.commit(
            conn, state, plan.ops, entry, model=plan.before, descriptions=plan.descriptions
        )
        return ConfigChange(plan.answer, version)

    def _preview(self, conn: Connection, /, *, items_limit: int, **request: Any) -> Preview:
        state = config.state(conn)
        return diff(conn, state.version, self.plan(conn, state, **request), items_limit)


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
