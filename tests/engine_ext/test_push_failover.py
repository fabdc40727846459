"""An engine fails over between control-plane replicas (--control-plane-endpoint a,b).

Two real `output-rate serve` processes on one PostgreSQL database, sharing one CURVE
server key (the documented replica setup), and a real PushClient with both endpoints
feeding a real limiter in this process. The client syncs from the first; the first is
killed with SIGKILL; within the reconnect timeout the client is on the second and
converges to a version written meanwhile through the second's REST, holding the last
limits in between. The first comes back: changes written through it still arrive (the
second reads the shared change log), and when the second dies the client wraps around
to the first.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from control_plane.config import service as config
from control_plane.db import Database, make_engine
from engine_ext.limit_table import LimitTable
from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import PushClient
from harness.control_plane import fresh_database
from harness.servers import ControlPlane, free_port

pytestmark = pytest.mark.postgres

WAIT_S = 60.0
ENGINE_ID = "fo-engine"
# Shorter than the defaults (3.5 s / 10.5 s) to keep the test short; above the servers'
# 1 s heartbeat, so a live replica is never left.
SILENCE_S = 2.0
RECONNECT_AFTER_S = 4.0

State = tuple[int, int | None, dict[str, int | None]]


class Replicas:
    """Two control planes on one database, one CURVE server identity."""

    def __init__(self, tmp: Path, db_url: str) -> None:
        self.tmp = tmp
        self.db_url = db_url
        self.server_public, server_secret = (k.decode() for k in zmq.curve_keypair())
        engine_public, self.engine_secret = (k.decode() for k in zmq.curve_keypair())
        # The same server secret key on every replica; the engine's key bound to its id.
        self.env = {
            "OUTPUT_RATE_ZMQ_SECRET_KEY": server_secret,
            "OUTPUT_RATE_ZMQ_CLIENT_KEYS": f"{engine_public}={ENGINE_ID}",
        }
        self.ports = [(free_port(), free_port()) for _ in range(2)]
        self.servers: list[ControlPlane | None] = [None, None]
        self.endpoints = [f"tcp://127.0.0.1:{zmq_port}" for _, zmq_port in self.ports]

    def start(self, index: int) -> ControlPlane:
        port, zmq_port = self.ports[index]
        log = self.tmp / f"cp-{index}-{time.monotonic_ns()}.log"
        cp = ControlPlane(log, self.db_url, port, zmq_port, extra_env=self.env)
        self.servers[index] = cp
        cp.wait_ready()
        return cp

    def kill(self, index: int) -> None:
        cp = self.servers[index]
        assert cp is not None
        cp.kill(signal.SIGKILL)
        self.servers[index] = None

    def close(self) -> None:
        for index, cp in enumerate(self.servers):
            if cp is not None:
                self.kill(index)

    def expected(self) -> State:
        """The database's limits, flattened the way engines flatten them."""
        engine = make_engine(self.db_url)
        try:
            snap = Database(engine).read_now(config.load_snapshot)
        finally:
            engine.dispose()
        limiter = OutputRateLimiter(None)
        LimitTable.from_snapshot(snap).load(limiter)
        return snap.version, limiter.default_rate, limiter.user_rates()


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Replicas]:
    with fresh_database("postgres", tmp_path) as db_url:
        replicas = Replicas(tmp_path, db_url)
        try:
            yield replicas
        finally:
            replicas.close()


