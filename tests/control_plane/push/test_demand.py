"""The bounds on one engine connection's Demand frames (control_plane/push/demand.py),
on the control plane's clock."""

from __future__ import annotations

from control_plane.push.demand import IMPLAUSIBLE_FACTOR, DemandBounds, engine_capacity
from output_rate_core import protocol as p


def demand(streams: dict[str, int], *, full: bool = False) -> p.Demand:
    return p.Demand("e1", full, streams)


def test_the_capacity_said_at_hello_is_used_up_to_the_most_taken() -> None:
    assert engine_capacity(0) == p.DEFAULT_ENGINE_CAPACITY
    assert engine_capacity(256) == 256
    assert engine_capacity(2**31) == p.MAX_ENGINE_CAPACITY


def test_a_count_over_capacity_is_cut_named_and_beyond_any_queue_flagged() -> None:
    bounds = DemandBounds(capacity=256)
    passed, flagged = bounds.bound(demand({"a": 3, "b": 300}))
    assert flagged == ""
    assert passed.streams == {"a": 3, "b": 256} and passed.over_capacity == ["b"]
    passed, flagged = bounds.bound(demand({"tenant": 2**53}))
    assert passed.streams == {"tenant": 256}
    assert flagged == "9007199254740992 streams of one user (capacity 256)"
    assert bounds.num_implausible == 1 and bounds.total == 3 + 256 + 256


def test_frames_over_the_rates_are_refused_and_counted() -> None:
    bounds = DemandBounds(capacity=8)
    admitted = [bounds.admit(0.0, 100) for _ in range(100)]
    assert sum(admitted) == p.MAX_DEMAND_FRAME_BURST
    assert bounds.num_refused == 100 - p.MAX_DEMAND_FRAME_BURST
    # A second later the rate's worth passes again.
    assert sum(bounds.admit(1.0, 100) for _ in range(100)) == int(p.MAX_DEMAND_FRAMES_PER_S)
    # Bytes: one largest frame at once, then the byte rate's worth a second.
    by_size = DemandBounds(capacity=8)
    assert by_size.admit(10.0, p.MAX_ENGINE_MESSAGE_BYTES)
    assert not by_size.admit(10.0, 1024)
    assert by_size.admit(11.0, p.MAX_DEMAND_BYTES_PER_S)


def test_users_are_bounded_whatever_the_frames_name() -> None:
    bounds = DemandBounds(capacity=p.MAX_ENGINE_CAPACITY)
    for start in range(0, 3 * p.MAX_DEMAND_USERS, p.MAX_DEMAND_USERS):
        frame = demand({f"u{i}": 1 for i in range(start, start + p.MAX_DEMAND_USERS)})
        _, flagged = bounds.bound(frame)
    assert len(bounds.streams) == p.MAX_DEMAND_USERS
    assert flagged == f"demand for over {p.MAX_DEMAND_USERS} users"
    # A full map starts over: what it names is all the engine holds.
    bounds.bound(demand({"x": 2}, full=True))
    assert bounds.streams == {"x": 2} and bounds.total == 2


def test_a_total_beyond_any_queue_is_flagged() -> None:
    bounds = DemandBounds(capacity=4)
    users = {f"u{i}": 4 for i in range(IMPLAUSIBLE_FACTOR + 1)}
    _, flagged = bounds.bound(demand(users))
    assert flagged == f"{4 * (IMPLAUSIBLE_FACTOR + 1)} streams in all (capacity 4)"


def usage(
    granted: dict[str, int], throttled: dict[str, int], would: dict[str, int] | None = None
) -> p.Usage:
    return p.Usage("e1", 1.0, granted, throttled, would_throttle=would or {})


def test_usage_names_the_users_with_demand_whose_claims_it_bears_out() -> None:
    """A user is evidenced when the report granted it a token a second per stream claimed,
    or counted throttled or would-throttle steps of it. A report that changes the set passes
    on a Demand of no streams naming it all, with the stalled set as last passed; one that
    changes nothing, or names users without demand here, passes nothing."""
    bounds = DemandBounds(capacity=8)
    passed, _ = bounds.bound(p.Demand("e1", True, {"a": 1, "b": 4, "s": 1}, stalled=["s"]))
    assert passed.evidenced == []
    # a: 5 tokens for 1 stream; b: 3 tokens for 4 streams, not throttled; x: no demand here.
    made = bounds.usage("e1", usage({"a": 5, "b": 3}, {"x": 9}), now=0.0)
    assert made == p.Demand("e1", False, {}, stalled=["s"], evidenced=["a"])
    assert bounds.usage("e1", usage({"a": 2, "b": 3}, {}), now=0.0) is None
    # Held back by its share: throttled (or, in shadow, would-throttle) steps.
    made = bounds.usage("e1", usage({"b": 1}, {}, would={"b": 2}), now=0.0)
    assert made is not None and made.evidenced == ["a", "b"]
    assert bounds.usage("e1", usage({}, {"b": 1}), now=0.0) is None
    # Fewer tokens than a second's per stream over the interval; b, not named, keeps its state.
    made = bounds.usage("e1", p.Usage("e1", 2.0, {"a": 1}, {}), now=0.0)
    assert made is not None and made.evidenced == ["b"]
    # Every frame passed on names the whole set.
    passed, _ = bounds.bound(demand({"a": 2}))
    assert passed.evidenced == ["b"]


def test_evidence_ends_with_the_demand_and_frames_made_keep_the_rate() -> None:
    bounds = DemandBounds(capacity=8)
    bounds.bound(demand({"a": 1}))
    assert bounds.usage("e1", usage({}, {"a": 1}), now=0.0) is not None
    passed, _ = bounds.bound(demand({"a": 0}))
    assert passed.evidenced == []
    passed, _ = bounds.bound(demand({"a": 1}))
    assert passed.evidenced == []  # back with no evidence
    # A flood of changing reports makes frames only within the connection's frame rate.
    made = [bounds.usage("e1", usage({"a": i % 2}, {}), now=10.0) for i in range(1, 101)]
    assert sum(m is not None for m in made) == p.MAX_DEMAND_FRAME_BURST
