"""Two real `output-rate serve` replicas on one PostgreSQL database.

Writes alternate between the replicas from many clients; engines (real push clients
feeding real limiters in this process) sit on both. The push threads poll the change log
only every 30 s here, so every version reaching an engine on the other replica within
seconds came through the NOTIFY wake-up.
"""

from __future__ import annotations

import signal
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import PushClient
from harness.applying_engine import ApplyingEngine
from harness.control_plane import Served, fresh_database, serve
from output_rate_core import protocol as p

POLL_INTERVAL_S = "30"
NUM_WRITERS = 8
WRITES_PER_WRITER = 25
# Far below the 30 s poll: only the wake-up can deliver this fast.
MAX_CROSS_REPLICA_S = 5.0


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[Served, Served]]:
    env = {"OUTPUT_RATE_PUSH_POLL_INTERVAL_S": POLL_INTERVAL_S}
    with ExitStack() as stack:
        url = stack.enter_context(fresh_database("postgres", tmp_path))
        a = stack.enter_context(serve(url, tmp_path, env=env))
        b = stack.enter_context(serve(url, tmp_path, env=env))
        yield a, b


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_writes_on_either_replica_reach_engines_on_both(replicas) -> None:
    a, b = replicas
    engines = [
        ApplyingEngine("on-a", [a.zmq_endpoint]),
        ApplyingEngine("on-b-1", [b.zmq_endpoint]),
        ApplyingEngine("on-b-2", [b.zmq_endpoint]),
    ]
    replica_of = {"on-a": a, "on-b-1": b, "on-b-2": b}
    for engine in engines:
        engine.start()
    try:
        wait_for(lambda: all(e.client.has_snapshot for e in engines), 30, "no snapshots")
        start_version = max(e.client.applied_version for e in engines)

        # version -> (replica written on, when the write returned)
        written: dict[int, tuple[Served, float]] = {}
        lock = threading.Lock()

        def writer(index: int) -> None:
            clients = [a.client(), b.client()]
            try:
                for n in range(WRITES_PER_WRITER):
                    target = (index + n) % 2
                    body = {"output_tokens_per_second": 10 + n, "scope": "engine"}
                    response = clients[target].put(f"/limits/w{index}-{n}", json=body)
                    assert response.status_code == 200, response.text
                    with lock:
                        written[response.json()["version"]] = ((a, b)[target], time.monotonic())
            finally:
                for client in clients:
                    client.close()

        with ThreadPoolExecutor(NUM_WRITERS) as pool:
            list(pool.map(writer, range(NUM_WRITERS)))

        num_writes = NUM_WRITERS * WRITES_PER_WRITER
        # Gap-free and totally ordered across both replicas: one version per write.
        assert sorted(written) == list(range(start_version + 1, start_version + num_writes + 1))
        last = max(written)
        wait_for(
            lambda: all(last in e.applied_at for e in engines),
            MAX_CROSS_REPLICA_S,
            "an engine did not apply every version in time",
        )
        # Every version was applied by every engine, as a delta (no resync needed).
        for engine in engines:
            assert set(written) <= set(engine.applied_at), engine.name
            assert engine.client.num_resyncs == 0, engine.name

        # One audit row per write, whichever replica took it.
        with a.client() as http:
            rows = http.get("/audit", params={"limit": 1000}).json()["items"]
        audited = [r["target"] for r in rows if r["target"].startswith("w")]
        assert sorted(audited) == sorted(
            f"w{i}-{n}" for i in range(NUM_WRITERS) for n in range(WRITES_PER_WRITER)
        )

        cross = [
            engine.applied_at[version] - returned_at
            for version, (replica, returned_at) in written.items()
            for engine in engines
            if replica_of[engine.name] is not replica
        ]
        cross.sort()
        p50 = statistics.median(cross)
        p99 = cross[int(0.99 * (len(cross) - 1))]
        print(
            f"\nwrite-to-applied on the other replica: p50 {p50 * 1000:.1f} ms, "
            f"p99 {p99 * 1000:.1f} ms over {len(cross)} deliveries"
        )
        assert cross[-1] < MAX_CROSS_REPLICA_S
    finally:
        for engine in engines:
            engine.close()


def test_readiness_says_whether_the_database_is_reachable(replicas) -> None:
    a, _ = replicas
    ready = httpx.get(f"{a.url}/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready" and ready.json()["database"] == "ok"


def test_a_replica_shutting_down_sends_its_engines_to_another_at_once(replicas) -> None:
    a, b = replicas
    limiter = OutputRateLimiter(None)
    client = PushClient(
        endpoints=[a.zmq_endpoint, b.zmq_endpoint],
        engine_id="drained",
        model="tiny",
        server_public_key=None,
    )
    client.start()
    try:
        wait_for(lambda: client.wait_for_snapshot(0.1), 30, "no snapshot from a")
        client.apply_pending(limiter)
        assert client.endpoint_index == 0
        a.process.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        wait_for(lambda: client.endpoint_index == 1, 10, "never moved to b")
        moved_s = time.monotonic() - stopped_at
        # On b, and in sync with it: a write through b arrives.
        with b.client() as http:
            version = http.put("/limits/after", json={"output_tokens_per_second": 3}).json()[
                "version"
            ]

        def applied() -> bool:
            client.apply_pending(limiter)
            return client.applied_version >= version

        wait_for(applied, 10, "no delta from b")
        print(f"\nmoved to the other replica {moved_s * 1000:.0f} ms after SIGTERM")
        # Without the goodbye it would wait for silence (3.5 s at the least).
        assert moved_s < p.SERVER_SILENCE_S
        assert limiter.rate_of("after") == 3
    finally:
        client.close()
