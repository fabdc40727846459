"""The engine's table of the limit model and of its fleet shares, flattened into limiter
calls (milli-tokens/s). The rules themselves are output_rate_core.limits.

What the limiter gets for a user (docs/fleet.md):
- an ``"engine"``-scoped limit: the whole rate;
- a ``"fleet"``-scoped limit: this engine's share while its lease holds; without one
  (no share yet, or the share is 0) the safe share: the limit divided by the number of
  engines the control plane last said the fleet has; once the lease ran out (and, with
  the "keep" outage policy, the time it keeps its shares past it) the outage share of
  the policy the control plane sent (output_rate_core.limits.outage_share): the limit
  over the engines serving the user, as said with its last share (kept after the share,
  for ``kept_count_ttl_ns`` from its withdrawal; users without a count: the safe share),
  or a fixed fraction of the limit for every fleet user;
- unlimited: nothing.
A limit in ``"shadow"`` goes to the limiter as a shadow rate (counted, never refused).
A ceiling (borrowing, docs/scheduler.md) is scaled like the rate: ``ceiling x what the
limiter gets / rate``, so a fleet user's ceilings summed over engines stay within its
fleet ceiling; a shadow limit's ceiling is ignored (shadow users are unlimited here).
Users whose limit is the default (rate and enforcement) and who hold no share keep no
entry of their own: the limiter's default applies to them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine_ext.limiter import OutputRateLimiter
from engine_ext.saved_state import SavedFleet
from output_rate_core import protocol as p
from output_rate_core.limits import (
    DEFAULT,
    ENGINE,
    EVERYONE,
    SHADOW,
    Effective,
    LimitModel,
    kept_count_ttl_ns,
    outage_share,
    safe_share,
)
from output_rate_core.outage import DEFAULT_OUTAGE, FRACTION, OutagePolicy
from output_rate_core.policy import Enforcement


@dataclass
class ShareState:
    """This engine's shares of fleet limits, as the control plane last sent them."""

    # user -> share (milli-tokens/s, > 0)
    shares: dict[str, int] = field(default_factory=dict)
    # None until a full Shares message of the current allocator arrived.
    epoch: int | None = None
    seq: int = 0
    # When the lease ends; the shares are kept until then plus the policy's keep time.
    lease_expires_ns: int | None = None
    num_dropped: int = 0
    # What to do when the lease ends, as the control plane last sent it.
    outage: OutagePolicy = DEFAULT_OUTAGE
    # user -> the engines serving it, as last sent with a share of it: kept past the lease
    # (the outage share divides by it) and past the share (a user whose requests paused
    # here when the control plane stopped gets it back when they resume); replaced by the
    # next full table.
    serving: dict[str, int] = field(default_factory=dict)
    # user -> when its count expires (engine clock, ns), for counts kept past their share:
    # the control plane keeps no count of this engine for the user any more, so the count
    # grows stale; it lasts ``kept_count_ttl_ns`` from the arrival of the frame that
    # withdrew the share (output_rate_core.limits), then the user is on the safe share of
    # the whole fleet. Counts of users holding a share are current (the control plane
    # sends each change) and, once the lease ended, are the outage's: no expiry.
    serving_until_ns: dict[str, int] = field(default_factory=dict)
    # The lease ran out and no table came since: fleet users are on their outage shares.
    in_outage: bool = False

    @property
    def kept_until_ns(self) -> int | None:
        """Until when the shares hold: the lease, and the policy's keep time past it."""
        if self.lease_expires_ns is None:
            return None
        return self.lease_expires_ns + int(self.outage.kept_s * 1e9)

    def held_users(self) -> list[str]:
        """Users this engine holds a share or a serving count of (a user may be in both)."""
        return [*self.shares, *self.serving]

    @property
    def fraction_outage(self) -> bool:
        """Every fleet user (the default's too) is on the policy's fraction of its limit."""
        return self.in_outage and self.outage.mode == FRACTION


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
        if self.fleet.fraction_outage:
            return outage_share(default.rate * p.MILLI, self.num_engines, None, self.fleet.outage)
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
        fleet = self.fleet
        share = fleet.shares.get(user)
        if share is not None:
            return True, share
        if fleet.in_outage:
            serving = fleet.serving.get(user)
            milli = outage_share(rate * p.MILLI, self.num_engines, serving, fleet.outage)
            return own or serving is not None, milli
        return own, safe_share(rate * p.MILLI, self.num_engines)

    def user_millis(self) -> dict[str, int | None]:
        """Every user's own limiter entry (users without one get the default)."""
        return self.user_millis_of(self.fleet_users())

    def fleet_users(self) -> list[str]:
        """Every user that may hold an entry of its own: configured, or holding a share
        (or, in an outage, a serving count)."""
        return [*self.model.users, *self.fleet.held_users()]

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

    def ceiling_milli(self, user: str) -> int | None:
        """The user's ceiling on this engine (milli-tokens/s; None: it borrows nothing)."""
        effective = self.model.effective(user)
        _, milli = self._milli(user, effective, self.model.unconfigured.enforcement)
        return _scaled_ceiling(effective, milli)

    def default_ceiling_milli(self) -> int | None:
        """The ceiling of users without one of their own in the limiter."""
        return _scaled_ceiling(self.model.unconfigured, self.default_milli())

    def user_ceilings(self) -> dict[str, int | None]:
        """Every user's own limiter ceiling (users without one get the default's)."""
        return self.user_ceilings_of(self.fleet_users())

    def user_ceilings_of(self, users: Iterable[str]) -> dict[str, int | None]:
        """``user_ceilings`` of these users only: those whose ceiling is not the default's."""
        default = self.default_ceiling_milli()
        ceilings: dict[str, int | None] = {}
        for user in users:
            ceiling = self.ceiling_milli(user)
            if ceiling != default:
                ceilings[user] = ceiling
        return ceilings

    def load(self, limiter: OutputRateLimiter) -> None:
        """Hand the whole table to the limiter."""
        millis = self.user_millis()
        limiter.replace_all_milli(
            self.default_milli(),
            millis,
            default_shadow=self.default_is_shadow,
            shadow_users=self.shadow_users(millis),
        )
        limiter.replace_ceilings(self.default_ceiling_milli(), self.user_ceilings())

    def _sync(self, users: Iterable[str], limiter: OutputRateLimiter) -> None:
        effective = self.model.effective
        default_mode = self.model.unconfigured.enforcement
        default_ceiling = self.default_ceiling_milli()
        for user in users:
            user_effective = effective(user)
            own, milli = self._milli(user, user_effective, default_mode)
            if own:
                limiter.set_milli_rate(user, milli, shadow=user_effective.enforcement == SHADOW)
            else:
                limiter.clear_rate(user)  # the limiter's own default applies
            ceiling = _scaled_ceiling(user_effective, milli)
            if ceiling != default_ceiling:
                limiter.set_milli_ceiling(user, ceiling)
            else:
                limiter.clear_ceiling(user)

    # ---- changes ------------------------------------------------------------------

    def apply(self, op: p.Op, limiter: OutputRateLimiter) -> None:
        """One op of a delta."""
        model = self.model
        old = model.unconfigured
        old_ceiling = self.default_ceiling_milli()
        changed = model.apply(op)
        if changed is EVERYONE:
            limiter.set_default_milli_rate(self.default_milli(), shadow=self.default_is_shadow)
            new_ceiling = self.default_ceiling_milli()
            limiter.set_default_milli_ceiling(new_ceiling)
            new = model.unconfigured
            if (new.scope, new.enforcement) != (old.scope, old.enforcement) or (
                new_ceiling != old_ceiling
            ):
                self._sync(self.fleet_users(), limiter)
            else:
                self._sync(self.fleet.held_users(), limiter)
        else:
            self._sync(changed, limiter)

    def adopt_fleet(self, old: LimitTable) -> None:
        """Keep the shares of the table this one replaces (a snapshot is config only), and
        the fleet size where it was larger: a snapshot counts only the engines its control
        plane knows when it is sent, which after that control plane's restart may be this
        one alone, while the others still enforce safe shares of the whole fleet. Only a
        Shares frame, from an allocator that heard the fleet, makes the fleet smaller
        (docs/fleet.md, "Bound holes")."""
        self.fleet = old.fleet
        self.num_engines = max(self.num_engines, old.num_engines)

    def apply_shares(self, message: p.Shares, limiter: OutputRateLimiter, now_ns: int) -> bool:
        """Apply a Shares message; False if it cannot be (a gap: ask for a full one).

        A duplicate or an older message is dropped (and counted) and answers True.
        """
        fleet = self.fleet
        if message.epoch != fleet.epoch:
            if not message.full:
                return False  # a delta of an allocator whose full table we never got
            if fleet.epoch is not None and message.epoch < fleet.epoch:
                # An older allocator's (or membership's) table arriving late, while the
                # lease of a newer one holds: dropped, never a step back.
                fleet.num_dropped += 1
                return True
        elif message.seq <= fleet.seq:
            fleet.num_dropped += 1
            return True
        elif message.seq != fleet.seq + 1 and not message.full:
            return False
        fleet.epoch, fleet.seq = message.epoch, message.seq
        fleet.lease_expires_ns = now_ns + message.lease_ms * 1_000_000
        touched: set[str] = set()
        # Back from an outage: the outage shares give way to shares and safe shares (with
        # the policy the outage ran under: a "fraction" one moved every fleet user).
        everyone = fleet.fraction_outage
        fleet.outage = message.outage_policy
        if fleet.in_outage:
            fleet.in_outage = False
            touched.update(fleet.serving)
        if message.full:
            touched.update(fleet.shares)
            fleet.shares = {}
            fleet.serving = {}
            fleet.serving_until_ns = {}
        expires_ns = now_ns + kept_count_ttl_ns(message.lease_ms, message.outage_keep_ms)
        for user, share in message.shares.items():
            touched.add(user)
            if share > 0:
                fleet.shares[user] = share
                fleet.serving_until_ns.pop(user, None)
                serving = message.serving.get(user)
                if serving is None:  # an older control plane: the safe share at lease end
                    fleet.serving.pop(user, None)
                else:
                    fleet.serving[user] = serving
            elif fleet.shares.pop(user, None) is not None and user in fleet.serving:
                # The count stays (ShareState.serving), for a while (serving_until_ns).
                fleet.serving_until_ns[user] = expires_ns
        if message.num_engines != self.num_engines or everyone:
            self.num_engines = message.num_engines
            limiter.set_default_milli_rate(self.default_milli(), shadow=self.default_is_shadow)
            limiter.set_default_milli_ceiling(self.default_ceiling_milli())
            touched.update(self.model.users)
        self._sync(touched, limiter)
        return True

    def expire_counts(self, limiter: OutputRateLimiter, now_ns: int) -> list[str]:
        """Drop the serving counts kept past their share whose time is up
        (``ShareState.serving_until_ns``); return their users. Each falls to the safe share
        of the whole fleet if its outage share divided by the count."""
        fleet = self.fleet
        until = fleet.serving_until_ns
        if not until:
            return []
        expired = [user for user, at_ns in until.items() if now_ns > at_ns]
        for user in expired:
            del until[user]
            fleet.serving.pop(user, None)
        if expired and fleet.in_outage:
            self._sync(expired, limiter)
        return expired

    def expire_lease(self, limiter: OutputRateLimiter, now_ns: int) -> bool:
        """Past the lease (and the policy's keep time), every fleet user falls to its outage
        share (output_rate_core.limits.outage_share); True if it did."""
        fleet = self.fleet
        kept_until = fleet.kept_until_ns
        if kept_until is None or now_ns <= kept_until:
            return False
        users = fleet.held_users()
        fleet.shares = {}
        fleet.lease_expires_ns = None
        fleet.epoch = None  # only a full table is trusted after this
        fleet.in_outage = True
        if fleet.fraction_outage:
            limiter.set_default_milli_rate(self.default_milli(), shadow=self.default_is_shadow)
            users.extend(self.model.users)
        self._sync(users, limiter)
        return True

    # ---- the saved state (engine_ext/saved_state.py) --------------------------------------

    def saved_fleet(self, now_ns: int, now_unix: float, lease_ms: int) -> SavedFleet:
        """The serving counts (with their expiry in Unix seconds) and the outage policy, to
        save; ``lease_ms``: the longest lease the control plane gave."""
        fleet, outage = self.fleet, self.fleet.outage
        return SavedFleet(
            serving=dict(fleet.serving),
            serving_until={
                user: now_unix + (until_ns - now_ns) / 1e9
                for user, until_ns in fleet.serving_until_ns.items()
            },
            outage=outage.mode,
            outage_keep_ms=round(outage.keep_s * 1000),
            outage_fraction=outage.fraction,
            lease_ms=lease_ms,
            in_outage=fleet.in_outage,
        )

    def restore_fleet(
        self, saved: SavedFleet, limiter: OutputRateLimiter, now_ns: int, now_unix: float
    ) -> None:
        """After a restart from the saved state (no lease, no share): the counts saved and
        their age (a count past its time is dropped), the outage policy; in the outage
        at once if it was in one, else once the lease it may have held (the longest the
        control plane gave, from now) and the keep time ended (``expire_lease``)."""
        fleet = self.fleet
        fleet.outage = OutagePolicy(
            saved.outage, saved.outage_keep_ms / 1000, saved.outage_fraction
        )
        fleet.serving = dict(saved.serving)
        fleet.serving_until_ns = {
            user: now_ns + round((until - now_unix) * 1e9)
            for user, until in saved.serving_until.items()
            if user in fleet.serving
        }
        for user, until_ns in list(fleet.serving_until_ns.items()):
            if until_ns < now_ns:
                del fleet.serving_until_ns[user]
                del fleet.serving[user]
        if saved.in_outage:
            fleet.in_outage = True
        elif saved.lease_ms:
            fleet.lease_expires_ns = now_ns + saved.lease_ms * 1_000_000
        self.load(limiter)


def _scaled_ceiling(effective: Effective, milli: int | None) -> int | None:
    """The ceiling of ``effective`` for a user the limiter holds to ``milli``: scaled by
    the same factor as the rate (an engine-scoped one: x 1000; a fleet share: x share /
    rate). None for shadow and unlimited users, and when nothing is left to borrow."""
    ceiling, rate = effective.ceiling, effective.rate
    if ceiling is None or rate is None or milli is None or effective.enforcement == SHADOW:
        return None
    scaled = ceiling * milli // rate
    return scaled if scaled > milli else None
