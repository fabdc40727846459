"""The real scheduler reports its fleet demand through the real push client to a
scripted server (a real ROUTER socket on 127.0.0.1), and enforces the shares it gets."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine_ext.push_client import PushClient
from engine_ext.scheduler import DEMAND_REPORT_INTERVAL_NS
from harness.scheduler import FakeClock, drive, make_request, make_scheduler
from harness.scripted_server import ScriptedServer
from output_rate_core import protocol as p

SNAP = p.Snapshot(
    version=3,
    default_rate=None,
    tiers={"solo": 40},
    users={"a": (None, 40), "b": (None, 40), "e": ("solo", None)},
    tier_scopes={"solo": "engine"},
    num_engines=2,
)
STEP_MS = 10
BURST_S = 0.1  # the limiter's burst, as docs/fleet.md's bound states it

both_schedulers = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@dataclass
class FleetEngine:
    sched: Any
    server: ScriptedServer
    identity: bytes
    clock: FakeClock
    # request id -> user, for every request added
    users: dict[str, str] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)

    def add(self, user: str, max_tokens: int) -> str:
        request = make_request(user, max_tokens=max_tokens)
        self.users[request.request_id] = user
        self.sched.add_request(request)
        return request.request_id

    def step(self, num_steps: int = 1, step_ms: float = STEP_MS) -> Counter[str]:
        """Drive the scheduler; how many tokens each user was sampled."""
        trace = drive(self.sched, num_steps=num_steps, clock=self.clock, step_ms=step_ms)
        self.finished |= trace.finished
        return Counter(self.users[req_id] for _, req_id in trace.samples)


@contextmanager
def fleet_engine(*, async_scheduling: bool) -> Iterator[FleetEngine]:
    """The real output-rate scheduler on a fake clock with the real push client attached,
    connected to a scripted server that has sent it SNAP (2 engines in the fleet)."""
    server = ScriptedServer()
    clock = FakeClock()
    # A default rate turns limiting on; SNAP replaces it.
    sched: Any = make_scheduler(async_scheduling=async_scheduling, default_rate=1, clock=clock)
    client = PushClient(
        endpoints=[server.endpoint], engine_id="e1", model="tiny", server_public_key=None
    )
    client.start()
    try:
        identity, _ = server.recv(p.Hello)
        server.send(identity, SNAP)
        assert client.wait_for_snapshot(10)
        sched.attach_push_client(client)
        server.pump = sched.apply_control_plane_updates
        yield FleetEngine(sched, server, identity, clock)
    finally:
        client.close()
        server.close()
        sched.shutdown()


def gcra_bound(milli_rate: int, window_s: float) -> int:
    """The most tokens the limiter lets a user take in ``window_s`` at ``milli_rate``:
    the rate over the window and its burst, plus the first token (docs/fleet.md)."""
    return math.floor((window_s + BURST_S) * milli_rate / p.MILLI) + 1


@both_schedulers
def test_a_new_user_is_reported_at_the_next_step_and_engine_scoped_users_never(
    async_scheduling: bool,
) -> None:
    with fleet_engine(async_scheduling=async_scheduling) as engine:
        engine.add("a", 50)
        engine.add("e", 50)
        engine.step(step_ms=1)
        assert engine.server.recv(p.Demand)[1] == p.Demand("e1", True, {"a": 1})
        # 1 ms later, well inside the 250 ms report interval: a new user goes out at once.
        engine.add("b", 50)
        engine.add("a", 50)
        engine.step(step_ms=1)
        assert engine.server.recv(p.Demand)[1] == p.Demand("e1", False, {"a": 2, "b": 1})


@both_schedulers
def test_the_share_binds_and_the_end_of_demand_follows_within_the_interval(
    async_scheduling: bool,
) -> None:
    share = 6_000  # 6 tokens/s for user a on this engine; its limit is 40 over the fleet
    window_s = 2.0
    with fleet_engine(async_scheduling=async_scheduling) as engine:
        server = engine.server
        # a and b: the same fleet limit (40), 2 streams each; e: engine scope (40 here).
        # Unthrottled, each stream takes a token every step: 200 in the window.
        a_ids = {engine.add("a", 12), engine.add("a", 12)}
        for user in ("b", "b", "e", "e"):
            engine.add(user, 1000)
        engine.step(step_ms=1)
        assert server.recv(p.Demand)[1] == p.Demand("e1", True, {"a": 2, "b": 2})
        server.send(engine.identity, p.Shares(1, 1, 60_000, 2, True, {"a": share}))
        assert server.recv(p.ShareAck)[1] == p.ShareAck("e1", 1, 1)
        # a is held to its share; b, with no share, to its safe share: 40 over 2 engines.
        rates = {"a": share, "b": 20_000, "e": 40_000}
        assert {u: engine.sched.output_rate_limiter.milli_rate_of(u) for u in rates} == rates

        tokens = engine.step(round(window_s * 1000 / STEP_MS))
        # Each user gets what its rate allows over the window: within the GCRA bound, and
        # no less than the rate alone allows (the engine had room: e took 40 tokens/s).
        for user, milli_rate in rates.items():
            low, high = window_s * milli_rate / p.MILLI, gcra_bound(milli_rate, window_s)
            assert low <= tokens[user] <= high, (user, tokens, low, high)
        assert tokens == {"a": 12, "b": 40, "e": 82}
        # a's 2 x 12 tokens, less the 2 of its first step, outlast the window at 6 tokens/s
        # (unthrottled they take 12 steps): its demand exceeded the share throughout.
        assert not a_ids & engine.finished

        # Its last 10 tokens come at the share's pace (the first at once, 9 more 1 / 6 s
        # apart: 1.5 s); then the report that a's demand ended is due within one report
        # interval. Nothing reports after the last step driven here, so the Demand naming
        # a with 0 (or a whole map without a) left within it.
        num_steps = 0
        while not a_ids <= engine.finished:
            engine.step()
            num_steps += 1
        assert num_steps == 9 * p.MILLI * 1000 // share // STEP_MS + 1
        engine.step(DEMAND_REPORT_INTERVAL_NS // 1_000_000 // STEP_MS + 1)
        while True:  # earlier reports first (a whole map may restate a: 2 or a: 1)
            demand = server.recv(p.Demand)[1]
            assert isinstance(demand, p.Demand)
            if demand.streams.get("a", 0) == 0 and (demand.full or "a" in demand.streams):
                break


@both_schedulers
def test_an_engine_that_goes_idle_says_its_demand_ended(async_scheduling: bool) -> None:
    with fleet_engine(async_scheduling=async_scheduling) as engine:
        engine.add("a", 2)
        engine.step(step_ms=1)
        assert engine.server.recv(p.Demand)[1] == p.Demand("e1", True, {"a": 1})
        engine.step(20, step_ms=1)  # 20 ms: no periodic report
        assert len(engine.finished) == 1
        # The engine loop asks has_requests() before it blocks on its input queue.
        assert not engine.sched.has_requests()
        assert engine.server.recv(p.Demand)[1] == p.Demand("e1", False, {"a": 0})
