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

import math
from dataclasses import dataclass, field
from typing import Literal

from output_rate_core import protocol as p
from output_rate_core.outage import FRACTION, OutagePolicy
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


# What a message takes to arrive, at the most, in the bound's reckoning (docs/fleet.md).
DELIVERY_MARGIN_S = 1.0


def min_gone_after_s(lease_s: float, keep_s: float = 0.0) -> float:
    """The shortest ``gone_after_s`` under which the bound holds: an engine silent for
    ``lease_s`` is sent nothing more, but the last renewal it was sent (up to ``lease_s``
    after it was last heard) may arrive and be enforced for another ``lease_s`` (and
    ``keep_s`` past it, the "keep" outage policy); its part is free only after both, and a
    delivery (a one-way partition: the engine hears, the control plane does not)."""
    return 2 * lease_s + keep_s + DELIVERY_MARGIN_S


def kept_count_ttl_ns(lease_ms: int, keep_ms: int) -> int:
    """How long an engine keeps a serving count past the share it came with (from the
    arrival of the frame that withdrew the share): ``min_gone_after_s`` of the lease and
    keep time that frame carried, the least time any control plane keeps an engine it
    stopped hearing. The allocator keeps its record of the count at least that long
    (docs/fleet.md, "Outage policy": a count's age), so wherever the engine may still use
    the count while the control plane hears it, the allocator accounts for it; past it the
    engine uses the safe share of the whole fleet, which every allocator accounts."""
    return round(min_gone_after_s(lease_ms / 1000, keep_ms / 1000) * 1e9)


def outage_share(
    limit_milli: int, num_engines: int, num_serving: int | None, policy: OutagePolicy
) -> int:
    """What an engine enforces of a fleet limit (milli-tokens/s) once its lease ended (and
    a keep window after it): ``fraction`` x L in that mode; else L over the engines serving
    the user (``num_serving``, as the control plane said with the user's last share), and
    for a user it never had a count for (None) the safe share of the whole fleet. Both
    sides use it: the engine to enforce, the allocator to account what an engine may be
    enforcing. Never 0, like the safe share."""
    if policy.mode == FRACTION:
        return max(1, math.floor(limit_milli * policy.fraction))
    if num_serving is None:
        return safe_share(limit_milli, num_engines)
    return safe_share(limit_milli, num_serving)


@dataclass(frozen=True)
class Effective:
    """What one user is held to."""

    rate: int | None
    source: Source
    scope: Scope
    enforcement: Enforcement = ENFORCE
    # tokens/s the user may reach by borrowing idle capacity; None: none (its rate is a
    # hard limit). Always above the rate when set.
    ceiling: int | None = None


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
        else its tier's, else the default's, else the built-in one (BUILT_IN_*). A
        ceiling that does not exceed the resolved rate borrows nothing (None). A tier's
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
        ceiling = own.ceiling
        if tier_policy is not None:
            scope = scope if scope is not None else tier_policy.scope
            mode = mode if mode is not None else tier_policy.enforcement
            ceiling = ceiling if ceiling is not None else tier_policy.ceiling
        scope = scope if scope is not None else default.scope
        mode = mode if mode is not None else default.enforcement
        ceiling = ceiling if ceiling is not None else default.ceiling
        if rate is None or (ceiling is not None and ceiling <= rate):
            # Nothing to borrow: an unlimited user, or a ceiling inherited from a level
            # whose rate was lower than this user's (each level's own is >= its rate).
            ceiling = None
        return Effective(
            rate,
            source,
            scope if scope is not None else BUILT_IN_SCOPE,
            mode if mode is not None else BUILT_IN_ENFORCEMENT,
            ceiling,
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
