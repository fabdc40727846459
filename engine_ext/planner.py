"""What one ``schedule()`` step does about output rates, in plain Python (no vLLM import).

``StepPlanner.plan`` reads the running requests (the attributes of
``RequestLike``, which mirror vLLM 0.32.0's ``Request``) and the per-user view
of the waiting queues, and decides with the limiter:

- which running requests are charged one token (their step would sample; the
  requests of users whose budget covers them all are charged unseen and
  settled after upstream's step, see ``_charge_covered``),
- which are throttled (refused; they stay resident and are skipped),
- which are parked (have a token but no active slot; skipped and refunded),
- which throttled requests give their worker slot back (reclaim victims),
- the admission cap for this step,
- which throttled requests of users with a ceiling borrow a token (``_lend_spare``:
  only when no other user needs the capacity, shared by weighted fair order).

Users in shadow are unlimited to the plan (the limiter's hot path sees them so);
``settle`` charges them what they were served and counts what enforcement would
have refused (``num_would_throttle``).

The scheduler adapter (engine_ext/scheduler.py) applies the plan to upstream's
state in one place, runs upstream's ``schedule()`` with an ``AdmissionGate``
on the waiting queues, and hands the output to ``StepPlanner.settle``, which
refunds every charge upstream did not sample (the plan itself gives back
only tokens it takes and then decides against in the same call). Line
numbers below are vLLM 0.32.0's ``vllm/v1/core/sched/scheduler.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush, heapreplace
from operator import attrgetter, is_
from typing import Any, Protocol

from engine_ext.limiter import OutputRateLimiter

# Steps during which a request re-admitted after a slot reclaim cannot be
# reclaimed again (see docs/scheduler.md, "Slot reclaim").
RECLAIM_COOLDOWN_STEPS = 32

_REQUEST_ID = attrgetter("request_id")
_IS_PREFILL_CHUNK = attrgetter("is_prefill_chunk")


def _top(
    heap: list[tuple[float, int, str]],
    live: Container[str],
    key: Callable[[str], tuple[float, int, str]],
) -> str | None:
    """The user of the first entry of ``heap`` that is still its user's key (entries
    of users no longer in ``live``, or pushed before their key changed, are dropped)."""
    while heap:
        entry = heap[0]
        user = entry[2]
        if user in live and entry == key(user):
            return user
        heappop(heap)
    return None


class RequestLike(Protocol):
    """What the planner reads of a request (vLLM's ``Request`` has all of it)."""

    request_id: str
    num_output_placeholders: int
    num_computed_tokens: int
    next_decode_eligible_step: int
    num_prompt_tokens: int
    max_tokens: int
    is_prefill_chunk: bool
    arrival_time: float

    @property
    def num_tokens(self) -> int: ...


class WaitingLike(Protocol):
    """The per-user view of a waiting queue (``UserIndexedQueue``)."""

    def __len__(self) -> int: ...

    def users(self) -> Iterable[str]: ...

    def num_requests_of(self, user: str) -> int: ...


@dataclass(frozen=True)
class Slots:
    """The slot counts of one step, before the plan."""

    max_active: int  # --max-num-active-seqs (upstream's admission cap)
    max_running: int  # --max-num-seqs (worker slots)
    num_held: int  # requests holding a worker slot: running + paused streaming sessions
    max_chunk: int  # the step's token budget
    # Upstream passes over every running prefill chunk this step (its local prefill
    # cadence, vLLM 0.33 on: engine_ext/vllm_compat.holds_prefill_chunks).
    holds_prefill_chunks: bool = False


@dataclass
class StepPlan:
    # Running requests of users whose budget covers all of their running and
    # waiting requests: charged one token each without looking at them;
    # settle() refunds the ones that do not sample.
    covered: list[RequestLike] = field(default_factory=list)
    # user -> number of its requests in ``covered`` (read only: may be shared
    # with the planner's cache).
    num_covered: Mapping[str, int] = field(default_factory=dict)
    # Ids of the running requests classified one by one (those of the other users).
    classified_ids: list[str] = field(default_factory=list)
    # Classified running requests whose step samples, charged one token.
    charged: list[RequestLike] = field(default_factory=list)
    # Running requests refused a token: skipped this step, still resident.
    throttled: list[RequestLike] = field(default_factory=list)
    # Running requests with a token but no active slot: skipped, refunded.
    parked: list[RequestLike] = field(default_factory=list)
    # Throttled requests to preempt so that users with budget get their slots.
    victims: list[RequestLike] = field(default_factory=list)
    # Requests of users over their rate lent a token within their ceiling: capacity no
    # other user needs this step (``StepPlanner._lend_spare``); run after the others.
    borrowed: list[RequestLike] = field(default_factory=list)
    # user -> that user's ``charged`` requests; built only when needed.
    granted_by_user: dict[str, list[RequestLike]] | None = None
    # Admission cap for upstream this step (None: upstream's own).
    admission_cap: int | None = None


@dataclass
class ReclaimStats:
    """Slots taken back from throttled requests since the engine started."""

    num_reclaims: int = 0
    # Tokens the reclaimed requests had computed; recomputed on re-admission
    # unless the prefix cache still holds their blocks.
    num_tokens_dropped: int = 0


class AdmissionGate:
    """Charges a waiting request's user when upstream's admission loop reaches it.

    Installed on the waiting queues for one ``schedule()``. A user refused once
    stays refused for the step, so the rest of its queue costs nothing.
    """

    __slots__ = ("borrowed", "charged", "lends", "limiter", "note_refused", "quota", "refused")

    def __init__(
        self,
        limiter: OutputRateLimiter,
        refused: set[str],
        note_refused: Callable[[str, int], None],
        lends: bool = False,
        quota: dict[str, int] | None = None,
    ) -> None:
        self.limiter = limiter
        self.refused = refused
        self.note_refused = note_refused
        # Whether a user over its rate may borrow its admission token (no user waiting
        # has budget: nobody else would be admitted this step).
        self.lends = lends
        # user -> admissions it may still have this step, when running requests were
        # parked for them (``StepPlanner._yield_active_slots``); None: any user.
        self.quota = quota
        # request id -> waiting request charged one token this step.
        self.charged: dict[str, RequestLike] = {}
        # request id -> waiting request lent one token (beyond its user's rate).
        self.borrowed: dict[str, RequestLike] = {}

    def admits(self, user: str, request: RequestLike) -> bool:
        request_id = request.request_id
        if request_id in self.charged or request_id in self.borrowed:
            return True
        if user in self.refused:
            return False
        quota = self.quota
        if quota is not None and not quota.get(user):
            return False  # the slots yielded this step are other users'
        if self.limiter.try_take(user):
            self.charged[request_id] = request
            if quota is not None:
                quota[user] -= 1
            return True
        if self.lends and self.limiter.try_borrow(user, in_order=False):
            self.borrowed[request_id] = request
            return True
        self.refused.add(user)
        self.note_refused(user, 1)
        return False


class StepPlanner:
    def __init__(self, limiter: OutputRateLimiter, users: Mapping[Any, str]) -> None:
        self.limiter = limiter
        # request -> rate-limit identity, for every request the scheduler holds
        # (owned by the adapter). Keyed by the object: hashing it reads no field.
        self.users = users
        # Earliest time a user refused in the last step gets budget again.
        self.wakeup_ns: int | None = None
        # user -> request id of the stream that was served last (rotation).
        self._last_served_req: dict[str, str] = {}
        # user -> last step in which it was given an active slot while slots
        # were short (fairness across users).
        self._last_slot_step: dict[str, int] = {}
        # user -> virtual slot time: the slots it was given while slots were short,
        # each 1/its weight (``_park_over_active_cap``).
        self._slot_vtime: dict[str, float] = {}
        # Ids of reclaimed requests not re-admitted yet.
        self._reclaimed: set[str] = set()
        # request id -> first step in which it may be reclaimed again.
        self._reclaim_protected_until: dict[str, int] = {}
        self.reclaim_cooldown_steps = RECLAIM_COOLDOWN_STEPS
        self.reclaim_stats = ReclaimStats()
        # user -> tokens granted / requests throttled / requests a shadow limit would
        # have throttled, since last taken.
        self.num_granted: dict[str, int] = {}
        self.num_throttled: dict[str, int] = {}
        self.num_would_throttle: dict[str, int] = {}
        # user -> tokens lent beyond its rate (a part of its granted ones), since last taken.
        self.num_borrowed: dict[str, int] = {}
        # Whether settle() counts granted tokens (only a reporting engine needs them).
        self.count_granted = False
        # Whether settle() counts one served token per sampled request; with speculative
        # decoding the tokens are counted once emitted (engine_ext/drafts.py).
        self.counts_at_dispatch = True
        # The running list of the last plan and its user -> count, reused
        # while ``running`` holds the same requests in the same order.
        self._last_running: list[RequestLike] = []
        self._last_num_running: Counter[str] = Counter()

    # ---- the plan ---------------------------------------------------------

    def plan(
        self,
        running: Sequence[RequestLike],
        waiting: tuple[WaitingLike, ...],
        slots: Slots,
        step: int,
    ) -> tuple[StepPlan, AdmissionGate]:
        """Decide this step; the gate is for the waiting queues during upstream's schedule()."""
        self.wakeup_ns = None
        plan = StepPlan()
        num_running = len(running)
        has_waiting = any(map(len, waiting))
        if len(running) <= slots.max_active:
            running = self._charge_covered(plan, running, waiting if has_waiting else ())
        num_busy = self._charge_running(plan, running, step, slots) if running else 0
        plan.parked = self._park_over_active_cap(plan, slots.max_active - num_busy, step)
        refused: set[str] = set()
        quota: dict[str, int] | None = None
        if has_waiting:
            if plan.charged:
                self._steal_turns_for_waiting(plan, waiting, slots)
                if plan.throttled and num_running > slots.max_active:
                    quota = self._yield_active_slots(plan, waiting, slots, step)
            if plan.throttled:
                refused = self._choose_reclaim_victims(plan, waiting, slots, step)
        lends = False
        if self.limiter.has_ceilings and not plan.parked and not plan.victims:
            # Nobody else needs the capacity: no active slot is short (nothing parked,
            # nothing reclaimed) and no user waiting has budget to be admitted.
            lends = not (has_waiting and self._waiting_has_budget(waiting))
            if lends and plan.throttled:
                self._lend_spare(plan, num_running, slots)
        if plan.throttled:
            # Throttled requests hold a worker slot but no active slot, and so do parked
            # ones (they leave room for admissions only after a yield).
            plan.admission_cap = min(
                slots.max_active + len(plan.throttled) + len(plan.parked), slots.max_running
            )
        return plan, AdmissionGate(self.limiter, refused, self._note_refused, lends, quota)

    def _waiting_has_budget(self, waiting: tuple[WaitingLike, ...]) -> bool:
        """Whether some user with waiting requests could be admitted at its rate now."""
        num_available = self.limiter.num_available
        return any(num_available(user, 1) for queue in waiting for user in queue.users())

    def _lend_spare(self, plan: StepPlan, num_running: int, slots: Slots) -> None:
        """Lend tokens beyond their rates to throttled requests of users with a ceiling,
        into the active slots no running request of this step takes.

        Called only when no other user needs the capacity. One token at a time to the
        borrower with the lowest virtual time (the limiter charges it ``1/rate`` per
        token lent), so spare capacity is shared in proportion to the borrowers' rates;
        each borrower's streams in rotation order. A borrower whose ceiling refuses it
        drops out for the step. The requests lent a token leave ``throttled`` and are
        not counted as refused.
        """
        num_free = slots.max_active - (num_running - len(plan.throttled))
        if num_free <= 0:
            return
        limiter = self.limiter
        users = self.users
        # user -> its throttled streams, in rotation order (only users that may borrow),
        # and the users that may not (no ceiling above an enforced rate).
        streams_of: dict[str, list[RequestLike]] = {}
        cannot_borrow: set[str] = set()
        for request in plan.throttled:
            user = users[request]
            streams = streams_of.get(user)
            if streams is None:
                if user in cannot_borrow:
                    continue
                if limiter.borrow_milli_of(user) is None:
                    cannot_borrow.add(user)
                    continue
                streams = streams_of[user] = []
            streams.append(request)
        if not streams_of:
            return
        heap = [(limiter.borrow_tag(u), u) for u in streams_of]
        heapify(heap)
        lent: list[RequestLike] = []
        num_lent: Counter[str] = Counter()
        while heap and num_free:
            user = heap[0][1]
            if not limiter.try_borrow(user):
                heappop(heap)
                ready_at = limiter.borrow_ready_at_ns(user)
                if self.wakeup_ns is None or ready_at < self.wakeup_ns:
                    self.wakeup_ns = ready_at
                continue
            streams = streams_of[user]
            request = streams.pop(0)
            lent.append(request)
            num_lent[user] += 1
            self._last_served_req[user] = request.request_id
            num_free -= 1
            if streams:
                heapreplace(heap, (limiter.borrow_tag(user), user))
            else:
                heappop(heap)
        if not lent:
            return
        lent_ids = {id(r) for r in lent}
        plan.throttled = [r for r in plan.throttled if id(r) not in lent_ids]
        plan.borrowed = lent
        num_throttled = self.num_throttled
        for user, num in num_lent.items():
            num_left = num_throttled.get(user, 0) - num
            if num_left > 0:
                num_throttled[user] = num_left
            else:
                num_throttled.pop(user, None)

    def _charge_covered(
        self, plan: StepPlan, running: Sequence[RequestLike], waiting: tuple[WaitingLike, ...]
    ) -> Sequence[RequestLike]:
        """Charge the running requests of every user whose budget covers them all, unseen.

        A user whose budget covers every one of its running and waiting
        requests (``waiting``: the queues, empty when nothing waits) is
        refused nothing this step, whichever of them sample: each is charged
        one token (one ``take_many`` call for all such users, from
        counts made in C) and settle() refunds the ones that did not sample,
        which leaves the limiter as if only those had been charged (GCRA
        tokens taken at one instant add up). Nothing else in the plan depends
        on which of a covered user's requests sample: it is never throttled,
        never loses a turn to its queue, is admissible for all of its queue.
        Parking would, but needs more running requests than active slots, and
        the caller then classifies every request. Returns the requests of the
        other users, to be classified one by one.
        """
        users = self.users
        # Compares pointers only: no request is read when nothing changed.
        last = self._last_running
        if len(running) == len(last) and all(map(is_, running, last)):
            num_running = self._last_num_running
        else:
            num_running = Counter(map(users.__getitem__, running))
            self._last_running, self._last_num_running = list(running), num_running
        limiter = self.limiter
        # user -> tokens it got of those asked for: the users not covered.
        uncovered = limiter.take_many(num_running)
        if waiting:
            num_waiting: Counter[str] = Counter()
            for queue in waiting:
                for user in queue.users():
                    if user in num_running and user not in uncovered:
                        num_waiting[user] += queue.num_requests_of(user)
            for user, num in num_waiting.items():
                if limiter.num_available(user, num) < num:
                    uncovered[user] = num_running[user]
        if not uncovered:
            plan.covered = list(running)
            plan.num_covered = num_running
            return ()
        num_covered = Counter(num_running)
        for user, num in uncovered.items():
            limiter.refund(user, num)
            del num_covered[user]
        plan.num_covered = num_covered
        covered = plan.covered
        rest: list[RequestLike] = []
        for request in running:
            (rest if users[request] in uncovered else covered).append(request)
        return rest

    def _charge_running(
        self, plan: StepPlan, running: Sequence[RequestLike], step: int, slots: Slots
    ) -> int:
        """Charge every running request whose dispatch this step would sample.

        Returns the number of running requests that need no token (mid-prefill chunks).
        """
        plan.classified_ids = list(map(_REQUEST_ID, running))
        charged = plan.charged
        charge = charged.append
        max_chunk = slots.max_chunk
        holds_prefill_chunks = slots.holds_prefill_chunks
        num_busy = 0
        for request in running:
            if holds_prefill_chunks and request.is_prefill_chunk:
                continue  # upstream's prefill cadence skip (0.33.0's lines 822-826)
            num_placeholders = request.num_output_placeholders
            # Upstream's num_new_tokens before its caps (lines 703-707), without
            # draft tokens: the step samples iff its chunk reaches the known
            # sequence's end; drafts are charged apart (engine_ext/drafts.py).
            num_remaining = request.num_tokens + num_placeholders - request.num_computed_tokens
            # Upstream's decode cadence skip (lines 680-684).
            if num_remaining <= 0 or step < request.next_decode_eligible_step:
                continue
            if num_remaining > max_chunk:
                num_busy += 1  # this chunk cannot reach the end
                continue
            if (
                num_placeholders > 0
                and request.num_computed_tokens + 2 - num_placeholders
                >= request.num_prompt_tokens + request.max_tokens
            ):
                continue  # upstream's async look-ahead stop (lines 664-678)
            charge(request)
        # One limiter call per step: a user with several streams asks for all
        # of their tokens at once (counted in C).
        num_wanted = Counter(map(self.users.__getitem__, charged))
        num_got = self.limiter.take_many(num_wanted)
        if num_got:
            self._rotate_contended(plan, num_got)
        return num_busy

    def _rotate_contended(self, plan: StepPlan, num_got: dict[str, int]) -> None:
        """For users that ran short, hand their tokens to streams in rotation order.

        ``num_got`` maps each such user to the tokens it got. The same number of
        tokens goes to the streams that come first after the one served last.
        """
        users = self.users
        # user -> its dispatchable streams in ``running`` order; filled in the
        # order in which the users ran out, which is also the order their
        # throttled streams go to the tail of ``running``.
        streams_of: dict[str, list[RequestLike]] = {user: [] for user in num_got}
        refused: dict[str, list[RequestLike]] = {}
        kept: list[RequestLike] = []
        for request in plan.charged:
            user = users[request]
            streams = streams_of.get(user)
            if streams is None:
                kept.append(request)
                continue
            streams.append(request)
            if len(streams) == num_got[user] + 1:
                refused[user] = streams
        for user, streams in refused.items():
            num_granted = num_got[user]
            if num_granted:
                streams = self._rotate(user, streams)
                kept.extend(streams[:num_granted])
                self._last_served_req[user] = streams[num_granted - 1].request_id
            plan.throttled.extend(streams[num_granted:])
            self._note_refused(user, len(streams) - num_granted)
        plan.charged = kept

    def _rotate(self, user: str, streams: list[RequestLike]) -> list[RequestLike]:
        """Start after the stream of ``user`` that was served last."""
        last_id = self._last_served_req.get(user)
        if last_id is None:
            return streams
        for i, request in enumerate(streams):
            if request.request_id == last_id:
                return streams[i + 1 :] + streams[: i + 1]
        return streams

    def _park_over_active_cap(self, plan: StepPlan, num_free: int, step: int) -> list[RequestLike]:
        """Refund and return the charged requests beyond the active cap.

        Only possible after throttling let more requests become resident than
        there are active slots. Slots are shared in proportion to the users' rates,
        over time: each user has a virtual slot time that every slot it is given
        while slots are short advances by 1/its weight (``_slot_weights``), and the
        slots go one at a time to the smallest virtual time after the slot (ties:
        the user given one least recently, so nobody is favoured for sitting early
        in ``running``). A user that had none while slots were plentiful, or is new,
        starts at the smallest virtual time among those asking: idle steps are not
        banked. A user's slots go round its streams.
        """
        if len(plan.charged) <= num_free:
            return []
        by_user = self._granted_by_user(plan)
        weight = self._slot_weights(by_user)
        vtime = self._slot_vtime
        floor = min((vtime[u] for u in by_user if u in vtime), default=0.0)
        last_slot = self._last_slot_step.get
        for user in by_user:
            vtime[user] = max(vtime.get(user, floor), floor)
        # user -> slots it keeps.
        num_kept = dict.fromkeys(by_user, 0)
        heap = [(vtime[u] + 1 / weight[u], last_slot(u, -1), u) for u in by_user]
        heapify(heap)
        for _ in range(max(0, num_free)):
            if not heap:
                break
            tag, last, user = heap[0]
            vtime[user] = tag
            num_kept[user] += 1
            if num_kept[user] < len(by_user[user]):
                heapreplace(heap, (tag + 1 / weight[user], last, user))
            else:
                heappop(heap)
        parked: list[RequestLike] = []
        for user in sorted(by_user, key=lambda u: last_slot(u, -1)):
            streams = by_user[user]
            num_keep = num_kept[user]
            if num_keep:
                self._last_slot_step[user] = step
                if num_keep < len(streams):
                    streams[:] = self._rotate(user, streams)
                    self._last_served_req[user] = streams[num_keep - 1].request_id
            self.limiter.refund(user, len(streams) - num_keep)
            parked.extend(streams[num_keep:])
            del streams[num_keep:]
        parked_ids = {id(r) for r in parked}
        plan.charged = [r for r in plan.charged if id(r) not in parked_ids]
        return parked

    def _slot_weights(self, users: Iterable[str]) -> dict[str, int]:
        """user -> its weight for active slots when they are short: its enforced rate
        (milli tok/s); unlimited and shadow users weigh as the fastest limited user
        among ``users`` (all alike when none is limited)."""
        milli_of = self._enforced_milli_rate
        milli = {u: milli_of(u) for u in users}
        fastest = max((m for m in milli.values() if m is not None), default=1)
        return {u: fastest if m is None else m for u, m in milli.items()}

    def _granted_by_user(self, plan: StepPlan) -> dict[str, list[RequestLike]]:
        if plan.granted_by_user is None:
            users = self.users
            by_user: dict[str, list[RequestLike]] = {}
            for request in plan.charged:
                by_user.setdefault(users[request], []).append(request)
            plan.granted_by_user = by_user
        return plan.granted_by_user

    @staticmethod
    def _num_free_slots(slots: Slots) -> int:
        return max(slots.max_running - slots.num_held, 0)

    @staticmethod
    def _num_free_active_slots(plan: StepPlan, slots: Slots) -> int:
        """Admissions upstream's active cap (line 923) allows, were worker slots unbounded."""
        return slots.max_active + len(plan.throttled) + len(plan.parked) - slots.num_held

    def _steal_turns_for_waiting(
        self, plan: StepPlan, waiting: tuple[WaitingLike, ...], slots: Slots
    ) -> None:
        """Give a token granted to a running stream to the user's first waiting one.

        A waiting stream has never been served, so in the user's rotation it
        comes before every running stream; without this, running streams that
        keep the budget busy would starve the user's queued requests forever.
        Only where a slot is free for it: a user's throttled requests are never
        reclaimed for the same user, so without a free slot the turn would be
        lost.
        """
        num_free = min(self._num_free_slots(slots), self._num_free_active_slots(plan, slots))
        if num_free <= 0:
            return
        by_user = self._granted_by_user(plan)
        num_available = self.limiter.num_available
        for queue in waiting:
            for user in queue.users():
                streams = by_user.get(user)
                if not streams or num_available(user, 1):
                    continue
                victim = streams.pop()
                plan.charged.remove(victim)
                plan.throttled.append(victim)
                self.limiter.refund(user)
                self._note_refused(user, 1)
                num_free -= 1
                if not num_free:
                    return

    def _yield_active_slots(
        self, plan: StepPlan, waiting: tuple[WaitingLike, ...], slots: Slots, step: int
    ) -> dict[str, int] | None:
        """Park running requests so that waiting users within their rates get active slots.

        Called when limits bind (something is throttled) and more requests run than
        there are active slots (so every one was classified). When the limited users
        waiting with budget want more admissions than the active slots left free,
        slots go in proportion to rates: each admission goes to the waiting user
        holding the fewest active slots per tok/s of its rate, from a free slot or
        else from the limited user holding the most, only while that one holds more.
        The parked requests are refunded and compete for slots in the next step like
        any other parked request; only waiting requests take slots here, so nothing
        trades a slot back and forth. Unlimited and shadow users neither take nor
        give (as upstream: they wait for a free slot). Without this a user arriving
        while every active slot is held by users within their rates waits until one
        finishes or runs out of budget, though it is within its own. Bounded by the
        worker slots free or reclaimable.

        Returns user -> admissions allowed this step (for the gate), or None when
        nobody was parked (upstream admits in queue order, as without this).
        """
        assert not plan.covered, "yielding needs every running request classified"
        num_free = max(0, self._num_free_active_slots(plan, slots))
        num_slots = self._num_free_slots(slots) + len(plan.throttled)
        admissible = self._admissible_waiting(waiting, min(len(plan.charged), num_slots) + num_free)
        if sum(admissible.values()) <= num_free:
            return None
        milli_of = self._enforced_milli_rate
        # user -> its enforced rate (limited users only, the rest take no part).
        milli = {u: m for u in admissible if (m := milli_of(u)) is not None}
        by_user = self._granted_by_user(plan)
        donors: dict[str, list[RequestLike]] = {}
        for user, streams in by_user.items():
            if streams and (m := milli_of(user)) is not None:
                milli[user] = m
                donors[user] = list(streams)
        # user -> active slots it holds this step (charged requests, then admissions).
        num_held = {user: len(streams) for user, streams in donors.items()}

        def share(user: str) -> float:
            return num_held.get(user, 0) / milli[user]

        # Heaps of keys ending in the user: the strongest claim first for takers, the
        # weakest for donors. A user's key changes only when it takes or gives; then a
        # fresh entry is pushed and the stale one dropped when it surfaces (``_top``).
        last_slot = self._last_slot_step.get

        def taker_key(user: str) -> tuple[float, int, str]:
            return share(user), last_slot(user, -1), user

        def donor_key(user: str) -> tuple[float, int, str]:
            return -share(user), -last_slot(user, -1), user

        takers = {u: n for u, n in admissible.items() if u in milli}
        taker_heap = [taker_key(u) for u in takers]
        donor_heap = [donor_key(u) for u in donors]
        heapify(taker_heap)
        heapify(donor_heap)
        quota: dict[str, int] = {}
        parked: list[RequestLike] = []
        while num_slots > 0:
            taker = _top(taker_heap, takers, taker_key)
            if taker is None:
                break
            if not num_free:
                donor = _top(donor_heap, donors, donor_key)
                if donor is None:
                    break
                if share(donor) <= share(taker):
                    if taker not in donors:
                        break
                    # It holds its share already: its waiting stream, never served,
                    # comes before its running ones in its rotation.
                    donor = taker
                parked.append(donors[donor].pop())
                self.limiter.refund(donor)
                num_held[donor] -= 1
                if not donors[donor]:
                    del donors[donor]
                elif donor != taker:
                    heappush(donor_heap, donor_key(donor))
                if donor != taker and donor in takers:
                    heappush(taker_heap, taker_key(donor))
            else:
                num_free -= 1
            num_slots -= 1
            quota[taker] = quota.get(taker, 0) + 1
            num_held[taker] = num_held.get(taker, 0) + 1
            self._last_slot_step[taker] = step
            takers[taker] -= 1
            if takers[taker]:
                heappush(taker_heap, taker_key(taker))
            else:
                del takers[taker]
            if taker in donors:
                heappush(donor_heap, donor_key(taker))
        if not parked:
            return None
        parked_ids = {id(r) for r in parked}
        plan.charged = [r for r in plan.charged if id(r) not in parked_ids]
        plan.granted_by_user = None
        plan.parked.extend(parked)
        return quota

    def _enforced_milli_rate(self, user: str) -> int | None:
        """The user's enforced rate in milli tokens/s (None: unlimited or in shadow)."""
        limiter = self.limiter
        return None if limiter.is_shadow(user) else limiter.milli_rate_of(user)

    def _choose_reclaim_victims(
        self, plan: StepPlan, waiting: tuple[WaitingLike, ...], slots: Slots, step: int
    ) -> set[str]:
        """Throttled requests whose worker slots go to waiting users with budget.

        Throttled requests hold worker slots between their tokens; when they
        hold every slot, a waiting request of a user with budget could never
        be admitted. The adapter preempts the victims through upstream's own
        preemption. Returns the users reclaimed from, which may not be
        admitted again in this step.
        """
        num_free_active = self._num_free_active_slots(plan, slots)
        num_free = self._num_free_slots(slots)
        if num_free_active <= num_free:
            return set()
        admissible = self._admissible_waiting(waiting, num_free_active)
        if sum(admissible.values()) <= num_free:
            return set()
        victims = self._pick_reclaim_victims(plan, admissible, num_free_active, num_free, step)
        if not victims:
            return set()
        victim_ids = {id(r) for r in victims}
        plan.throttled = [r for r in plan.throttled if id(r) not in victim_ids]
        plan.victims = victims
        stats = self.reclaim_stats
        for victim in victims:
            stats.num_reclaims += 1
            stats.num_tokens_dropped += victim.num_computed_tokens
            self._reclaimed.add(victim.request_id)
        return {self.users[r] for r in victims}

    def _admissible_waiting(self, waiting: tuple[WaitingLike, ...], limit: int) -> dict[str, int]:
        """user -> how many of its waiting requests (up to ``limit`` in all) its
        budget covers now, for users with budget. Costs O(users waiting)."""
        num_available = self.limiter.num_available
        admissible: dict[str, int] = {}
        total = 0
        for queue in waiting:
            for user in queue.users():
                num = num_available(user, min(limit, queue.num_requests_of(user)))
                if num:
                    admissible[user] = admissible.get(user, 0) + num
                    total += num
                    if total >= limit:
                        return admissible
        return admissible

    def _pick_reclaim_victims(
        self,
        plan: StepPlan,
        admissible: dict[str, int],
        num_free_active: int,
        num_free: int,
        step: int,
    ) -> list[RequestLike]:
        """The throttled requests to reclaim so that ``admissible`` waiting
        requests (user -> count) find worker slots.

        From the user holding the most throttled resident requests; ties go to
        the user whose budget returns last (it loses least by waiting in the
        queue), then by user id so the choice is deterministic. Within a user,
        the request with the fewest computed tokens (cheapest to recompute;
        ties: the one that arrived last, as upstream's own preemption prefers).
        A user reclaimed from is not admitted in this step, so its own waiting
        requests never take a slot reclaimed from it: a user whose waiting
        requests are the demand is not a victim for them. Never a request
        re-admitted after a reclaim less than ``reclaim_cooldown_steps`` ago.
        """
        users = self.users
        protected = self._reclaim_protected_until
        # user -> its reclaimable throttled requests, cheapest last.
        candidates: dict[str, list[RequestLike]] = {}
        for request in plan.throttled:
            if protected.get(request.request_id, 0) > step:
                continue
            candidates.setdefault(users[request], []).append(request)
        for requests in candidates.values():
            requests.sort(key=lambda r: (-r.num_computed_tokens, r.arrival_time))
        ready_at = self.limiter.ready_at_ns
        victims: list[RequestLike] = []
        victim_users: set[str] = set()

        def num_needed(excluded: set[str]) -> int:
            demand = sum(n for u, n in admissible.items() if u not in excluded)
            return min(demand, num_free_active) - num_free

        while candidates and len(victims) < num_needed(victim_users):
            user = max(candidates, key=lambda u: (len(candidates[u]), ready_at(u), u))
            if user not in victim_users and len(victims) >= num_needed(victim_users | {user}):
                del candidates[user]  # taking from it only removes its own demand
                continue
            requests = candidates[user]
            victims.append(requests.pop())
            victim_users.add(user)
            if not requests:
                del candidates[user]
        return victims

    def _note_refused(self, user: str, num_requests: int) -> None:
        self.num_throttled[user] = self.num_throttled.get(user, 0) + num_requests
        ready_at = self.limiter.ready_at_ns(user)
        if self.wakeup_ns is None or ready_at < self.wakeup_ns:
            self.wakeup_ns = ready_at

    # ---- after upstream's step: refund what did not sample ----------------

    def settle(
        self,
        plan: StepPlan,
        gate: AdmissionGate,
        num_scheduled: Mapping[str, int],
        step: int,
    ) -> None:
        """Refund every charged request that ended up not sampling this step.

        ``num_scheduled`` is upstream's ``SchedulerOutput.num_scheduled_tokens``;
        ``is_prefill_chunk`` has been updated by upstream for what it scheduled.
        """
        users = self.users
        charged = plan.covered + plan.charged
        charged += gate.charged.values()
        if self._all_scheduled(plan, gate, num_scheduled) and not any(
            map(_IS_PREFILL_CHUNK, charged)
        ):
            unsampled = []  # the usual step: every charged request sampled
        else:
            unsampled = [
                r for r in charged if r.request_id not in num_scheduled or r.is_prefill_chunk
            ]
        refund = self.limiter.refund
        for request in unsampled:
            refund(users[request])
        num_lent = (
            self._settle_borrowed(plan, gate, num_scheduled)
            if plan.borrowed or gate.borrowed
            else None
        )
        if self._reclaimed:
            self._protect_readmitted(gate, num_scheduled, step)
        if self.counts_at_dispatch and (self.count_granted or self.limiter.has_shadow):
            num_sampled = self._num_sampled(plan, gate, unsampled)
            if num_lent:
                num_sampled.update(num_lent)
            self.count_served(num_sampled)

    def _settle_borrowed(
        self, plan: StepPlan, gate: AdmissionGate, num_scheduled: Mapping[str, int]
    ) -> Counter[str]:
        """Give back the tokens lent to requests that did not sample; returns user ->
        tokens lent that were (one per request: a borrowed step has no drafts)."""
        users = self.users
        limiter = self.limiter
        num_lent: Counter[str] = Counter()
        for request in (*plan.borrowed, *gate.borrowed.values()):
            user = users[request]
            if request.request_id not in num_scheduled or request.is_prefill_chunk:
                limiter.refund_borrowed(user)
            else:
                num_lent[user] += 1
        if self.count_granted:
            num_borrowed = self.num_borrowed
            for user, num in num_lent.items():
                num_borrowed[user] = num_borrowed.get(user, 0) + num
        return num_lent

    def count_served(self, num_served: Mapping[str, int]) -> None:
        """Count tokens users were served (granted, and what shadow limits would
        have refused)."""
        if self.count_granted:
            num_granted = self.num_granted
            for user, num in num_served.items():
                if num > 0:
                    num_granted[user] = num_granted.get(user, 0) + num
        if self.limiter.has_shadow:
            num_would = self.num_would_throttle
            for user, num in self.limiter.shadow_take(num_served).items():
                num_would[user] = num_would.get(user, 0) + num

    @staticmethod
    def _all_scheduled(
        plan: StepPlan, gate: AdmissionGate, num_scheduled: Mapping[str, int]
    ) -> bool:
        """Whether upstream scheduled every charged request.

        Covered requests are counted, not looked up: every request upstream
        schedules was running when the plan was made or came through the gate
        (vllm_compat.py, "where scheduled requests come from"), so the covered requests are all
        scheduled iff the scheduled ones that are not covered account for the rest.
        """
        is_scheduled = num_scheduled.__contains__
        if not all(map(is_scheduled, gate.charged)):
            return False
        if not all(map(is_scheduled, map(_REQUEST_ID, plan.charged))):
            return False
        num_not_covered = len(gate.charged) + sum(map(is_scheduled, plan.classified_ids))
        if gate.borrowed:
            num_not_covered += sum(map(is_scheduled, gate.borrowed))
        return len(num_scheduled) - num_not_covered == len(plan.covered)

    def _protect_readmitted(
        self, gate: AdmissionGate, num_scheduled: Mapping[str, int], step: int
    ) -> None:
        """Reclaimed requests admitted again are not reclaimed for a while (no thrashing)."""
        for req_id in (*gate.charged, *gate.borrowed):
            if req_id in self._reclaimed and req_id in num_scheduled:
                self._reclaimed.discard(req_id)
                self._reclaim_protected_until[req_id] = step + self.reclaim_cooldown_steps

    def _num_sampled(
        self, plan: StepPlan, gate: AdmissionGate, unsampled: list[RequestLike]
    ) -> Counter[str]:
        """user -> its requests that sampled this step (0 or less: none)."""
        users = self.users
        num_sampled = Counter(plan.num_covered)
        num_sampled.update([users[r] for r in plan.charged])
        num_sampled.update([users[r] for r in gate.charged.values()])
        num_sampled.subtract([users[r] for r in unsampled])
        return num_sampled

    def take_usage(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """(tokens granted, requests throttled, requests a shadow limit would have
        throttled) per user since the last call."""
        usage = self.num_granted, self.num_throttled, self.num_would_throttle
        self.num_granted, self.num_throttled, self.num_would_throttle = {}, {}, {}
        return usage

    def take_borrowed(self) -> dict[str, int]:
        """Tokens lent beyond their rates per user since the last call (a part of the
        granted ones)."""
        num_borrowed, self.num_borrowed = self.num_borrowed, {}
        return num_borrowed

    def cleanup(self, live: Container[str], step: int) -> None:
        """Forget idle users and the reclaim state of finished requests (``live``:
        request ids still known)."""
        self.limiter.cleanup_idle_users()
        self._last_running, self._last_num_running = [], Counter()
        self._reclaimed = {r for r in self._reclaimed if r in live}
        protected = self._reclaim_protected_until
        for req_id in [r for r, until in protected.items() if until <= step or r not in live]:
            del protected[req_id]
        live_users = set(self.users.values())
        for table in (self._last_served_req, self._last_slot_step, self._slot_vtime):
            for user in [u for u in table if u not in live_users]:
                del table[user]
