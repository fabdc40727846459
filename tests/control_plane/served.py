"""`output-rate serve` as a real subprocess on free loopback ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx
import zmq

from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import PushClient
from harness.servers import free_port, wait_healthy
from tests.control_plane.factories import ADMIN_TOKEN

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0


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
        gets nothing from this replica, and its refusal is counted exactly once."""
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
            assert sock.poll(500) == 0  # nothing was sent to it
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


class ApplyingEngine:
    """A real push client whose engine side runs on a thread of its own, as in an engine
    core: woken by the client, it applies what arrived and notes when each version was
    applied. A subclass adds the rest of its step in `after_apply`."""

    def __init__(
        self,
        name: str,
        endpoints: list[str],
        *,
        model: str = "tiny",
        server_public_key: str | None = None,
        client_secret_key: str | None = None,
    ) -> None:
        self.name = name
        self.limiter = OutputRateLimiter(None)
        self._woken = threading.Event()
        self.client = PushClient(
            endpoints=endpoints,
            engine_id=name,
            model=model,
            server_public_key=server_public_key,
            client_secret_key=client_secret_key,
            wake=self._woken.set,
        )
        # version -> when it was applied (time.monotonic)
        self.applied_at: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.client.start()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.client.close()

    def __enter__(self) -> Self:
        self.start()
        assert self.client.wait_for_snapshot(60), f"{self.name}: no snapshot"
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def wait_applied(self, version: int, timeout_s: float = 60.0) -> float:
        """When (time.monotonic) `version` was applied, waiting for it at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (at := self.applied_at.get(version)) is None:
            assert time.monotonic() < deadline, (
                f"{self.name} stuck at version {self.client.applied_version}, not {version}"
            )
            time.sleep(0.0005)
        return at

    def after_apply(self, now: float) -> None:
        """The rest of the engine thread's step (`now`: time.monotonic)."""

    def _run(self) -> None:
        while not self._stop.is_set():
            self._woken.wait(0.02)
            self._woken.clear()
            before = self.client.applied_version
            self.client.apply_pending(self.limiter)
            now = time.monotonic()
            for version in range(before + 1, self.client.applied_version + 1):
                self.applied_at.setdefault(version, now)
            self.after_apply(now)
