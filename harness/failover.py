"""Two `output-rate serve` replicas and an engine that fails over between them: the steps
the failover tests (tests/control_plane/replicas/test_failover.py) and the failover
benchmark (bench/fleet_ops_bench.py) both take."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlalchemy import create_engine, text

from harness.applying_engine import ApplyingEngine
from harness.control_plane import PG_URL, Served


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def homed_at(replica: Served, engine_id: str) -> bool:
    """The replica's row of the engine says it is connected there (so the other replica's
    claim has a live home to wait out)."""
    with replica.client() as http:
        rows = http.get("/engines").json()["items"]
    return any(r["engine_id"] == engine_id and r["connected"] for r in rows)


def write_through(replica: Served, user: str, rate: int) -> int:
    """PUT a user's limit through ``replica``; returns the version it made."""
    with replica.client() as http:
        response = http.put(f"/limits/{user}", json={"output_tokens_per_second": rate})
        assert response.status_code == 200, response.text
        version: int = response.json()["version"]
        return version


def start_on_first(name: str, first: Served, second: Served, timeout_s: float) -> ApplyingEngine:
    """An engine listing both replicas, connected to the first and homed there."""
    engine = ApplyingEngine(name, [first.zmq_endpoint, second.zmq_endpoint])
    engine.start()
    assert engine.client.wait_for_snapshot(timeout_s), "no snapshot"
    assert engine.client.endpoint_index == 0
    wait_for(lambda: homed_at(first, name), timeout_s, "the engine's row was never written")
    return engine


@contextmanager
def session_terminator() -> Iterator[Callable[[list[int]], None]]:
    """Ends the PostgreSQL sessions of the given client ports (``TcpProxy.cut``'s
    "terminate"), through an admin connection of its own."""
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")

    def terminate(ports: list[int]) -> None:
        with admin.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE client_port = ANY(:ports)"
                ),
                {"ports": ports},
            )

    try:
        yield terminate
    finally:
        admin.dispose()
