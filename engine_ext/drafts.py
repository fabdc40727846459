"""Exact per-user accounting of speculative decoding (no vLLM import).

With speculative decoding a step emits 1 to ``1 + d`` tokens for a request
scheduled with ``d`` draft tokens (accepted drafts plus the bonus token; a stop
or ``max_tokens`` can trim them). ``DraftLedger`` keeps every limited user's
budget paying for exactly the tokens it receives:

1. **Allot** (before upstream's ``schedule()``): each request the plan charged
   its one token keeps as many of its drafts as its user's allowance leaves,
   taken from the limiter at once (one ``take_many``); a short user's drafts go
   to its streams position by position (every stream's first draft before any
   stream's second: early drafts are the likeliest accepted). The rest are cut
   from ``spec_token_ids``, so upstream schedules fewer drafts itself.
   Unlimited and shadow users keep all of theirs.
2. **Dispatch** (after upstream's ``schedule()``): drafts upstream did not
   schedule are refunded at once; each sampled request's charge
   (``1 + drafts kept``) enters its ledger with the output placeholders
   upstream added for it (asynchronous scheduling).
3. **Settle** (at the start of the next ``schedule()``, from what the request
   shows, never from ``update_from_output``): once a dispatched step's output has
   been applied (synchronous: always; asynchronous: the request's in-flight
   placeholders no longer cover it, or the request finished or was preempted),
   the charge minus the tokens the request really received is refunded (rejected
   drafts, trimmed stops). A request that received more than it was charged
   (only a preempted asynchronous request's late output can) is charged the rest.

A deferred refund cannot simply undo the take: a take in a later step may have
started from ``now`` rather than from the TAT (the user was idle), and undoing the
earlier take below it would hand out tokens twice. The refund is floored at the
TAT the later takes alone give (``OutputRateLimiter.refund_settled``), which is
exactly the state an ideal limiter that had been charged only the emitted
tokens would have. So the window bound holds for emitted tokens with no slack
in the draft length.

Usage, metrics and shadow counts are the emitted tokens, counted at settle.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine_ext.limiter import OutputRateLimiter


class DraftingRequest(Protocol):
    """What the ledger reads of a request (vLLM's ``Request`` has all of it)."""

    request_id: str
    spec_token_ids: list[int]
    num_output_placeholders: int
    is_prefill_chunk: bool

    @property
    def num_output_tokens(self) -> int: ...

    def is_finished(self) -> bool: ...


@dataclass(frozen=True)
class Dispatch:
    """One sampled step of one request."""

    step: int
    num_charged: int  # tokens taken for it: the bonus token plus the drafts kept
    num_placeholders: int  # output placeholders upstream added (asynchronous only)


@dataclass
class RequestLedger:
    """A request's dispatched steps whose output has not been settled."""

    user: str  # kept here: upstream may free the request (and reuse its id) first
    # num_output_tokens when last settled (or when first dispatched).
    num_seen: int
    pending: deque[Dispatch] = field(default_factory=deque)


@dataclass
class DraftStats:
    """Since the engine started."""

    num_drafts_cut: int = 0  # drafts a limited user's allowance left out
    num_refunded: int = 0  # tokens charged at dispatch and not emitted
    num_charged_late: int = 0  # tokens emitted beyond their dispatch charge


class DraftLedger:
    def __init__(
        self,
        limiter: OutputRateLimiter,
        users: Mapping[Any, str],
        *,
        is_async: bool,
        clock_ns: Callable[[], int],
    ) -> None:
        self.limiter = limiter
        self.users = users
        self.is_async = is_async
        self.clock_ns = clock_ns
        # request -> drafts it keeps this step and has been charged for (allot to dispatch).
        self._allotted: dict[Any, int] = {}
        # request -> its dispatched steps not settled yet.
        self._ledgers: dict[Any, RequestLedger] = {}
        # step -> clock time of its dispatch, for steps some ledger still holds.
        self._dispatched_at: dict[int, int] = {}
        self.stats = DraftStats()

    # ---- 1. before upstream's schedule() ----------------------------------

    def allot(self, charged: Iterable[DraftingRequest]) -> None:
        """Charge the drafts of ``charged`` (requests charged their sampled token)
        that their users' allowance covers; cut the rest."""
        users = self.users
        # user -> its requests with drafts, in the plan's order.
        drafting: dict[str, list[DraftingRequest]] = {}
        num_wanted: Counter[str] = Counter()
        for request in charged:
            num = len(request.spec_token_ids)
            if num:
                user = users[request]
                drafting.setdefault(user, []).append(request)
                num_wanted[user] += num
        if not drafting:
            return
        num_short = self.limiter.take_many(num_wanted)
        allotted = self._allotted
        for user, requests in drafting.items():
            num_got = num_short.get(user)
            if num_got is None:
                for request in requests:
                    allotted[request] = len(request.spec_token_ids)
                continue
            self.stats.num_drafts_cut += num_wanted[user] - num_got
            for request, num_kept in zip(requests, _by_position(requests, num_got), strict=True):
                allotted[request] = num_kept
                # A new list: under asynchronous scheduling the placeholders are shared.
                request.spec_token_ids = request.spec_token_ids[:num_kept]

    def cut(self, requests: Iterable[DraftingRequest]) -> None:
        """Cut every draft of ``requests``: a step lent beyond the user's rate (docs/
        scheduler.md, "Borrowing") samples one token, paid by the user's ceiling."""
        for request in requests:
            if request.spec_token_ids:
                self.stats.num_drafts_cut += len(request.spec_token_ids)
                # A new list: under asynchronous scheduling the placeholders are shared.
                request.spec_token_ids = []

    # ---- 2. after upstream's schedule() ------------------------------------

    def dispatch(
        self,
        requests: Mapping[str, DraftingRequest],
        num_scheduled: Mapping[str, int],
        scheduled_drafts: Mapping[str, list[int]],
        step: int,
    ) -> None:
        """Refund the drafts upstream left out; enter every sampled request's charge."""
        allotted, self._allotted = self._allotted, {}
        refund = self.limiter.refund
        users = self.users
        ledgers = self._ledgers
        is_async = self.is_async
        for req_id in num_scheduled:
            request = requests[req_id]
            if request.is_prefill_chunk:
                continue
            num_scheduled_drafts = len(scheduled_drafts.get(req_id, ()))
            num_allotted = allotted.pop(request, 0)
            num_kept = min(num_allotted, num_scheduled_drafts)
            if num_allotted > num_kept:
                refund(users[request], num_allotted - num_kept)
            ledger = ledgers.get(request)
            if ledger is None:
                ledger = ledgers[request] = RequestLedger(users[request], request.num_output_tokens)
            num_placeholders = 1 + num_scheduled_drafts if is_async else 0
            ledger.pending.append(Dispatch(step, 1 + num_kept, num_placeholders))
        for request, num in allotted.items():  # charged, then not sampled this step
            if num:
                refund(users[request], num)
        if ledgers:
            self._dispatched_at[step] = self.clock_ns()

    # ---- 3. at the start of the next schedule() -----------------------------

    def settle(self) -> Counter[str]:
        """Settle every dispatched step whose output has been applied; returns
        user -> tokens its requests received since the last call."""
        num_emitted: Counter[str] = Counter()
        if not self._ledgers:
            return num_emitted
        # user -> tokens to refund / to charge late.
        num_refund: Counter[str] = Counter()
        num_late: Counter[str] = Counter()
        done: list[Any] = []
        for request, ledger in self._ledgers.items():
            num_output = request.num_output_tokens
            num_new = num_output - ledger.num_seen
            num_charged = self._pop_applied(request, ledger)
            if num_new or num_charged:
                ledger.num_seen = num_output
                user = ledger.user
                num_emitted[user] += num_new
                if num_charged > num_new:
                    num_refund[user] += num_charged - num_new
                elif num_new > num_charged:
                    num_late[user] += num_new - num_charged
            # An asynchronous request that was preempted can still receive the
            # output of a step in flight: its ledger stays until it finishes.
            if not ledger.pending and (not self.is_async or request.is_finished()):
                done.append(request)
        for request in done:
            del self._ledgers[request]
        if num_refund:
            later = self._later_takes(num_refund)
            for user, num in num_refund.items():
                self.limiter.refund_settled(user, num, later.get(user, ()))
            self.stats.num_refunded += num_refund.total()
        if num_late:
            self.limiter.take_late(num_late)
            self.stats.num_charged_late += num_late.total()
        self._forget_settled_steps()
        return num_emitted

    def _pop_applied(self, request: DraftingRequest, ledger: RequestLedger) -> int:
        """Pop the dispatches whose output has been applied; returns their charge."""
        pending = ledger.pending
        if not pending:
            return 0
        if not self.is_async or request.is_finished():
            num_charged = sum(d.num_charged for d in pending)
            pending.clear()
            return num_charged
        # Upstream's in-flight placeholders cover the newest dispatches (its
        # preemption zeroes them: then every dispatch counts as applied).
        num_in_flight = request.num_output_placeholders
        num_pending = sum(d.num_placeholders for d in pending)
        num_charged = 0
        while pending and num_pending > num_in_flight:
            dispatch = pending.popleft()
            num_pending -= dispatch.num_placeholders
            num_charged += dispatch.num_charged
        return num_charged

    def _later_takes(self, users_refunded: Container[str]) -> dict[str, list[tuple[int, int]]]:
        """user -> (dispatch time, tokens) of its steps still in flight, oldest first,
        for the users refunded (asynchronous scheduling only has any)."""
        if not self.is_async:
            return {}
        # user -> step -> tokens charged in that step, not settled.
        num_by_step: dict[str, Counter[int]] = {}
        for ledger in self._ledgers.values():
            user = ledger.user
            if ledger.pending and user in users_refunded:
                steps = num_by_step.setdefault(user, Counter())
                for dispatch in ledger.pending:
                    steps[dispatch.step] += dispatch.num_charged
        at = self._dispatched_at
        return {
            user: [(at[step], num) for step, num in sorted(steps.items())]
            for user, steps in num_by_step.items()
        }

    def _forget_settled_steps(self) -> None:
        oldest = min(
            (ledger.pending[0].step for ledger in self._ledgers.values() if ledger.pending),
            default=None,
        )
        at = self._dispatched_at
        for step in [s for s in at if oldest is None or s < oldest]:
            del at[step]

    @property
    def num_pending(self) -> int:
        """Dispatched steps not settled yet, over all requests."""
        return sum(len(ledger.pending) for ledger in self._ledgers.values())


def _by_position(requests: list[DraftingRequest], num: int) -> list[int]:
    """``num`` drafts over ``requests``: every request's first draft, then every
    second, ... (in list order); returns the number each keeps."""
    lengths = [len(r.spec_token_ids) for r in requests]
    kept = [0] * len(requests)
    position = 0
    while num > 0:
        for i, length in enumerate(lengths):
            if length > position:
                kept[i] += 1
                num -= 1
                if not num:
                    break
        position += 1
    return kept
