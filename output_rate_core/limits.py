"""The limit model both sides share: the default, the tiers and the users, each a
`Policy` (output_rate_core/policy.py), as the wire protocol's ops change it, and the one
rule that says what a user is held to (`LimitModel.resolve`).

A ``"fleet"`` limit is what the user gets summed over every engine of one control plane
(engines enforce shares of it, docs/fleet.md); an ``"engine"`` limit is enforced in full
by each engine on its own. A ``"shadow"`` limit is computed as if enforced and what it
would refuse is counted, but nothing is refused: the engine schedules the user as an
unlimited one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from output_rate_core import protocol as p
from output_rate_core.policy import NO_POLICY, Enforcement, Policy, Scope

Source = Literal["override", "tier", "default"]
OVERRIDE: Source = "override"
TIER: Source = "tier"
DEFAULT: Source = "default"

FLEET: Scope = "fleet"
ENGINE: Scope = "engine"
ENFORCE: Enforcement = "enforce"
SHADOW: Enforcement = "shadow"
# What a field resolves to when neither the user, nor its tier, nor the default sets it
# (a rate: unlimited).
BUILT_IN_SCOPE: Scope = FLEET
BUILT_IN_ENFORCEMENT: Enforcement = ENFORCE

# A user: (its tier or None, its own policy).
UserPolicy = tuple[str | None, Policy]
# What the model holds for a user nobody configured.
UNCONFIGURED: UserPolicy = (None, NO_POLICY)


def safe_share(limit_milli: int, num_engines: int) -> int:
    """What an engine enforces of a fleet limit (milli-tokens/s) when it holds no valid
    share: its part if the fleet were split evenly, so engines on their own sum to at most
    the limit (and never 0: a user is never stopped outright)."""
    return max(1, limit_milli // max(1, num_engines))


@dataclass(frozen=True)
class Effective:
    """What one user is held to."""

    rate: int | None
    source: Source
    scope: Scope
    enforcement: Enforcement = ENFORCE


# What an op changed: the users named, or EVERYONE (the default changed).
EVERYONE = None


@dataclass
class LimitModel:
    """The control plane's configuration as both sides hold it in memory."""

    default: Policy = NO_POLICY
    # tier -> its policy
    tiers: dict[str, Policy] = field(default_factory=dict)
    # user -> (its tier or None, its own policy)
    users: dict[str, UserPolicy] = field(default_factory=dict)
    # tier -> users assigned to it
    members: dict[str, set[str]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        for user, (tier, _) in self.users.items():
            if tier is not None:
                self.members.setdefault(tier, set()).add(user)

    @classmethod
    def from_snapshot(cls, snapshot: p.Snapshot) -> LimitModel:
        return cls(snapshot.default_policy, snapshot.tier_policies(), snapshot.user_policies())

    def copy(self) -> LimitModel:
        """A model to apply ops to without changing this one (policies are immutable)."""
        return LimitModel(self.default, dict(self.tiers), dict(self.users))

    def tier_of(self, user: str) -> str | None:
        return self.users.get(user, UNCONFIGURED)[0]

    def effective(self, user: str) -> Effective:
        tier, own = self.users.get(user, UNCONFIGURED)
        return self.resolve(tier, own)

    def resolve(self, tier: str | None, own: Policy) -> Effective:
        """What a user of `tier` (None: none) with its `own` policy is held to here.

        The inheritance rule, written only here: each field is the user's own value,
        else its tier's, else the default's, else the built-in one (BUILT_IN_*). A tier's
        rate is its users' even when None: an unlimited tier makes its users unlimited
        (a tier that is not in the model, too)."""
        default = self.default
        tier_policy = None if tier is None else self.tiers.get(tier, NO_POLICY)
        rate: int | None
        if own.rate is not None:
            rate, source = own.rate, OVERRIDE
        elif tier_policy is not None:
            rate, source = tier_policy.rate, TIER
        else:
            rate, source = default.rate, DEFAULT
        scope = own.scope
        mode = own.enforcement
        if tier_policy is not None:
            scope = scope if scope is not None else tier_policy.scope
            mode = mode if mode is not None else tier_policy.enforcement
        scope = scope if scope is not None else default.scope
        mode = mode if mode is not None else default.enforcement
        return Effective(
            rate,
            source,
            scope if scope is not None else BUILT_IN_SCOPE,
            mode if mode is not None else BUILT_IN_ENFORCEMENT,
        )

    @property
    def unconfigured(self) -> Effective:
        """What a user nobody configured is held to: the default, resolved."""
        return self.resolve(None, NO_POLICY)

    def apply(self, op: p.Op) -> set[str] | None:
        """Apply one op; return the users whose limit it may have changed (EVERYONE: all)."""
        if isinstance(op, p.SetUser):
            self._forget_user(op.user)
            self.users[op.user] = (op.tier, op.policy)
            if op.tier is not None:
                self.members.setdefault(op.tier, set()).add(op.user)
            return {op.user}
        if isinstance(op, p.DeleteUser):
            self._forget_user(op.user)
            return {op.user}
        if isinstance(op, p.SetTier):
            self.tiers[op.name] = op.policy
            return set(self.members.get(op.name, ()))
        if isinstance(op, p.DeleteTier):
            self.tiers.pop(op.name, None)
            return set(self.members.pop(op.name, set()))
        if isinstance(op, p.SetKey | p.DeleteKey):
            return set()  # an API key changes who a caller is, not anyone's limit
        self.default = op.policy
        return EVERYONE

    def _forget_user(self, user: str) -> None:
        tier = self.users.pop(user, UNCONFIGURED)[0]
        if tier is not None:
            self.members.get(tier, set()).discard(user)
