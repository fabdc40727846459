"""Per-user GCRA output-token limiter.

Pure Python: imports nothing from vLLM and reads time only through the
injected ``clock_ns``, so it can be driven by a fake clock in tests.

Each limited user keeps one theoretical arrival time (TAT). A token is allowed
when ``TAT - now <= burst``; taking it moves ``TAT = max(TAT, now) + 1/rate``.
Rates are held in milli-tokens/s (a fleet share can be a fraction of a token per
second, docs/fleet.md) and times are stored multiplied by that rate, so ``1/rate``
seconds is exactly ``TOKEN`` units and the arithmetic stays in integers.

A rate change re-scales the user's state at once: lowering keeps the
TAT at the same point in real time (the user waits at most one old interval);
raising re-prices the tokens still owed at the new rate (faster at once).

A user (or the default) can be in shadow: the hot path (``try_take``,
``take_many``, ``num_available``) sees it as unlimited, so the planner schedules it
as one, and ``shadow_take`` charges what it was served after the step on a GCRA
state of its own, exactly as ``take_many`` would have, counting what enforcement
would have refused. Switching between shadow and enforce moves the state across, so
enforcement starts from the user's real recent use.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping

from output_rate_core.protocol import MAX_SHARE, MILLI
from output_rate_core.rates import validate_rate

NS_PER_S = 1_000_000_000
# One token in scaled time units (ns x milli-tokens/s).
TOKEN = MILLI * NS_PER_S
DEFAULT_BURST_NS = 100_000_000
# The user of a request that names none (vllm_xargs.output_rate_user absent).
ANONYMOUS_USER = "__anonymous__"
# The key of a request's vllm_xargs (SamplingParams.extra_args) that names its user.
USER_ARG = "output_rate_user"


def _milli(rate: int | None) -> int | None:
    return None if rate is None else rate * MILLI


def _tokens_per_s(milli: int | None) -> float | None:
    """A milli rate in tokens/s (an int when whole)."""
    if milli is None:
        return None
    return milli // MILLI if milli % MILLI == 0 else milli / MILLI


def validate_milli_rate(milli: object, *, field: str = "rate") -> int | None:
    if milli is None:
        return None
    if isinstance(milli, bool) or not isinstance(milli, int) or not 1 <= milli <= MAX_SHARE:
        raise ValueError(f"{field} must be 1 ... {MAX_SHARE} milli-tokens/s, got {milli!r}")
    return milli


class _UserState:
    """GCRA state of one limited user, scaled by its current rate (milli-tokens/s)."""

    __slots__ = ("burst_scaled", "rate", "tat_scaled")

    def __init__(self, tat_scaled: int, rate: int, burst_ns: int) -> None:
        self.tat_scaled = tat_scaled
        self.rate = rate
        self.burst_scaled = burst_ns * rate

    def rescale(self, new_rate: int, now_ns: int, burst_ns: int) -> None:
        old_rate = self.rate
        debt = self.tat_scaled - now_ns * old_rate
        if new_rate > old_rate and debt > 0:
            # Raising: the tokens still owed are repaid at the new, faster
            # rate, so the user speeds up at once.
            self.tat_scaled = now_ns * new_rate + debt
        else:
            # Lowering: the TAT stays at the same point in real time (rounded
            # up), so the user waits at most one old interval, never a backlog
            # re-priced at the new rate.
            self.tat_scaled = -(-self.tat_scaled * new_rate // old_rate)
        self.rate = new_rate
        self.burst_scaled = burst_ns * new_rate


class OutputRateLimiter:
    def __init__(
        self,
        default_rate: int | None,
        user_rates: Mapping[str, int | None] | None = None,
        *,
        burst_ns: int = DEFAULT_BURST_NS,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if burst_ns < 0:
            raise ValueError(f"burst_ns must be >= 0, got {burst_ns}")
        self._burst_ns = burst_ns
        self._clock_ns = clock_ns
        self._default_rate = _milli(validate_rate(default_rate, field="default_rate"))
        # user -> override rate in milli-tokens/s (None = unlimited for that user).
        self._user_rates: dict[str, int | None] = {}
        # user -> GCRA state; only users limited at some point keep one.
        self._states: dict[str, _UserState] = {}
        # Shadow limits (milli-tokens/s): user -> its rate (its ``_user_rates`` entry is
        # None, so the hot path sees it unlimited), the default's when it is in shadow,
        # and user -> GCRA state of shadow-limited users.
        self._shadow_rates: dict[str, int] = {}
        self._shadow_default: int | None = None
        self._shadow_states: dict[str, _UserState] = {}
        for user, rate in (user_rates or {}).items():
            self._user_rates[user] = _milli(validate_rate(rate, field=f"rate of user {user!r}"))
        # Overrides with a finite rate; with the default, decides is_unlimited.
        self._num_limited_overrides = sum(r is not None for r in self._user_rates.values())
        # Cached so the scheduler can check it every step for free.
        self._is_unlimited = self._compute_unlimited()

    # ---- queries -------------------------------------------------------

    @property
    def default_rate(self) -> float | None:
        """tokens/s of users without their own rate (None: unlimited), shadow or not."""
        return _tokens_per_s(self._default_milli())

    def _default_milli(self) -> int | None:
        return self._shadow_default if self._shadow_default is not None else self._default_rate

    @property
    def default_is_shadow(self) -> bool:
        return self._shadow_default is not None

    @property
    def burst_ns(self) -> int:
        return self._burst_ns

    def user_rates(self) -> dict[str, float | None]:
        """The per-user overrides in tokens/s (shadow or not)."""
        shadow = self._shadow_rates
        return {
            user: _tokens_per_s(shadow.get(user, milli)) for user, milli in self._user_rates.items()
        }

    def rate_of(self, user: str) -> float | None:
        """The user's rate in tokens/s (None: unlimited)."""
        return _tokens_per_s(self.milli_rate_of(user))

    def milli_rate_of(self, user: str) -> int | None:
        """The user's rate, enforced or in shadow."""
        shadow = self.shadow_milli_of(user)
        # An override of None (unlimited) wins over the default.
        return shadow if shadow is not None else self._user_rates.get(user, self._default_rate)

    def shadow_milli_of(self, user: str) -> int | None:
        """The user's shadow rate (None: the user is not in shadow)."""
        if user in self._user_rates:
            return self._shadow_rates.get(user)
        return self._shadow_default

    def is_shadow(self, user: str) -> bool:
        return self.shadow_milli_of(user) is not None

    @property
    def is_unlimited(self) -> bool:
        """True when no user can ever be refused and none is in shadow."""
        return self._is_unlimited

    @property
    def has_shadow(self) -> bool:
        """True when some user may be in shadow (``shadow_take`` has work)."""
        return self._shadow_default is not None or bool(self._shadow_rates)

    def _compute_unlimited(self) -> bool:
        return (
            self._default_rate is None and self._num_limited_overrides == 0 and not self.has_shadow
        )

    @property
    def num_tracked_users(self) -> int:
        return len(self._states)

    # ---- hot path ------------------------------------------------------
    # Invariant: every state in ``_states`` is scaled by its user's current
    # (finite) rate, so the hot path needs a single dict lookup per user.

    def try_take(self, user: str) -> bool:
        state = self._states.get(user)
        if state is None:
            rate = self._user_rates.get(user, self._default_rate)
            if rate is None:
                return True
            self._states[user] = _UserState(self._clock_ns() * rate + TOKEN, rate, self._burst_ns)
            return True
        now_scaled = self._clock_ns() * state.rate
        tat = state.tat_scaled
        if tat - now_scaled > state.burst_scaled:
            return False
        state.tat_scaled = (tat if tat > now_scaled else now_scaled) + TOKEN
        return True

    def take_many(self, num_wanted: Mapping[str, int]) -> dict[str, int]:
        """Take up to ``n`` (>= 1) tokens for every ``user: n``, at one clock reading.

        Exactly ``n`` calls of ``try_take(user)`` (stopping at the first
        refusal) at a clock that does not move between them. Returns only the
        users that got fewer than they asked for, with the number they got.
        """
        now = self._clock_ns()
        states = self._states
        rates = self._user_rates
        default_rate = self._default_rate
        num_short: dict[str, int] = {}
        for user, num in num_wanted.items():
            state = states.get(user)
            if state is None:
                rate = rates.get(user, default_rate)
                if rate is None:
                    continue
                # A new user starts with its TAT at now, like try_take's first call.
                state = states[user] = _UserState(now * rate, rate, self._burst_ns)
            now_scaled = now * state.rate
            tat = state.tat_scaled
            base = tat if tat > now_scaled else now_scaled
            # Token i (from 0) is allowed iff base + i * TOKEN - now <= burst.
            slack = now_scaled + state.burst_scaled - base
            if slack < (num - 1) * TOKEN:
                # Short: only the tokens that fit in the slack.
                num = slack // TOKEN + 1 if slack >= 0 else 0
                num_short[user] = num
                if not num:
                    continue
            state.tat_scaled = base + num * TOKEN
        return num_short

    def shadow_take(self, num_served: Mapping[str, int]) -> dict[str, int]:
        """Charge shadow users what they were served: ``take_many`` on their shadow
        state, at one clock reading. ``num_served`` may name any users (those not in
        shadow are passed over). Returns user -> tokens enforcement would have refused,
        for the users it would have refused any."""
        now = self._clock_ns()
        states = self._shadow_states
        shadow_milli_of = self.shadow_milli_of
        num_refused: dict[str, int] = {}
        for user, num in num_served.items():
            state = states.get(user)
            if state is None:
                rate = shadow_milli_of(user)
                if rate is None or num <= 0:
                    continue
                state = states[user] = _UserState(now * rate, rate, self._burst_ns)
            now_scaled = now * state.rate
            tat = state.tat_scaled
            base = tat if tat > now_scaled else now_scaled
            slack = now_scaled + state.burst_scaled - base
            num_got = (
                num if slack >= (num - 1) * TOKEN else (slack // TOKEN + 1 if slack >= 0 else 0)
            )
            if num_got < num:
                num_refused[user] = num - num_got
            state.tat_scaled = base + num_got * TOKEN if num_got else tat
        return num_refused

    def num_available(self, user: str, limit: int) -> int:
        """How many of ``limit`` calls of ``try_take(user)`` would succeed now; takes none."""
        state = self._states.get(user)
        if state is None:
            rate = self._user_rates.get(user, self._default_rate)
            return limit if rate is None else min(limit, self._burst_ns * rate // TOKEN + 1)
        now_scaled = self._clock_ns() * state.rate
        tat = state.tat_scaled
        slack = now_scaled + state.burst_scaled - (tat if tat > now_scaled else now_scaled)
        return min(limit, slack // TOKEN + 1) if slack >= 0 else 0

    def refund(self, user: str, num: int = 1) -> None:
        """Give back ``num`` tokens taken in this step (exactly undoes the takes)."""
        state = self._states.get(user)
        if state is not None:
            state.tat_scaled -= num * TOKEN

    def ready_at_ns(self, user: str) -> int:
        """Earliest clock time at which ``try_take(user)`` can succeed."""
        state = self._states.get(user)
        if state is None:
            return 0
        # ceil((tat - burst) / rate), in unscaled ns
        return -(-(state.tat_scaled - state.burst_scaled) // state.rate)

    def with_clock(self, clock_ns: Callable[[], int]) -> OutputRateLimiter:
        """A limiter with the same rates and no user state, reading ``clock_ns``."""
        limiter = OutputRateLimiter(None, burst_ns=self._burst_ns, clock_ns=clock_ns)
        limiter.replace_all_milli(
            self._default_milli(),
            {user: self.milli_rate_of(user) for user in self._user_rates},
            default_shadow=self.default_is_shadow,
            shadow_users=self._shadow_rates.keys(),
        )
        return limiter

    # ---- hot swap ------------------------------------------------------

    def set_rate(self, user: str, rate: int | None) -> None:
        """The user's own rate in tokens/s (None: unlimited)."""
        validate_rate(rate, field=f"rate of user {user!r}")
        self.set_milli_rate(user, _milli(rate))

    def set_milli_rate(self, user: str, milli: int | None, *, shadow: bool = False) -> None:
        """The user's own rate; ``shadow``: counted, never refused."""
        validate_milli_rate(milli, field=f"rate of user {user!r}")
        self._forget_override(user)
        if shadow and milli is not None:
            self._shadow_rates[user] = milli
            milli = None
        self._user_rates[user] = milli
        self._num_limited_overrides += milli is not None
        self._sync_states([user])

    def clear_rate(self, user: str) -> None:
        self._forget_override(user)
        self._sync_states([user])

    def set_default_rate(self, rate: int | None) -> None:
        self.set_default_milli_rate(_milli(validate_rate(rate, field="default_rate")))

    def set_default_milli_rate(self, milli: int | None, *, shadow: bool = False) -> None:
        milli = validate_milli_rate(milli, field="default_rate")
        self._default_rate, self._shadow_default = (None, milli) if shadow else (milli, None)
        rates = self._user_rates
        self._sync_states([u for u in (*self._states, *self._shadow_states) if u not in rates])

    def replace_all(self, default_rate: int | None, user_rates: Mapping[str, int | None]) -> None:
        """Install a whole snapshot (tokens/s); users keep their TAT in real time."""
        new_default = validate_rate(default_rate, field="default_rate")
        self.replace_all_milli(
            _milli(new_default),
            {
                user: _milli(validate_rate(rate, field=f"rate of user {user!r}"))
                for user, rate in user_rates.items()
            },
        )

    def replace_all_milli(
        self,
        default_milli: int | None,
        user_millis: Mapping[str, int | None],
        *,
        default_shadow: bool = False,
        shadow_users: Collection[str] = (),
    ) -> None:
        """``replace_all`` in milli-tokens/s; the default and ``shadow_users`` in shadow."""
        new_default = validate_milli_rate(default_milli, field="default_rate")
        new_rates = {
            user: validate_milli_rate(milli, field=f"rate of user {user!r}")
            for user, milli in user_millis.items()
        }
        self._shadow_rates = {}
        for user in shadow_users:
            milli = new_rates.get(user)
            if milli is not None:
                self._shadow_rates[user] = milli
                new_rates[user] = None
        self._default_rate, self._shadow_default = (
            (None, new_default) if default_shadow else (new_default, None)
        )
        self._user_rates = new_rates
        self._num_limited_overrides = sum(r is not None for r in new_rates.values())
        self._sync_states([*self._states, *self._shadow_states])

    def cleanup_idle_users(self) -> None:
        """Forget users whose TAT is behind now; re-creating them is equivalent."""
        now = self._clock_ns()
        for states in (self._states, self._shadow_states):
            idle = [u for u, s in states.items() if s.tat_scaled <= now * s.rate]
            for user in idle:
                del states[user]

    def _sync_states(self, users: Iterable[str]) -> None:
        """Re-establish the invariant for ``users`` after their rate or enforcement
        changed: a state moves between enforced and shadow with its user, so the
        switch carries its recent use over."""
        now = self._clock_ns()
        enforced, shadow = self._states, self._shadow_states
        for user in users:
            state = enforced.pop(user, None)
            if state is None:
                state = shadow.pop(user, None)
                if state is None:
                    continue
            shadow_rate = self.shadow_milli_of(user)
            rate = (
                shadow_rate
                if shadow_rate is not None
                else self._user_rates.get(user, self._default_rate)
            )
            if rate is None:
                continue  # unlimited users keep no state
            if rate != state.rate:
                state.rescale(rate, now, self._burst_ns)
            (enforced if shadow_rate is None else shadow)[user] = state
        self._is_unlimited = self._compute_unlimited()

    def _forget_override(self, user: str) -> None:
        self._shadow_rates.pop(user, None)
        if self._user_rates.pop(user, None) is not None:
            self._num_limited_overrides -= 1
