"""UserIndexedQueue against vLLM's own request queues (of each release).

Without a gate it must order requests exactly as upstream's queue for the
policy; with a gate, refused users' requests are passed over for the step and
everything else keeps that order.
"""

from __future__ import annotations

import itertools
import random

import pytest
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue

from engine_ext.waiting import UserIndexedQueue
from harness.scheduler import make_request

POLICIES = pytest.mark.parametrize(
    "policy", [SchedulingPolicy.FCFS, SchedulingPolicy.PRIORITY], ids=["fcfs", "priority"]
)


def user_of(request) -> str:
    return request.sampling_params.extra_args["output_rate_user"]


def make_queued(user: str, rng: random.Random):
    request = make_request(user)
    request.priority = rng.randint(0, 2)
    request.arrival_time = float(rng.randint(0, 5))
    return request


class RefuseUsers:
    """A gate that refuses a fixed set of users and records what it was asked."""

    def __init__(self, refused: set[str]) -> None:
        self.refused = refused
        self.asked: list[str] = []

    def admits(self, user: str, request) -> bool:
        self.asked.append(request.request_id)
        return user not in self.refused


@POLICIES
@pytest.mark.parametrize("seed", range(5))
def test_orders_like_upstream_queue_under_random_operations(policy, seed: int) -> None:
    rng = random.Random(seed)
    ours = UserIndexedQueue(policy, user_of)
    theirs = create_request_queue(policy)
    for _ in range(600):
        op = rng.random()
        if op < 0.4 or not theirs:
            request = make_queued(rng.choice("abcd"), rng)
            if rng.random() < 0.5:
                ours.add_request(request)
                theirs.add_request(request)
            else:
                ours.prepend_request(request)
                theirs.prepend_request(request)
        elif op < 0.6:
            assert ours.pop_request() is theirs.pop_request()
        elif op < 0.7:
            requests = [theirs.pop_request() for _ in range(min(len(theirs), 3))]
            for r in requests:
                ours.remove_request(r)
            ours.prepend_requests(reversed(requests))
            theirs.prepend_requests(reversed(requests))
        elif op < 0.85:
            victims = rng.sample(list(theirs), k=min(len(theirs), rng.randint(1, 4)))
            ours.remove_requests(victims)
            theirs.remove_requests(victims)
        else:
            victim = rng.choice(list(theirs))
            ours.remove_request(victim)
            theirs.remove_request(victim)
        assert len(ours) == len(theirs)
        assert bool(ours) == bool(theirs)
        if theirs:
            assert ours.peek_request() is theirs.peek_request()
    assert list(ours) == list(theirs)


@POLICIES
def test_gate_passes_over_refused_users_and_keeps_the_order(policy) -> None:
    rng = random.Random(3)
    queue = UserIndexedQueue(policy, user_of)
    reference = create_request_queue(policy)
    for i in range(300):
        request = make_queued("hog" if i < 290 else rng.choice(["x", "y"]), rng)
        queue.add_request(request)
        reference.add_request(request)
    gate = RefuseUsers({"hog"})
    queue.install_gate(gate)
    seen = []
    while queue:
        seen.append(queue.pop_request())
    assert seen == [r for r in reference if user_of(r) != "hog"]
    # The hog was asked about once, not once per queued request.
    num_hog_asks = sum(1 for r in reference if r.request_id in gate.asked and user_of(r) == "hog")
    assert num_hog_asks <= 2
    # Its requests are all still there, and come back when the gate goes.
    assert len(queue) == 290
    queue.remove_gate()
    assert list(queue) == [r for r in reference if user_of(r) == "hog"]
    assert queue.peek_request() is next(iter(queue))


@POLICIES
def test_the_first_requests_are_read_without_ordering_the_whole_queue(policy) -> None:
    """vLLM 0.34's cache-aware admission reads the first requests of ``waiting`` every
    step (``itertools.islice``), then removes and prepends them; the queue keeps up."""
    rng = random.Random(5)
    ours = UserIndexedQueue(policy, user_of)
    theirs = create_request_queue(policy)
    for _ in range(2000):
        request = make_queued(rng.choice("abcdefgh"), rng)
        ours.add_request(request)
        theirs.add_request(request)
    for _ in range(20):
        head = list(itertools.islice(ours, 8))
        assert head == list(itertools.islice(theirs, 8))
        reordered = head[::-1]
        for queue in (ours, theirs):
            queue.remove_requests(head)
            for request in reversed(reordered):
                queue.prepend_request(request)
        assert ours.peek_request() is theirs.peek_request()
        assert ours.pop_request() is theirs.pop_request()
    assert list(ours) == list(theirs)


def test_changes_to_a_gated_out_user_survive_the_step() -> None:
    queue = UserIndexedQueue(SchedulingPolicy.FCFS, user_of)
    hog = [make_request("hog") for _ in range(3)]
    other = make_request("other")
    for r in [*hog, other]:
        queue.add_request(r)
    queue.install_gate(RefuseUsers({"hog"}))
    assert queue.peek_request() is other
    # While gated out, the hog's head is removed and another request prepended.
    queue.remove_request(hog[0])
    front = make_request("hog")
    queue.prepend_request(front)
    assert queue.pop_request() is other
    assert not queue
    assert len(queue) == 3
    queue.remove_gate()
    assert [queue.pop_request() for _ in range(3)] == [front, hog[1], hog[2]]


def test_remove_of_a_request_not_queued_raises_like_upstream() -> None:
    queue = UserIndexedQueue(SchedulingPolicy.FCFS, user_of)
    queue.add_request(make_request("a"))
    with pytest.raises(ValueError):
        queue.remove_request(make_request("a"))
    queue.remove_requests([make_request("b")])  # upstream ignores these
    assert len(queue) == 1


def test_indexing_slicing_reversing_and_membership_work_as_on_upstreams_deque() -> None:
    # Upstream's FCFS queue is a deque; code outside the plugin may index it.
    rng = random.Random(3)
    ours = UserIndexedQueue(SchedulingPolicy.FCFS, user_of)
    theirs = create_request_queue(SchedulingPolicy.FCFS)
    outsider = make_request("a")
    for i in range(30):
        request = make_queued(rng.choice("abc"), rng)
        for queue in (ours, theirs):
            (queue.prepend_request if i % 4 == 0 else queue.add_request)(request)
    assert ours[0] is theirs[0] and ours[-1] is theirs[-1] and ours[7] is theirs[7]
    assert ours[2:9] == list(theirs)[2:9]
    assert list(reversed(ours)) == list(reversed(theirs))
    assert all(request in ours for request in theirs)
    assert outsider not in ours
    with pytest.raises(IndexError):
        ours[30]
