"""The engine's table of the limit model and of its fleet shares, flattened into limiter
calls (milli-tokens/s). The rules themselves are output_rate_core.limits.

What the limiter gets for a user (docs/fleet.md):
- an ``"engine"``-scoped limit: the whole rate;
- a ``"fleet"``-scoped limit: this engine's share while its lease holds; without one
  (no share yet, the share is 0, or the lease ran out) the safe share: the limit
  divided by the number of engines the control plane last said the fleet has;
- unlimited: nothing.
A limit in ``"shadow"`` goes to the limiter as a shadow rate (counted, never refused).
Users whose limit is the default (rate and enforcement) and who hold no share keep no
entry of their own: the limiter's default applies to them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine_ext.limiter import OutputRateLimiter
from output_rate_core import protocol as p
from output_rate_core.limits import (
    DEFAULT,
    ENGINE,
    EVERYONE,
    SHADOW,
    Effective,
    LimitModel,
    safe_share,
)
from output_rate_core.policy import Enforcement


@dataclass
class ShareState:
    """This engine's shares of fleet limits, as the control plane last sent them."""

    # user -> share (milli-tokens/s, > 0)
    shares: dict[str, int] = field(default_factory=dict)
    # None until a full Shares message of the current allocator arrived.
    epoch: int | None = None
    seq: int = 0
    lease_expires_ns: int | None = None
    num_dropped: int = 0


class LimitTable:
    """The control plane's model (default, tiers, users) and this engine's shares."""

    def __init__(self, model: LimitModel | None = None, num_engines: int = 1) -> None:
        self.model = model if model is not None else LimitModel()
        self.num_engines = num_engines
        self.fleet = ShareState()

    @classmethod
    def from_snapshot(cls, snapshot: p.Snapshot) -> LimitTable:
        return cls(LimitModel.from_snapshot(snapshot), snapshot.num_engines)

    def tier_of(self, user: str) -> str | None:
        return self.model.tier_of(user)

    def is_fleet_limited(self, user: str) -> bool:
        """True if the user's limit is split over the fleet (it reports demand for it)."""
        effective = self.model.effective(user)
        return effective.rate is not None and effective.scope != ENGINE

    # ---- what the limiter gets --------------------------------------------------

    @property
    def default_is_shadow(self) -> bool:
        return self.model.unconfigured.enforcement == SHADOW

    def default_milli(self) -> int | None:
        default = self.model.unconfigured
        if default.rate is None:
            return None
        if default.scope == ENGINE:
            return default.rate * p.MILLI
        return safe_share(default.rate * p.MILLI, self.num_engines)

    def _milli(
        self, user: str, effective: Effective, default_mode: Enforcement
    ) -> tuple[bool, int | None]:
        """(whether the user needs an entry of its own, its rate in milli-tokens/s);
        `default_mode`: the default's effective enforcement."""
        rate = effective.rate
        own = effective.source != DEFAULT or effective.enforcement != default_mode
        if rate is None:
            return own, None
        if effective.scope == ENGINE:
            return own, rate * p.MILLI
        share = self.fleet.shares.get(user)
        if share is not None:
            return True, share
        return own, safe_share(rate * p.MILLI, self.num_engines)

    def user_millis(self) -> dict[str, int | None]:
        """Every user's own limiter entry (users without one get the default)."""
        return self.user_millis_of((*self.model.users, *self.fleet.shares))

    def user_millis_of(self, users: Iterable[str]) -> dict[str, int | None]:
        """``user_millis`` of these users only."""
        effective = self.model.effective
        default_mode = self.model.unconfigured.enforcement
        millis: dict[str, int | None] = {}
        for user in users:
            own, milli = self._milli(user, effective(user), default_mode)
            if own:
                millis[user] = milli
        return millis

    def shadow_users(self, users: Iterable[str]) -> list[str]:
        """Those of ``users`` whose own limiter entry is in shadow."""
        effective = self.model.effective
        return [user for user in users if effective(user).enforcement == SHADOW]

    def load(self, limiter: OutputRateLimiter) -> None:
        """Hand the whole table to the limiter."""
        millis = self.user_millis()
        limiter.replace_all_milli(
            self.default_milli(),
            millis,
            default_shadow=self.default_is_shadow,
            shadow_users=self.shadow_users(millis),
        )

    def _sync(self, users: Iterable[str], limiter: OutputRateLimiter) -> None:
        effective = self.model.effective
        default_mode = self.model.unconfigured.enforcement
        for user in users:
            user_effective = effective(user)
            own, milli = self._milli(user, user_effective, default_mode)
            if own:
                limiter.set_milli_rate(user, milli, shadow=user_effective.enforcement == SHADOW)
            else:
                limiter.clear_rate(user)  # the limiter's own default applies

    # ---- changes ------------------------------------------------------------------

    def apply(self, op: p.Op, limiter: OutputRateLimiter) -> None:
        """One op of a delta."""
        model = self.model
        old = model.unconfigured
        changed = model.apply(op)
        if changed is EVERYONE:
            limiter.set_default_milli_rate(self.default_milli(), shadow=self.default_is_shadow)
            new = model.unconfigured
            if (new.scope, new.enforcement) != (old.scope, old.enforcement):
                self._sync([*self.model.users, *self.fleet.shares], limiter)
            else:
                self._sync(list(self.fleet.shares), limiter)
        else:
            self._sync(changed, limiter)

    def adopt_fleet(self, old: LimitTable) -> None:
        """Keep the shares of the table this one replaces (a snapshot is config only)."""
        self.fleet = old.fleet

    def apply_shares(self, message: p.Shares, limiter: OutputRateLimiter, now_ns: int) -> bool:
        """Apply a Shares message; False if it cannot be (a gap: ask for a full one).

        A duplicate or an older message is dropped (and counted) and answers True.
        """
        fleet = self.fleet
        if message.epoch != fleet.epoch:
            if not message.full:
                return False  # a delta of an allocator whose full table we never got
        elif message.seq <= fleet.seq:
            fleet.num_dropped += 1
            return True
        elif message.seq != fleet.seq + 1 and not message.full:
            return False
        fleet.epoch, fleet.seq = message.epoch, message.seq
        fleet.lease_expires_ns = now_ns + message.lease_ms * 1_000_000
        touched: set[str] = set()
        if message.full:
            touched.update(fleet.shares)
            fleet.shares = {}
        for user, share in message.shares.items():
            touched.add(user)
            if share > 0:
                fleet.shares[user] = share
            else:
                fleet.shares.pop(user, None)
        if message.num_engines != self.num_engines:
            self.num_engines = message.num_engines
            limiter.set_default_milli_rate(self.default_milli(), shadow=self.default_is_shadow)
            touched.update(self.model.users)
        self._sync(touched, limiter)
        return True

    def expire_lease(self, limiter: OutputRateLimiter, now_ns: int) -> bool:
        """Past the lease, every share falls back to the safe share; True if it did."""
        fleet = self.fleet
        if fleet.lease_expires_ns is None or now_ns <= fleet.lease_expires_ns:
            return False
        users = list(fleet.shares)
        fleet.shares = {}
        fleet.lease_expires_ns = None
        fleet.epoch = None  # only a full table is trusted after this
        self._sync(users, limiter)
        return True
