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
raising keeps the user's credit and re-prices the tokens still owed at the new
rate (faster at once, and no burst from the raise itself).

A user (or the default) can be in shadow: the hot path (``try_take``,
``take_many``, ``num_available``) sees it as unlimited, so the planner schedules it
as one, and ``shadow_take`` charges what it was served after the step on a GCRA
state of its own, exactly as ``take_many`` would have, counting what enforcement
would have refused. Switching between shadow and enforce moves the state across, so
enforcement starts from the user's real recent use.

Borrowing (docs/scheduler.md, "Borrowing"): a user with an enforced rate may carry a
ceiling above it. Its tokens beyond the rate are *borrowed*: they never touch the rate
state, only a second GCRA state at the extra rate (ceiling - rate, same burst), so in any
window the rate's tokens and the borrowed ones together stay within the ceiling's bound
(plus one token). Borrowed tokens are also charged to a virtual counter per user,
``1/rate`` per token, which the planner uses to share spare capacity among borrowers in
proportion to their rates; a borrower coming back is lifted to the virtual time of the
last token lent in that order, so idle time is never banked. The planner alone decides
when a token may be borrowed (only when no other user needs the capacity). Shadow and
unlimited users never borrow: a ceiling counts only on top of an enforced rate.
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
        if new_rate > old_rate:
            # Raising: the user keeps its credit (the tokens it may take at once:
            # the old burst less what it owes). What it owes is repaid at the new,
            # faster rate, so it speeds up at once; the larger burst fills at the new
            # rate, never at once: a rate moved up and down again (a fleet share)
            # adds no burst (docs/fleet.md, "The bound").
            debt = max(0, self.tat_scaled - now_ns * old_rate)
            self.tat_scaled = now_ns * new_rate + burst_ns * (new_rate - old_rate) + debt
        else:
            # Lowering: the TAT stays at the same point in real time (rounded
            # up), so the user waits at most one old interval, never a backlog
            # re-priced at the new rate.
            self.tat_scaled = -(-self.tat_scaled * new_rate // old_rate)
        self.rate = new_rate
        self.burst_scaled = burst_ns * new_rate

    def take(self, now_ns: int) -> bool:
        """One GCRA step at ``now_ns``: take a token if it fits the burst."""
        now_scaled = now_ns * self.rate
        tat = self.tat_scaled
        if tat - now_scaled > self.burst_scaled:
            return False
        self.tat_scaled = (tat if tat > now_scaled else now_scaled) + TOKEN
        return True


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
        # Ceilings (milli-tokens/s): user -> its own (None: none), else the default's.
        # Only read for users with an enforced finite rate (``borrow_milli_of``).
        self._ceilings: dict[str, int | None] = {}
        self._default_ceiling: int | None = None
        self._num_user_ceilings = 0  # entries of ``_ceilings`` that are not None
        # user -> GCRA state of its borrowed tokens, at the extra rate (re-scaled lazily
        # when the rate or the ceiling changed).
        self._borrow_states: dict[str, _UserState] = {}
        # user -> virtual time (ns x 1/rate per borrowed token), and the virtual time of
        # the last token lent: the weighted-fair order of borrowers.
        self._vtimes: dict[str, int] = {}
        self._vclock = 0
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
    def has_ceilings(self) -> bool:
        """True when some user may borrow (the planner's borrowing pass has work)."""
        return self._default_ceiling is not None or self._num_user_ceilings > 0

    def ceiling_milli_of(self, user: str) -> int | None:
        """The ceiling set for the user, its own or the default's (None: none)."""
        ceilings = self._ceilings
        return ceilings.get(user, self._default_ceiling)

    def borrow_milli_of(self, user: str) -> int | None:
        """ceiling - rate: how fast the user may borrow (None: it may not; shadow and
        unlimited users never do)."""
        rate = self._user_rates.get(user, self._default_rate)
        if rate is None:
            return None
        ceilings = self._ceilings
        ceiling = ceilings.get(user, self._default_ceiling)
        if ceiling is None or ceiling <= rate:
            return None
        return ceiling - rate

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
        return state.take(self._clock_ns())

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

    # ---- borrowing -------------------------------------------------------

    def borrow_tag(self, user: str) -> int:
        """The user's virtual time, lifted to that of the last token lent: the lowest
        tag borrows first (a user coming back banks nothing for its idle time)."""
        vtime = self._vtimes.get(user, 0)
        if vtime < self._vclock:
            vtime = self._vtimes[user] = self._vclock
        return vtime

    def try_borrow(self, user: str, *, in_order: bool = True) -> bool:
        """Lend the user one token beyond its rate if its ceiling allows it now (the
        planner decides whether capacity is spare). Charges the borrow state and the
        virtual time, never the rate state.

        ``in_order``: the token goes to the lowest tag (the planner's lending order), so
        its tag is the virtual clock's new reading. A token lent out of that order (at
        admission, in queue order) charges the user but leaves the clock: moved up to a
        tag above other borrowers', it would lift them and cancel what they are owed."""
        extra = self.borrow_milli_of(user)
        if extra is None:
            return False
        now = self._clock_ns()
        state = self._borrow_states.get(user)
        if state is None:
            state = self._borrow_states[user] = _UserState(now * extra, extra, self._burst_ns)
        elif state.rate != extra:
            state.rescale(extra, now, self._burst_ns)
        if not state.take(now):
            return False
        vtime = self.borrow_tag(user)
        if in_order:
            self._vclock = vtime
        self._vtimes[user] = vtime + self._vtime_per_token(user)
        return True

    def refund_borrowed(self, user: str, num: int = 1) -> None:
        """Give back ``num`` tokens lent in this step (exactly undoes ``try_borrow``'s
        charges; the virtual clock stays)."""
        state = self._borrow_states.get(user)
        if state is not None:
            state.tat_scaled -= num * TOKEN
        if user in self._vtimes:
            self._vtimes[user] -= num * self._vtime_per_token(user)

    def borrow_ready_at_ns(self, user: str) -> int:
        """Earliest clock time at which the user's ceiling lets it borrow again."""
        state = self._borrow_states.get(user)
        if state is None:
            return 0
        return -(-(state.tat_scaled - state.burst_scaled) // state.rate)

    def _vtime_per_token(self, user: str) -> int:
        rate = self._user_rates.get(user, self._default_rate)
        # ns per token at the user's rate: borrowers share in proportion to their rates.
        return TOKEN // rate if rate else TOKEN

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

    def refund_settled(
        self, user: str, num: int, later_takes: Iterable[tuple[int, int]] = ()
    ) -> None:
        """Give back ``num`` tokens taken in an earlier step, as if never taken.

        ``later_takes``: (clock time, tokens) of the user's takes since then,
        oldest first. The TAT goes no lower than those takes alone give: a take
        that started from ``now`` (the user was idle) already absorbed the
        refunded tokens, and undoing them again would hand them out twice.
        """
        state = self._states.get(user)
        if state is None:
            return
        tat = state.tat_scaled - num * TOKEN
        floor: int | None = None
        for at_ns, num_taken in later_takes:
            at_scaled = at_ns * state.rate
            floor = (at_scaled if floor is None or at_scaled > floor else floor) + (
                num_taken * TOKEN
            )
        if floor is not None and tat < floor:
            tat = floor
        if tat < state.tat_scaled:
            state.tat_scaled = tat

    def take_late(self, num_received: Mapping[str, int]) -> None:
        """Charge tokens users received beyond what they were charged, whatever the
        budget (the TAT may go past the burst: the user waits for them)."""
        now = self._clock_ns()
        for user, num in num_received.items():
            state = self._states.get(user)
            if state is None:
                rate = self._user_rates.get(user, self._default_rate)
                if rate is None:
                    continue
                state = self._states[user] = _UserState(now * rate, rate, self._burst_ns)
            now_scaled = now * state.rate
            tat = state.tat_scaled
            state.tat_scaled = (tat if tat > now_scaled else now_scaled) + num * TOKEN

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
        limiter.replace_ceilings(self._default_ceiling, self._ceilings)
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
        """The user takes the default's rate (its ceiling is set apart)."""
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

    def set_milli_ceiling(self, user: str, milli: int | None) -> None:
        """The user's own ceiling (None: it borrows nothing, whatever the default's).
        Counts only above an enforced rate; kept while the user's rate changes."""
        milli = validate_milli_rate(milli, field=f"ceiling of user {user!r}")
        self._num_user_ceilings += (milli is not None) - (self._ceilings.get(user) is not None)
        self._ceilings[user] = milli

    def clear_ceiling(self, user: str) -> None:
        """The user takes the default's ceiling."""
        self._num_user_ceilings -= self._ceilings.pop(user, None) is not None

    def set_default_milli_ceiling(self, milli: int | None) -> None:
        self._default_ceiling = validate_milli_rate(milli, field="default ceiling")

    def replace_ceilings(
        self, default_milli: int | None, user_millis: Mapping[str, int | None]
    ) -> None:
        """Install every ceiling at once (users not named take the default's)."""
        self.set_default_milli_ceiling(default_milli)
        self._ceilings = {
            user: validate_milli_rate(milli, field=f"ceiling of user {user!r}")
            for user, milli in user_millis.items()
        }
        self._num_user_ceilings = sum(c is not None for c in self._ceilings.values())

    def cleanup_idle_users(self) -> None:
        """Forget users whose TAT is behind now; re-creating them is equivalent."""
        now = self._clock_ns()
        for states in (self._states, self._shadow_states, self._borrow_states):
            idle = [u for u, s in states.items() if s.tat_scaled <= now * s.rate]
            for user in idle:
                del states[user]
        # A virtual time at or behind the clock's is lifted to it on return anyway.
        vclock = self._vclock
        for user in [u for u, v in self._vtimes.items() if v <= vclock]:
            del self._vtimes[user]

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
