"""The control plane as tests and benchmarks drive it: empty or migrated databases
(a SQLite file, or a PostgreSQL schema of their own) and `output-rate serve` as a real
subprocess on free loopback ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import zmq
from sqlalchemy import create_engine, text

from control_plane.cli import upgrade
from harness.servers import free_port, wait_healthy
from output_rate_core import protocol as p

# The PostgreSQL server of the tests and benchmarks (trust auth, database `test`).
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
ADMIN_TOKEN = "admin-secret-token"
START_TIMEOUT_S = 90.0


@contextmanager
def empty_database(kind: str, folder: Path) -> Iterator[str]:
    """The URL of an empty database: a new SQLite file in `folder`, or a PostgreSQL schema
    of its own, dropped afterwards."""
    if kind == "sqlite":
        yield f"sqlite:///{folder / f'cp-{uuid.uuid4().hex[:8]}.db'}"
        return
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@contextmanager
def fresh_database(kind: str, folder: Path) -> Iterator[str]:
    """A migrated, empty database URL (as `empty_database`)."""
    with empty_database(kind, folder) as url:
        upgrade(url)
        yield url


@dataclass
class Served:
    url: str
    process: subprocess.Popen[bytes]
    log: Path
    zmq_endpoint: str = ""

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=60,
            **kwargs,  # type: ignore[arg-type]
        )

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of its /metrics: ``name`` (``_total`` optional) with exactly
        ``labels`` as shown there (e.g. '{kind="up"}'), or none."""
        with self.client() as http:
            text = http.get("/metrics").text
        found = re.search(rf"^{name}(?:_total)?{re.escape(labels)} (\S+)$", text, re.MULTILINE)
        assert found is not None, name
        return float(found.group(1))

    def assert_bind_refused_elsewhere(self, hello: bytes) -> None:
        """A peer sending `hello` (an encoded Hello of an id live on another replica)
        gets nothing from this replica but the refusal (engine_id_in_use), which is
        counted exactly once."""
        counter = "output_rate_push_binds_refused_elsewhere"
        before = self.metric(counter)
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.zmq_endpoint)
        try:
            sock.send(hello)
            deadline = time.monotonic() + 10
            while self.metric(counter) < before + 1:
                assert time.monotonic() < deadline, "the bind was not refused"
                time.sleep(0.1)
            assert sock.poll(5000) != 0
            refused = p.decode(sock.recv())
            assert isinstance(refused, p.Refused) and refused.reason == "engine_id_in_use"
            assert sock.poll(500) == 0  # nothing else was sent to it
        finally:
            sock.close()
            context.term()
        assert self.metric(counter) == before + 1


@contextmanager
def serve(
    db_url: str,
    workdir: Path,
    *,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    python_args: Sequence[str] = ("-m", "control_plane.cli"),
    preexec_fn: Callable[[], None] | None = None,
) -> Iterator[Served]:
    port = free_port()
    zmq_endpoint = f"tcp://127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        "OUTPUT_RATE_DATABASE_URL": db_url,
        "OUTPUT_RATE_ADMIN_TOKEN": ADMIN_TOKEN,
        "OUTPUT_RATE_ZMQ_ENDPOINT": zmq_endpoint,
        **(env or {}),
    }
    log = workdir / f"serve-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, *python_args, "serve", "--port", str(port), *extra_args],
            cwd=workdir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
        )
    served = Served(
        url=f"http://127.0.0.1:{port}", process=process, log=log, zmq_endpoint=zmq_endpoint
    )
    try:
        wait_healthy(f"{served.url}/healthz", process, log, timeout_s=START_TIMEOUT_S)
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def kill_hard(served: Served) -> None:
    served.process.kill()  # SIGKILL: no shutdown hooks, no final flush
    served.process.wait()
