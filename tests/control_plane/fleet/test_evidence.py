"""Demand weighed by evidence (control_plane/fleet/allocator.py ``weigh_by_evidence``;
docs/fleet.md, "Trust"): beside engines whose usage bears out the streams they claim for a
user (control_plane/push/demand.py decides that from their reports), an engine that shows
no such evidence weighs no more than the busiest of them. The allocator on a fake clock
(tests/control_plane/fleet/test_allocator.py's helpers)."""

from __future__ import annotations

import pytest

from control_plane.fleet.allocator import weigh_by_evidence
from output_rate_core.limits import safe_share
from output_rate_core.protocol import MILLI
from tests.control_plane.factories import ack, make_allocator

CAPACITY = 4096


def test_an_engine_without_evidence_weighs_no_more_than_the_busiest_evidenced_one() -> None:
    demand = {"honest": 3, "busy": 7, "rogue": CAPACITY}
    assert weigh_by_evidence(demand, {"honest", "busy"}) == {
        "honest": 3,
        "busy": 7,
        "rogue": 7,
    }
    # Fewer streams than the busiest evidenced engine: unchanged.
    assert weigh_by_evidence({"a": 5, "b": 2}, {"a"}) == {"a": 5, "b": 2}
    # Nobody evidenced, or everybody: the split by streams.
    assert weigh_by_evidence(demand, set()) == demand
    assert weigh_by_evidence(demand, set(demand)) == demand


@pytest.mark.parametrize("evidence", [True, False])
def test_a_rogue_claiming_its_whole_capacity_takes_no_more_than_the_evidenced_engine(
    evidence: bool,
) -> None:
    """A rogue claims exactly its capacity (never cut, never flagged over capacity) and
    its usage does not bear that out; the honest engine's does (its one stream). With the
    evidence the honest engine keeps an even split, its safe share L / 2; without it (the
    rule unused, as before) the rogue takes 4,096 / 4,097 of the limit."""
    alloc, _ = make_allocator("honest", "rogue")
    alloc.set_limit("tenant", 40)
    alloc.set_demand("honest", {"tenant": 1}, full=False)
    alloc.set_demand("rogue", {"tenant": CAPACITY}, full=False)
    for _ in range(4):
        ack(alloc, alloc.step(), "honest", "rogue")
    assert alloc.shares_of("tenant")["honest"] < 20  # the hole: 40,000 / 4,097 milli
    alloc.set_demand("honest", {}, full=False, evidenced=["tenant"] if evidence else [])
    for _ in range(4):
        ack(alloc, alloc.step(), "honest", "rogue")
    shares = alloc.shares_of("tenant")
    if evidence:
        assert shares == {"honest": 20_000, "rogue": 20_000}
        assert shares["honest"] >= safe_share(40 * MILLI, 2)
    else:
        assert shares["honest"] < 20


def test_honest_engines_evidenced_keep_their_split_by_streams() -> None:
    """Engines whose usage bears out their claims split by streams as without the rule; an
    engine without evidence and no more streams than the busiest evidenced one keeps its
    part."""
    alloc, _ = make_allocator("a", "b", "c")
    alloc.set_limit("u", 60)
    alloc.set_demand("a", {"u": 3}, full=False, evidenced=["u"])
    alloc.set_demand("b", {"u": 2}, full=False, evidenced=["u"])
    alloc.set_demand("c", {"u": 1}, full=False, evidenced=[])
    for _ in range(4):
        ack(alloc, alloc.step(), "a", "b", "c")
    assert alloc.shares_of("u") == {"a": 30_000, "b": 20_000, "c": 10_000}


def test_an_engine_not_evidenced_is_lowered_and_its_weight_comes_back_with_evidence() -> None:
    """An engine whose usage does not bear out its streams is lowered to an even split
    with the busiest evidenced engine; once a report bears them out it weighs its
    streams again; with nobody evidenced any more the split is by streams."""
    alloc, _ = make_allocator("many", "few")
    alloc.set_limit("u", 40)
    alloc.set_demand("many", {"u": 3}, full=False, evidenced=[])
    alloc.set_demand("few", {"u": 1}, full=False, evidenced=["u"])
    for _ in range(4):
        ack(alloc, alloc.step(), "many", "few")
    assert alloc.shares_of("u") == {"many": 20_000, "few": 20_000}
    alloc.set_demand("many", {}, full=False, evidenced=["u"])
    for _ in range(4):
        ack(alloc, alloc.step(), "many", "few")
    assert alloc.shares_of("u") == {"many": 30_000, "few": 10_000}
    alloc.set_demand("many", {}, full=False, evidenced=[])
    alloc.set_demand("few", {}, full=False, evidenced=[])
    for _ in range(4):
        ack(alloc, alloc.step(), "many", "few")
    assert alloc.shares_of("u") == {"many": 30_000, "few": 10_000}


def test_evidence_is_kept_when_not_restated_and_lost_when_demand_ends() -> None:
    """``evidenced=None`` (a frame from an older replica) leaves the evidence as it was;
    an engine whose demand ended and comes back starts with none (a rogue cannot keep
    evidence it showed once by leaving and coming back)."""
    alloc, _ = make_allocator("a", "b")
    alloc.set_limit("u", 40)
    alloc.set_demand("a", {"u": 1}, full=False, evidenced=["u"])
    alloc.set_demand("b", {"u": 3}, full=False, evidenced=["u"])
    for _ in range(4):
        ack(alloc, alloc.step(), "a", "b")
    alloc.set_demand("b", {"u": 3}, full=False)
    for _ in range(4):
        ack(alloc, alloc.step(), "a", "b")
    assert alloc.shares_of("u") == {"a": 10_000, "b": 30_000}
    alloc.set_demand("b", {"u": 0}, full=False)
    for _ in range(4):
        ack(alloc, alloc.step(), "a", "b")
    assert "b" not in alloc.shares_of("u")
    alloc.set_demand("b", {"u": 3}, full=False)
    for _ in range(4):
        ack(alloc, alloc.step(), "a", "b")
    assert alloc.shares_of("u") == {"a": 20_000, "b": 20_000}