class Engine:
    def __init__(self, replicas: Replicas) -> None:
        self.limiter = OutputRateLimiter(1)
        self.client = PushClient(
            endpoints=replicas.endpoints,
            engine_id=ENGINE_ID,
            model="tiny",
            server_public_key=replicas.server_public,
            client_secret_key=replicas.engine_secret,
            silence_s=SILENCE_S,
            reconnect_after_s=RECONNECT_AFTER_S,
            heartbeat_interval_s=0.5,
        )
        self.client.start()

    def state(self) -> State:
        """The engine thread's part (apply what arrived, ack), then what it enforces."""
        self.client.apply_pending(self.limiter)
        return self.client.applied_version, self.limiter.default_rate, self.limiter.user_rates()

    def converge(self, want: State) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.state() != want:
            assert time.monotonic() < deadline, f"not converged to {want}: {self.state()}"
            time.sleep(0.02)

    def hold_until_on(self, index: int, held: State) -> float:
        """Wait until the client talks to replica ``index``; until then it must enforce
        ``held``. Returns when it moved (monotonic)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            state = self.state()
            # Read after applying: a snapshot applied above came from the old replica if
            # the client is still on it now (it moves before it dials the next).
            if self.client.endpoint_index == index:
                return time.monotonic()
            assert state == held
            assert time.monotonic() < deadline, "never moved"
            time.sleep(0.02)


def put(cp: ControlPlane, path: str, body: dict[str, object]) -> int:
    response = httpx.put(f"{cp.url}{path}", json=body, headers=cp.auth_headers(), timeout=30)
    assert response.status_code == 200, response.text
    return int(response.json()["version"])


def wait_listed(cp: ControlPlane, version: int) -> None:
    """GET /engines on ``cp`` shows the engine connected at ``version``."""
    deadline = time.monotonic() + WAIT_S
    while True:
        items = httpx.get(f"{cp.url}/engines", headers=cp.auth_headers()).json()["items"]
        rows = {e["engine_id"]: e for e in items}
        row = rows.get(ENGINE_ID)
        if row is not None and row["connected"] and row["applied_version"] == version:
            return
        assert time.monotonic() < deadline, items
        time.sleep(0.1)


def test_an_engine_fails_over_to_the_next_replica_and_back(replicas: Replicas) -> None:
    first = replicas.start(0)
    second = replicas.start(1)
    # Engine scope: the engine enforces the full rates this test checks.
    put(first, "/default-limit", {"output_tokens_per_second": 50, "scope": "engine"})
    put(first, "/tiers/free", {"output_tokens_per_second": 20})
    put(first, "/limits/a", {"tier": "free"})
    put(first, "/limits/b", {"output_tokens_per_second": 7})
    engine = Engine(replicas)
    try:
        before = replicas.expected()
        assert before[1:] == (50, {"a": 20, "b": 7})
        engine.converge(before)
        assert engine.client.endpoint_index == 0
        wait_listed(first, before[0])

        # The first dies; a change is written through the second meanwhile.
        replicas.kill(0)
        killed_at = time.monotonic()
        put(second, "/tiers/free", {"output_tokens_per_second": 33})
        put(second, "/limits/c", {"output_tokens_per_second": 11})
        moved_at = engine.hold_until_on(1, held=before)
        after = replicas.expected()
        engine.converge(after)
        converged_at = time.monotonic()
        assert after[0] > before[0]
        assert after[2] == {"a": 33, "b": 7, "c": 11}
        # Silent for RECONNECT_AFTER_S (from its last heartbeat, up to 1 s before the
        # kill), then one HELLO and one snapshot away.
        assert moved_at - killed_at <= RECONNECT_AFTER_S + 2.0
        assert converged_at - killed_at <= RECONNECT_AFTER_S + 5.0
        wait_listed(second, after[0])
        print(
            f"moved {moved_at - killed_at:.2f}s after the kill, "
            f"converged {converged_at - killed_at:.2f}s after it"
        )

        # The first comes back: the engine stays on the second, and a change written
        # through the first reaches it (the second reads the shared change log).
        first = replicas.start(0)
        version = put(first, "/limits/b", {"output_tokens_per_second": 5})
        engine.converge((version, 50, {"a": 33, "b": 5, "c": 11}))
        assert engine.client.endpoint_index == 1
        # Both replicas list it connected (the first's startup marked every engine
        # disconnected; the second restates its engines within a heartbeat).
        wait_listed(first, version)
        wait_listed(second, version)

        # The second dies: round robin, back to the first.
        held = engine.state()
        replicas.kill(1)
        version = put(first, "/limits/a", {"output_tokens_per_second": 3})
        engine.hold_until_on(0, held=held)
        engine.converge((version, 50, {"a": 3, "b": 5, "c": 11}))
        wait_listed(first, version)
        assert engine.client.num_reconnects == 2
    finally:
        engine.client.close()
