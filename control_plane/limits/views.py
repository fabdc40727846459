"""What the limit routes answer, built from rows and a limit model: the views of a user,
a tier and the default. No reads and no rules of their own: a user's effective values
come from the model's resolver (output_rate_core.limits.LimitModel.resolve)."""

from __future__ import annotations

from control_plane.config.repository import UserRecord
from control_plane.deps import FleetView
from control_plane.limits.repository import TierRow
from control_plane.limits.schemas import DefaultOut, LimitOut, ShareOut, TierOut
from output_rate_core import protocol as p
from output_rate_core.limits import FLEET, UNCONFIGURED, LimitModel
from output_rate_core.policy import Policy


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
        ceiling_output_tokens_per_second=own.ceiling,
        effective_ceiling_output_tokens_per_second=effective.ceiling,
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


def tier_view(tier: TierRow) -> TierOut:
    return TierOut(
        name=tier.name,
        output_tokens_per_second=tier.policy.rate,
        scope=tier.policy.scope,
        enforcement=tier.policy.enforcement,
        ceiling_output_tokens_per_second=tier.policy.ceiling,
        description=tier.description,
        num_users=tier.num_users,
        version=tier.version,
    )


def default_view(default: Policy, version: int) -> DefaultOut:
    return DefaultOut(
        output_tokens_per_second=default.rate,
        scope=default.scope,
        enforcement=default.enforcement,
        ceiling_output_tokens_per_second=default.ceiling,
        version=version,
    )
