"""The real scheduler reports its fleet demand through the real push client to a
scripted server (a real ROUTER socket on 127.0.0.1), and enforces the shares it gets."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine_ext.push_client import PushClient
from harness.scheduler import FakeClock, drive, make_request, make_scheduler
from output_rate_core import protocol as p
from tests.engine_ext.test_push_client import ScriptedServer

SNAP = p.Snapshot(
    version=3,
    default_rate=None,
    tiers={"solo": 40},
    users={"a": (None, 40), "b": (None, 40), "e": ("solo", None)},
    tier_scopes={"solo": "engine"},
    num_engines=2,
)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def fleet_engine(request: pytest.FixtureRequest) -> Iterator[tuple[Any, ScriptedServer, bytes]]:
    server = ScriptedServer()
    clock = FakeClock()
    sched: Any = make_scheduler(async_scheduling=request.param, default_rate=1, clock=clock)
    sched.use_fake_clock(clock)
    client = PushClient(
        endpoints=[server.endpoint], engine_id="e1", model="tiny", server_public_key=None
    )
    client.start()
    identity, _ = server.recv(p.Hello)
    server.send(identity, SNAP)
    assert client.wait_for_snapshot(10)
    sched.attach_push_client(client)
    sched.clock = clock
    server.pump = sched.apply_control_plane_updates
    yield sched, server, identity
    client.close()
    server.close()
    sched.shutdown()


def test_a_new_user_is_reported_at_the_next_step_and_engine_scoped_users_never(
    fleet_engine: tuple[Any, ScriptedServer, bytes],
) -> None:
    sched, server, _ = fleet_engine
    sched.add_request(make_request("a", max_tokens=50))
    sched.add_request(make_request("e", max_tokens=50))
    drive(sched, num_steps=1, clock=sched.clock, step_ms=1)
    assert server.recv(p.Demand)[1] == p.Demand("e1", True, {"a": 1})
    # 1 ms later, well inside the 250 ms report interval: a new user goes out at once.
    sched.add_request(make_request("b", max_tokens=50))
    sched.add_request(make_request("a", max_tokens=50))
    drive(sched, num_steps=1, clock=sched.clock, step_ms=1)
    assert server.recv(p.Demand)[1] == p.Demand("e1", False, {"a": 2, "b": 1})


def test_the_share_binds_and_the_rest_of_demand_follows_within_the_interval(
    fleet_engine: tuple[Any, ScriptedServer, bytes],
) -> None:
    sched, server, identity = fleet_engine
    sched.add_request(make_request("a", max_tokens=5))
    drive(sched, num_steps=1, clock=sched.clock, step_ms=1)
    server.recv(p.Demand)
    # 2 tokens/s for user a on this engine (its limit is 40 over the fleet).
    server.send(identity, p.Shares(1, 1, 60_000, 2, True, {"a": 2_000}))
    assert server.recv(p.ShareAck)[1] == p.ShareAck("e1", 1, 1)
    assert sched.output_rate_limiter.milli_rate_of("a") == 2_000
    trace = drive(sched, num_steps=200, clock=sched.clock, step_ms=10)  # 2 s
    # Burst and first token aside, 2 tokens/s: at most (2 + 0.1) x 2 + 1 in 2 s.
    assert len(trace.samples) <= 6
    # The request ended: within one report interval its demand is 0 (a whole map,
    # restated every few seconds of wall time, may come instead: it names no "a").
    drive(sched, num_steps=400, clock=sched.clock, step_ms=10)
    _, demand = server.recv(p.Demand)
    assert isinstance(demand, p.Demand)
    assert demand.streams.get("a", 0) == 0


def test_an_engine_that_goes_idle_says_its_demand_ended(
    fleet_engine: tuple[Any, ScriptedServer, bytes],
) -> None:
    sched, server, _ = fleet_engine
    sched.add_request(make_request("a", max_tokens=2))
    drive(sched, num_steps=1, clock=sched.clock, step_ms=1)
    assert server.recv(p.Demand)[1] == p.Demand("e1", True, {"a": 1})
    trace = drive(sched, num_steps=20, clock=sched.clock, step_ms=1)  # 20 ms: no periodic report
    assert trace.finished
    # The engine loop asks has_requests() before it blocks on its input queue.
    assert not sched.has_requests()
    assert server.recv(p.Demand)[1] == p.Demand("e1", False, {"a": 0})
