"""One fleet view on every replica: two real `output-rate serve` replicas on one
PostgreSQL database, engines that are real push clients (and an API server that is a real
key client) in this process, each connected to one replica only. GET /usage, /engines and
/metrics on either replica show every engine's usage; a killed replica's stops counting;
the follower shows the leader's fleet shares; an engine's API server is bound on one
replica at a time. The replicas are started once for the module; the tests run in order."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from control_plane.replicas.live_usage import FRESH_S, SHARE_INTERVAL_S
from engine_ext.key_client import KeyClient
from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import PushClient
from harness.control_plane import Served, fresh_database, kill_hard, serve
from output_rate_core import protocol as p

WAIT_S = 30.0
FLEET_LIMIT = 40


class Engine:
    """A push client reporting fixed counts per report: x on every engine (half its
    steps throttled), and a user of its own (``solo``) with ``solo_throttled`` refused
    steps per report."""

    def __init__(self, name: str, endpoint: str, solo: str, solo_throttled: int = 0) -> None:
        self.name = name
        self.solo = solo
        self.solo_throttled = solo_throttled
        self.limiter = OutputRateLimiter(None)
        self.streams: dict[str, int] = {}
        self.client = PushClient(
            endpoints=[endpoint], engine_id=name, model="tiny", server_public_key=None
        )

    def pump(self) -> None:
        self.client.apply_pending(self.limiter)
        throttled = {"x": 5}
        if self.solo_throttled:
            throttled[self.solo] = self.solo_throttled
        self.client.report_usage(granted={"x": 5, self.solo: 5}, throttled=throttled)
        self.client.report_demand(dict(self.streams))


@dataclass
class Fleet:
    a: Served
    b: Served
    engines: list[Engine]
    url: str
    workdir: Path

    def pump_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for engine in self.engines:
                engine.pump()
            time.sleep(0.05)

    def until(self, condition: Callable[[], bool], timeout_s: float = WAIT_S) -> float:
        """Pump every engine until ``condition``; the seconds it took."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            for engine in self.engines:
                engine.pump()
            if condition():
                return time.monotonic() - start
            time.sleep(0.05)
        raise AssertionError("not reached")


def usage(replica: Served) -> dict[str, dict[str, float]]:
    with replica.client() as http:
        return {row["user"]: row for row in http.get("/usage").json()["items"]}


def api_version(replica: Served, engine_id: str) -> int | None:
    with replica.client() as http:
        rows = {e["engine_id"]: e for e in http.get("/engines").json()["items"]}
    return rows[engine_id]["api_applied_version"] if engine_id in rows else None


def readiness(replica: Served) -> dict[str, object]:
    return httpx.get(f"{replica.url}/readyz", timeout=5).json()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet-view")
    with ExitStack() as stack:
        url = stack.enter_context(fresh_database("postgres", tmp))
        a = stack.enter_context(serve(url, tmp, env={"OUTPUT_RATE_REPLICA_ID": "replica-a"}))
        b = stack.enter_context(serve(url, tmp, env={"OUTPUT_RATE_REPLICA_ID": "replica-b"}))
        engines = [Engine("ea", a.zmq_endpoint, "ya"), Engine("eb", b.zmq_endpoint, "yb", 15)]
        for engine in engines:
            engine.client.start()
            stack.callback(engine.client.close)
        made = Fleet(a, b, engines, url, tmp)
        made.until(lambda: all(e.client.has_snapshot for e in engines))
        yield made


def shows_both(replica: Served) -> bool:
    rows = usage(replica)
    return {"x", "ya", "yb"} <= set(rows) and all(
        rows[u]["output_tokens_per_second_10s"] > 0 for u in ("ya", "yb")
    )


