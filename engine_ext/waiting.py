"""A waiting queue indexed by user, that upstream's admission loop reads through a gate.

vLLM's ``Scheduler`` keeps waiting requests in ``RequestQueue`` objects (``waiting``,
``kv_holding_waiting``, and from 0.34 ``async_kv_waiting``) and admits them by peeking
at their heads. ``UserIndexedQueue`` implements that same interface, so it can stand in
for each of them:

- It holds every waiting request (``len()`` is the real count, so upstream's
  rules that read the queue length, like the long-prefill threshold, see what
  they would see without the plugin) in one ordered heap per user, and a heap
  of each user's head, so the global head is found in O(log users).
- Outside ``schedule()`` (no gate) it orders requests exactly as upstream's
  queue for the policy does: FCFS with ``prepend_request`` putting a request in
  front, or priority order.
- While a ``Gate`` is installed (for the length of one ``schedule()``), the head
  upstream sees is the first request whose user the gate admits. The gate is
  asked once per request it admits and the answer for a refused user holds for
  the whole step, so a user with 2,000 requests held back costs one check per
  step, and a request behind them is seen at once. When the gate refuses
  nobody, upstream sees the same queue as without the plugin.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy

if TYPE_CHECKING:
    from vllm.v1.request import Request

# (sort key, request): the key is unique per insertion, so heap comparisons
# never reach the request.
_Entry = tuple[tuple, "Request"]


class Gate(Protocol):
    def admits(self, user: str, request: Request) -> bool:
        """Whether ``request`` (of ``user``) may be offered to admission now."""
        ...


class UserIndexedQueue(RequestQueue):
    def __init__(self, policy: SchedulingPolicy, user_of: Callable[[Request], str]) -> None:
        self._is_fcfs = policy == SchedulingPolicy.FCFS
        self._user_of = user_of
        # user -> heap of that user's waiting requests, in queue order.
        self._by_user: dict[str, list[_Entry]] = {}
        # (head key, user) for every user with requests; stale entries (the
        # user's head has changed since) are dropped when they surface.
        self._heads: list[tuple[tuple, str]] = []
        self._num_requests = 0
        # FCFS keys: appended requests count up, prepended ones count down.
        self._next_back = itertools.count(1)
        self._next_front = itertools.count(-1, -1)
        self._gate: Gate | None = None
        # Users the installed gate refused; their head entries wait here.
        self._gated_out: dict[str, tuple[tuple, str]] = {}

    # ---- the gate -------------------------------------------------------

    def install_gate(self, gate: Gate) -> None:
        assert self._gate is None, "gate already installed"
        self._gate = gate

    def remove_gate(self) -> None:
        self._gate = None
        for entry in self._gated_out.values():
            heapq.heappush(self._heads, entry)
        self._gated_out.clear()

    # ---- per-user views (for the scheduler's pre-pass) -------------------

    def users(self) -> Iterable[str]:
        """Users with waiting requests."""
        return self._by_user.keys()

    def num_requests_of(self, user: str) -> int:
        return len(self._by_user.get(user, ()))

    # ---- RequestQueue ---------------------------------------------------

    def add_request(self, request: Request) -> None:
        key = (next(self._next_back),) if self._is_fcfs else self._priority_key(request)
        self._push(request, key)

    def prepend_request(self, request: Request) -> None:
        # A priority queue has no front: prepending is adding (as upstream's).
        key = (next(self._next_front),) if self._is_fcfs else self._priority_key(request)
        self._push(request, key)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        # Same order as upstream's ``deque.extendleft``: the last one ends up first.
        for request in requests:
            self.prepend_request(request)

    def peek_request(self) -> Request:
        head = self._head()
        if head is None:
            raise IndexError("peek from an empty queue")
        return head[1]

    def pop_request(self) -> Request:
        head = self._head()
        if head is None:
            raise IndexError("pop from an empty queue")
        user = head[0]
        queue = self._by_user[user]
        _, request = heapq.heappop(queue)
        heapq.heappop(self._heads)
        self._num_requests -= 1
        if queue:
            heapq.heappush(self._heads, (queue[0][0], user))
        else:
            del self._by_user[user]
        return request

    def remove_request(self, request: Request) -> None:
        if not self._remove_all([request]):
            raise ValueError(f"request {request.request_id} is not in the queue")

    def remove_requests(self, requests: Iterable[Request]) -> None:
        self._remove_all(requests)

    def __bool__(self) -> bool:
        # Upstream asks this right before peeking; under a gate it means
        # "has a request to offer", which may consult the gate.
        if self._gate is None:
            return self._num_requests > 0
        return self._head() is not None

    def __len__(self) -> int:
        return self._num_requests

    def __iter__(self) -> Iterator[Request]:
        # In queue order, lazily: vLLM 0.34's cache-aware admission reads the first few
        # requests every step (islice), which then costs O(n) to copy the heaps, not a sort.
        return (
            request for _, request in heapq.merge(*map(_in_order_lazily, self._by_user.values()))
        )

    # What code outside the plugin may do with upstream's FCFS queue (a ``deque``):
    # index it, slice it, reverse it, test membership. O(n log n) each; the
    # scheduler's own path never calls these.

    def __getitem__(self, index: int | slice) -> Request | list[Request]:
        return self._in_order()[index]

    def __reversed__(self) -> Iterator[Request]:
        return reversed(self._in_order())

    def __contains__(self, request: object) -> bool:
        try:
            queue = self._by_user.get(self._user_of(request))  # type: ignore[arg-type]
        except KeyError:  # a request the scheduler does not hold
            return False
        return queue is not None and any(r is request for _, r in queue)

    def _in_order(self) -> list[Request]:
        entries = [e for queue in self._by_user.values() for e in queue]
        entries.sort(key=lambda e: e[0])
        return [request for _, request in entries]

    # ---- internals ------------------------------------------------------

    def _priority_key(self, request: Request) -> tuple:
        # Upstream's ``Request.__lt__``: priority, arrival time, request id.
        return (request.priority, request.arrival_time, request.request_id, next(self._next_back))

    def _push(self, request: Request, key: tuple) -> None:
        user = self._user_of(request)
        queue = self._by_user.setdefault(user, [])
        old_head = queue[0][0] if queue else None
        heapq.heappush(queue, (key, request))
        self._num_requests += 1
        if queue[0][0] == old_head:
            return
        if user in self._gated_out:
            self._gated_out[user] = (key, user)
        else:
            heapq.heappush(self._heads, (key, user))

    def _head(self) -> tuple[str, Request] | None:
        """(user, request) upstream should see first, consulting the gate."""
        heads = self._heads
        gate = self._gate
        while heads:
            key, user = heads[0]
            queue = self._by_user.get(user)
            if not queue or queue[0][0] != key:
                heapq.heappop(heads)  # stale
                continue
            request = queue[0][1]
            if gate is None or gate.admits(user, request):
                return user, request
            self._gated_out[user] = heapq.heappop(heads)
        return None

    def _remove_all(self, requests: Iterable[Request]) -> int:
        """Remove those of ``requests`` that are queued; one pass per user."""
        # user -> ids of the requests to remove from that user's heap.
        ids_by_user: dict[str, set[int]] = {}
        for request in requests:
            ids_by_user.setdefault(self._user_of(request), set()).add(id(request))
        num_removed = 0
        for user, ids in ids_by_user.items():
            queue = self._by_user.get(user)
            if not queue:
                continue
            kept = [entry for entry in queue if id(entry[1]) not in ids]
            if len(kept) == len(queue):
                continue
            num_removed += len(queue) - len(kept)
            old_head = queue[0][0]
            if not kept:
                del self._by_user[user]
                self._gated_out.pop(user, None)
                continue
            heapq.heapify(kept)
            self._by_user[user] = kept
            new_head = kept[0][0]
            if new_head == old_head:
                continue
            if user in self._gated_out:
                self._gated_out[user] = (new_head, user)
            else:
                heapq.heappush(self._heads, (new_head, user))
        self._num_requests -= num_removed
        return num_removed


def _in_order_lazily(heap: list[_Entry]) -> Iterator[_Entry]:
    """The entries of ``heap`` in order, from a copy (the queue may change meanwhile)."""
    entries = list(heap)
    while entries:
        yield heapq.heappop(entries)
