"""The limit model both sides share: the effective-rate and effective-scope rules, and
the model (default, tiers, users) as the wire protocol's ops change it.

A user's effective rate is its override if set, else its tier's rate, else the default
(``None`` is unlimited). Its scope follows the same precedence with ``None`` meaning
"inherit": the user's own, else its tier's, else the default's (``"fleet"`` unless set).
A ``"fleet"`` limit is what the user gets summed over every engine of one control plane
(engines enforce shares of it, docs/fleet.md); an ``"engine"`` limit is enforced in full
by each engine on its own.

Its enforcement follows the same precedence again (the default's is ``"enforce"`` unless
set). A ``"shadow"`` limit is computed as if enforced and what it would refuse is counted,
but nothing is refused: the engine schedules the user as an unlimited one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from output_rate_core import protocol as p

Source = Literal["override", "tier", "default"]
OVERRIDE: Source = "override"
TIER: Source = "tier"
DEFAULT: Source = "default"

Scope = p.Scope
FLEET: Scope = "fleet"
ENGINE: Scope = "engine"
DEFAULT_SCOPE: Scope = FLEET

Enforcement = p.Enforcement
ENFORCE: Enforcement = "enforce"
SHADOW: Enforcement = "shadow"
DEFAULT_ENFORCEMENT: Enforcement = ENFORCE


def effective_rate(
    override: int | None, tier: str | None, tier_rate: int | None, default_rate: int | None
) -> tuple[int | None, Source]:
    """(effective rate, where it comes from) of a user; ``tier_rate`` is ``tier``'s rate."""
    if override is not None:
        return override, OVERRIDE
    if tier is not None:
        return tier_rate, TIER
    return default_rate, DEFAULT


def effective_scope(
    scope: Scope | None, tier: str | None, tier_scope: Scope | None, default_scope: Scope | None
) -> Scope:
    """A user's scope: its own, else its tier's, else the default's, else ``"fleet"``."""
    if scope is not None:
        return scope
    if tier is not None and tier_scope is not None:
        return tier_scope
    return default_scope if default_scope is not None else DEFAULT_SCOPE


def effective_enforcement(
    enforcement: Enforcement | None,
    tier: str | None,
    tier_enforcement: Enforcement | None,
    default_enforcement: Enforcement | None,
) -> Enforcement:
    """A user's enforcement: its own, else its tier's, else the default's, else "enforce"."""
    if enforcement is not None:
        return enforcement
    if tier is not None and tier_enforcement is not None:
        return tier_enforcement
    return default_enforcement if default_enforcement is not None else DEFAULT_ENFORCEMENT


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
    enforcement: Enforcement = DEFAULT_ENFORCEMENT


_NO_USER: tuple[None, None, None, None] = (None, None, None, None)
_NO_TIER: tuple[None, None, None] = (None, None, None)

# What an op changed: the users named, or EVERYONE (the default changed).
EVERYONE = None


@dataclass
class LimitModel:
    """The control plane's configuration as both sides hold it in memory."""

    default_rate: int | None = None
    default_scope: Scope | None = None
    default_enforcement: Enforcement | None = None
    # tier -> (rate, scope, enforcement)
    tiers: dict[str, tuple[int | None, Scope | None, Enforcement | None]] = field(
        default_factory=dict
    )
    # user -> (tier, override rate, scope, enforcement)
    users: dict[str, tuple[str | None, int | None, Scope | None, Enforcement | None]] = field(
        default_factory=dict
    )
    # tier -> users assigned to it
    members: dict[str, set[str]] = field(default_factory=dict)

    @classmethod
    def from_snapshot(cls, snapshot: p.Snapshot) -> LimitModel:
        model = cls(
            default_rate=snapshot.default_rate,
            default_scope=snapshot.default_scope,
            default_enforcement=snapshot.default_enforcement,
        )
        tier_scopes, user_scopes = snapshot.tier_scopes, snapshot.user_scopes
        tier_modes, user_modes = snapshot.tier_enforcements, snapshot.user_enforcements
        model.tiers = {
            name: (rate, tier_scopes.get(name), tier_modes.get(name))
            for name, rate in snapshot.tiers.items()
        }
        model.users = {
            user: (tier, rate, user_scopes.get(user), user_modes.get(user))
            for user, (tier, rate) in snapshot.users.items()
        }
        for user, (tier, *_) in model.users.items():
            if tier is not None:
                model.members.setdefault(tier, set()).add(user)
        return model

    def tier_of(self, user: str) -> str | None:
        record = self.users.get(user)
        return None if record is None else record[0]

    def effective(self, user: str) -> Effective:
        tier, override, scope, mode = self.users.get(user, _NO_USER)
        tier_rate, tier_scope, tier_mode = self.tiers.get(tier, _NO_TIER) if tier else _NO_TIER
        rate, source = effective_rate(override, tier, tier_rate, self.default_rate)
        return Effective(
            rate,
            source,
            effective_scope(scope, tier, tier_scope, self.default_scope),
            effective_enforcement(mode, tier, tier_mode, self.default_enforcement),
        )

    @property
    def effective_default_scope(self) -> Scope:
        return self.default_scope if self.default_scope is not None else DEFAULT_SCOPE

    @property
    def effective_default_enforcement(self) -> Enforcement:
        mode = self.default_enforcement
        return mode if mode is not None else DEFAULT_ENFORCEMENT

    def apply(self, op: p.Op) -> set[str] | None:
        """Apply one op; return the users whose limit it may have changed (EVERYONE: all)."""
        if isinstance(op, p.SetUser):
            self._forget_user(op.user)
            self.users[op.user] = (op.tier, op.rate, op.scope, op.enforcement)
            if op.tier is not None:
                self.members.setdefault(op.tier, set()).add(op.user)
            return {op.user}
        if isinstance(op, p.DeleteUser):
            self._forget_user(op.user)
            return {op.user}
        if isinstance(op, p.SetTier):
            self.tiers[op.name] = (op.rate, op.scope, op.enforcement)
            return set(self.members.get(op.name, ()))
        if isinstance(op, p.DeleteTier):
            self.tiers.pop(op.name, None)
            return set(self.members.pop(op.name, set()))
        if isinstance(op, p.SetKey | p.DeleteKey):
            return set()  # an API key changes who a caller is, not anyone's limit
        self.default_rate, self.default_scope = op.rate, op.scope
        self.default_enforcement = op.enforcement
        return EVERYONE

    def _forget_user(self, user: str) -> None:
        old = self.users.pop(user, None)
        if old is not None and old[0] is not None:
            self.members.get(old[0], set()).discard(user)
