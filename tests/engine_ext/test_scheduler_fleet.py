"""The real scheduler reports its fleet demand through the real push client to a
scripted server (a real ROUTER socket on 127.0.0.1), and enforces the shares it gets."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine_ext import vllm_compat
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

    def next_demand(self, until: Callable[[p.Demand], bool]) -> p.Demand:
        """The first Demand frame the server receives from now on for which ``until`` holds."""
        while True:
            demand = self.server.recv(p.Demand)[1]
            assert isinstance(demand, p.Demand)
            if until(demand):
                return demand

    def step(self, num_steps: int = 1, step_ms: float = STEP_MS) -> Counter[str]:
        """Drive the scheduler; how many tokens each user was sampled."""
        trace = drive(self.sched, num_steps=num_steps, clock=self.clock, step_ms=step_ms)
        self.finished |= trace.finished
        return Counter(self.users[req_id] for _, req_id in trace.samples)


@contextmanager
def fleet_engine(
    *, async_scheduling: bool, max_num_seqs: int = 16, snapshot: p.Snapshot = SNAP
) -> Iterator[FleetEngine]:
    """The real output-rate scheduler on a fake clock with the real push client attached,
    connected to a scripted server that has sent it `snapshot` (SNAP: 2 engines in the
    fleet)."""
    server = ScriptedServer()
    clock = FakeClock()
    # A default rate turns limiting on; SNAP replaces it.
    sched: Any = make_scheduler(
        async_scheduling=async_scheduling, default_rate=1, clock=clock, max_num_seqs=max_num_seqs
    )
    client = PushClient(
        endpoints=[server.endpoint], engine_id="e1", model="tiny", server_public_key=None
    )
    client.start()
    try:
        identity, hello = server.recv(p.Hello)
        # It names the vLLM release it runs on (this suite runs on each supported one).
        assert isinstance(hello, p.Hello)
        assert hello.vllm_version == vllm_compat.installed_vllm_version()
        assert hello.vllm_version.split("+")[0] in vllm_compat.SUPPORTED_VLLM_VERSIONS
        server.send(identity, snapshot)
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
        # Inside the 250 ms report interval a new user goes out at the first step that is
        # DEMAND_MIN_SPACING_NS (125 ms) after the last report: not 1 ms later, at 130 ms.
        engine.add("b", 50)
        engine.add("a", 50)
        engine.step(step_ms=1)
        with pytest.raises(AssertionError, match="no Demand"):
            engine.server.recv(p.Demand, timeout_s=0.2)
        engine.step(num_steps=2, step_ms=130)
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
        # Earlier reports first (a whole map may restate a: 2 or a: 1).
        engine.next_demand(lambda d: d.streams.get("a", 0) == 0 and (d.full or "a" in d.streams))


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


@both_schedulers
def test_a_user_whose_requests_cannot_run_is_reported_stalled(async_scheduling: bool) -> None:
    """Every running slot taken by an engine-scoped user's streams: the fleet user's request
    waits, and the engine says it cannot use that user's share (docs/fleet.md, "Demand");
    once a slot frees, it is no longer stalled."""
    with fleet_engine(async_scheduling=async_scheduling, max_num_seqs=2) as engine:
        engine.add("e", 3)
        engine.add("e", 3)
        engine.step(step_ms=1)
        engine.add("a", 50)
        engine.step(num_steps=2, step_ms=130)
        demand = engine.next_demand(lambda d: "a" in d.streams)
        assert demand.streams["a"] == 1 and demand.stalled == ["a"]
        # The engine-scoped streams end (3 tokens each): "a" runs, and is stalled no more.
        engine.step(num_steps=40, step_ms=130)
        engine.next_demand(lambda d: not d.stalled)


@both_schedulers
def test_a_saturated_engine_counts_only_the_streams_it_runs(async_scheduling: bool) -> None:
    """Every running slot taken: a fleet user's requests waiting for a slot would not use a
    larger share, so its demand here is the streams it runs (one, not three); once a slot
    frees and a second one runs, two (docs/fleet.md, "Demand")."""
    with fleet_engine(async_scheduling=async_scheduling, max_num_seqs=2) as engine:
        engine.add("e", 3)
        engine.step(step_ms=1)
        for _ in range(3):
            engine.add("a", 50)
        engine.step(num_steps=2, step_ms=130)
        demand = engine.next_demand(lambda d: "a" in d.streams)
        assert demand.streams["a"] == 1 and demand.stalled == []
        # The engine-scoped stream ends (3 tokens): "a" runs on both slots, one still waits.
        engine.step(num_steps=40, step_ms=130)
        engine.next_demand(lambda d: d.streams.get("a") == 2)


@both_schedulers
def test_an_idle_engine_takes_the_fleet_size_its_safe_shares_divide_by(
    async_scheduling: bool,
) -> None:
    with fleet_engine(async_scheduling=async_scheduling) as engine:
        server, sched = engine.server, engine.sched
        # Never a request: still, after its snapshot it says its (empty) whole demand, so
        # the control plane sends it a full table, and with it the fleet size.
        assert not sched.has_requests()
        assert server.recv(p.Demand)[1] == p.Demand("e1", True, {})
        # Another engine left: one engine now, a's safe share is its whole limit.
        server.send(engine.identity, p.Shares(4, 1, 60_000, 1, True, {}))
        assert server.recv(p.ShareAck)[1] == p.ShareAck("e1", 4, 1)
        assert sched.output_rate_limiter.milli_rate_of("a") == 40_000
        server.send(engine.identity, p.Shares(4, 2, 60_000, 3, False, {}))
        server.recv(p.ShareAck)
        assert sched.output_rate_limiter.milli_rate_of("a") == 40_000 // 3
        assert sched.push_client.table.num_engines == 3


@both_schedulers
def test_a_borrowers_usage_report_carries_the_tokens_it_borrowed(async_scheduling: bool) -> None:
    # c: 20 tok/s on this engine, may borrow up to 60 when nobody else needs the capacity.
    snapshot = p.Snapshot(
        version=3,
        default_rate=None,
        tiers={},
        users={"c": (None, 20), "d": (None, 20)},
        user_scopes={"c": "engine", "d": "engine"},
        user_ceilings={"c": 60},
    )
    with fleet_engine(async_scheduling=async_scheduling, snapshot=snapshot) as engine:
        for _ in range(4):
            engine.add("c", 2000)
            engine.add("d", 2000)
        # 3 s of 10 ms steps: reports at each second of the engine's clock.
        sampled = engine.step(num_steps=300)
        granted: Counter[str] = Counter()
        borrowed: Counter[str] = Counter()
        while True:
            try:
                _, report = engine.server.recv(p.Usage, timeout_s=2.0)
            except AssertionError:
                break  # the rest of the last second goes with the next report
            assert isinstance(report, p.Usage)
            granted.update(report.granted)
            borrowed.update(report.borrowed_counts)
    assert sum(granted.values()) > 0.5 * sampled.total()
    # d (no ceiling) borrowed none, c beyond its rate: its tokens within the rate are d's.
    assert set(borrowed) == {"c"}
    assert 0 < borrowed["c"] < granted["c"]
    assert granted["c"] - borrowed["c"] == pytest.approx(granted["d"], abs=4)
