"""The engine's table of the limit model: how each op of the wire protocol changes the
limiter's per-user rates (the rule itself is output_rate_core.limits)."""

from __future__ import annotations

from engine_ext.limiter import OutputRateLimiter
from output_rate_core import protocol as p
from output_rate_core.limits import DEFAULT, effective_rate


class LimitTable:
    """The control plane's model (default, tiers, users), flattened into limiter calls.

    It keeps the tier and user tables because one op can change many users'
    effective rates (a tier's new rate applies to every user of that tier).
    """

    def __init__(self) -> None:
        self.default_rate: int | None = None
        self.tiers: dict[str, int | None] = {}
        # user -> (tier, override)
        self.users: dict[str, tuple[str | None, int | None]] = {}
        # tier -> users assigned to it
        self.members: dict[str, set[str]] = {}

    def tier_of(self, user: str) -> str | None:
        return self.users.get(user, (None, None))[0]

    def effective_user_rates(self) -> dict[str, int | None]:
        """Per-user limiter rates; users with neither tier nor override get the default."""
        rates: dict[str, int | None] = {}
        tiers = self.tiers
        for user, (tier, override) in self.users.items():
            rate, source = effective_rate(override, tier, tiers.get(tier) if tier else None, None)
            if source != DEFAULT:
                rates[user] = rate
        return rates

    @classmethod
    def from_snapshot(cls, snapshot: p.Snapshot) -> LimitTable:
        table = cls()
        table.default_rate = snapshot.default_rate
        table.tiers = dict(snapshot.tiers)
        table.users = dict(snapshot.users)
        for user, (tier, _) in table.users.items():
            if tier is not None:
                table.members.setdefault(tier, set()).add(user)
        return table

    def load(self, snapshot: p.Snapshot, limiter: OutputRateLimiter) -> None:
        """Take the snapshot's state and hand it to the limiter as a whole."""
        table = LimitTable.from_snapshot(snapshot)
        self.default_rate, self.tiers = table.default_rate, table.tiers
        self.users, self.members = table.users, table.members
        limiter.replace_all(self.default_rate, self.effective_user_rates())

    def apply(self, op: p.Op, limiter: OutputRateLimiter) -> None:
        if isinstance(op, p.SetUser):
            self._forget_user(op.user)
            self.users[op.user] = (op.tier, op.rate)
            if op.tier is not None:
                self.members.setdefault(op.tier, set()).add(op.user)
            self._sync_user(op.user, limiter)
        elif isinstance(op, p.DeleteUser):
            self._forget_user(op.user)
            limiter.clear_rate(op.user)
        elif isinstance(op, p.SetTier):
            self.tiers[op.name] = op.rate
            for user in self.members.get(op.name, ()):
                self._sync_user(user, limiter)
        elif isinstance(op, p.DeleteTier):
            self.tiers.pop(op.name, None)
            for user in self.members.pop(op.name, set()):
                self._sync_user(user, limiter)
        else:
            self.default_rate = op.rate
            limiter.set_default_rate(op.rate)

    def _forget_user(self, user: str) -> None:
        old = self.users.pop(user, None)
        if old is not None and old[0] is not None:
            self.members.get(old[0], set()).discard(user)

    def _sync_user(self, user: str, limiter: OutputRateLimiter) -> None:
        tier, override = self.users.get(user, (None, None))
        rate, source = effective_rate(override, tier, self.tiers.get(tier) if tier else None, None)
        if source == DEFAULT:
            limiter.clear_rate(user)  # the limiter's own default applies
        else:
            limiter.set_rate(user, rate)