def test_every_replica_shows_the_usage_of_engines_connected_to_the_other(fleet: Fleet) -> None:
    for replica in (fleet.a, fleet.b):
        fleet.until(lambda replica=replica: shows_both(replica))
    # Let every engine's window fill on both replicas, then compare figures that do not
    # depend on timing: x is reported on both engines with each engine's own user's
    # tokens, so its rate is their sum; the fractions are fixed by the counts.
    fleet.pump_for(3.0)
    for replica in (fleet.a, fleet.b):
        rows = usage(replica)
        for window in ("1s", "10s"):
            key = f"output_tokens_per_second_{window}"
            assert rows["x"][key] == pytest.approx(rows["ya"][key] + rows["yb"][key], abs=0.01)
        assert rows["x"]["throttled_fraction"] == 0.5
        assert rows["ya"]["throttled_fraction"] == 0.0
        assert rows["yb"]["throttled_fraction"] == 0.75  # yb is only on eb (replica b)
    # GET /engines: both engines, connected, on either replica.
    for replica in (fleet.a, fleet.b):
        with replica.client() as http:
            listed = {e["engine_id"]: e["connected"] for e in http.get("/engines").json()["items"]}
        assert listed == {"ea": True, "eb": True}
    # /metrics on each replica: the other's engine's report age and users.
    for replica, other_engine, other_user in ((fleet.a, "eb", "yb"), (fleet.b, "ea", "ya")):
        age = replica.metric(
            "output_rate_usage_report_age_seconds", f'{{engine_id="{other_engine}"}}'
        )
        assert 0 <= age < FRESH_S + SHARE_INTERVAL_S + 1
        rate = replica.metric(
            "output_rate_user_output_tokens_per_second", f'{{user="{other_user}"}}'
        )
        assert rate > 0
        # One row per engine a second, one transaction a second (upper bounds).
        assert replica.metric("output_rate_live_usage_rows_written") > 0
    # The received rate of GET /limits/{user} too.
    with fleet.a.client() as http:
        received = http.get("/limits/yb").json()["received_output_tokens_per_second"]
    assert received is not None and received > 0


def test_a_killed_replicas_usage_stops_counting(fleet: Fleet) -> None:
    with serve(fleet.url, fleet.workdir, env={"OUTPUT_RATE_REPLICA_ID": "replica-c"}) as c:
        ec = Engine("ec", c.zmq_endpoint, "yc")
        ec.client.start()
        fleet.engines.append(ec)
        try:
            fleet.until(lambda: "yc" in usage(fleet.a) and "yc" in usage(fleet.b))
            kill_hard(c)
            fleet.engines.remove(ec)
            took = fleet.until(lambda: "yc" not in usage(fleet.a) and "yc" not in usage(fleet.b))
        finally:
            ec.client.close()
            if ec in fleet.engines:
                fleet.engines.remove(ec)
    # Its rows stop counting once they are FRESH_S old: its last write was at most one
    # interval before the kill (plus the time to read it here).
    assert took <= FRESH_S + SHARE_INTERVAL_S + 2.0
    # The others' engines still count.
    assert shows_both(fleet.a) and shows_both(fleet.b)


def test_the_follower_shows_the_shares_the_leader_decided(fleet: Fleet) -> None:
    with fleet.a.client() as http:
        response = http.put("/limits/f", json={"output_tokens_per_second": FLEET_LIMIT})
        assert response.status_code == 200, response.text
    ea, eb = fleet.engines
    ea.streams, eb.streams = {"f": 3}, {"f": 1}
    expected = [
        {"engine_id": "ea", "output_tokens_per_second": 30.0},
        {"engine_id": "eb", "output_tokens_per_second": 10.0},
    ]

    def shares(replica: Served) -> list[dict[str, object]]:
        with replica.client() as http:
            return http.get("/limits/f").json()["shares"]

    fleet.until(lambda: ea.limiter.milli_rate_of("f") == 30_000)
    fleet.until(lambda: eb.limiter.milli_rate_of("f") == 10_000)
    leader, follower = (fleet.a, fleet.b) if readiness(fleet.a)["leader"] else (fleet.b, fleet.a)
    assert not readiness(follower)["leader"]
    fleet.until(lambda: shares(leader) == expected)
    fleet.until(lambda: shares(follower) == expected, timeout_s=FRESH_S + 2 * SHARE_INTERVAL_S)
    with follower.client() as http:
        listed = {
            e["engine_id"]: e["num_shared_users"] for e in http.get("/engines").json()["items"]
        }
    assert (listed["ea"], listed["eb"]) == (1, 1)  # (and ec, of the killed replica: 0)


def test_an_api_server_live_on_one_replica_cannot_be_claimed_on_the_other(fleet: Fleet) -> None:
    api = KeyClient(
        endpoints=[fleet.a.zmq_endpoint], engine_id="ea", model="tiny", server_public_key=None
    )
    api.start()
    try:
        fleet.until(lambda: api.has_snapshot)
        # Its row (homed at a) is written once it acknowledged its snapshot.
        fleet.until(lambda: api_version(fleet.b, "ea") is not None)
        fleet.b.assert_bind_refused_elsewhere(p.encode(p.Hello("ea", "tiny", 0, p.API_ROLE)))
        assert api.has_snapshot and api.is_in_sync
    finally:
        api.close()
