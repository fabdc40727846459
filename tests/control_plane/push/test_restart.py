"""Live push across a kill -9 of the real `output-rate serve` process, and the
real vLLM scheduler fed by the push client.

The control plane is a subprocess (SQLite file, CURVE with an engine-key
allow-list); the engines are protocol clients feeding real limiters in this
process. While the control plane is dead the engines keep their limits; when
it comes back on the same ports they reconnect, resync and converge to the
database, including changes written while they were cut off.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import zmq

from control_plane.cli import upgrade
from control_plane.config import service as config
from control_plane.db import Database, make_engine
from control_plane.limits import service as limits
from engine_ext import vllm_compat
from engine_ext.limit_table import LimitTable
from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import PushClient
from harness.servers import free_port

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "push-e2e-admin-token"
WAIT_S = 60.0

State = tuple[int, int | None, dict[str, int | None]]


class ControlPlane:
    def __init__(self, tmp_path: Path) -> None:
        self.db_url = f"sqlite:///{tmp_path / 'cp.db'}"
        self.port = free_port()
        self.zmq_endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.server_public, server_secret = (k.decode() for k in zmq.curve_keypair())
        engine_public, self.engine_secret = (k.decode() for k in zmq.curve_keypair())
        self.env = {
            **os.environ,
            "OUTPUT_RATE_DATABASE_URL": self.db_url,
            "OUTPUT_RATE_ADMIN_TOKEN": TOKEN,
            "OUTPUT_RATE_ZMQ_ENDPOINT": self.zmq_endpoint,
            "OUTPUT_RATE_ZMQ_SECRET_KEY": server_secret,
            "OUTPUT_RATE_ZMQ_CLIENT_KEYS": engine_public,
        }
        self.log = tmp_path / "serve.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        )

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "control_plane.cli", "serve", "--port", str(self.port)],
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                if self.http.get("/healthz").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise AssertionError(f"serve not healthy:\n{self.log.read_text()[-3000:]}")

    def kill_hard(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.http.close()

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

    def write_while_down(self) -> None:
        """A change made while the control plane process is gone (e.g. by an operator's
        script on the database): engines must pick it up once it is back."""
        engine = make_engine(self.db_url)
        try:
            offline = Database(engine)
            offline.write_now(limits.put_limit, actor="script", user="offline", rate=11, tier=None)
            offline.write_now(
                limits.put_tier, actor="script", name="free", rate=33, description=None
            )
        finally:
            engine.dispose()


class Engine:
    def __init__(self, cp: ControlPlane, name: str) -> None:
        self.limiter = OutputRateLimiter(1)
        self.client = PushClient(
            endpoints=[cp.zmq_endpoint],
            engine_id=name,
            model="tiny",
            server_public_key=cp.server_public,
            client_secret_key=cp.engine_secret,
        )
        self.client.start()

    def state(self) -> State:
        self.client.apply_pending(self.limiter)
        return self.client.applied_version, self.limiter.default_rate, self.limiter.user_rates()


def converge(engines: list[Engine], cp: ControlPlane) -> State:
    want = cp.expected()
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if all(e.state() == want for e in engines):
            return want
        time.sleep(0.02)
    raise AssertionError(f"not converged to {want}: {[e.state() for e in engines]}")


def listed_vllm_versions(cp: ControlPlane) -> list[str | None]:
    return [e["vllm_version"] for e in cp.http.get("/engines").json()["items"]]


@contextmanager
def running(tmp_path: Path) -> Iterator[ControlPlane]:
    cp = ControlPlane(tmp_path)
    upgrade(cp.db_url)
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


def test_engines_survive_kill_9_and_converge_after_restart(tmp_path: Path) -> None:
    with running(tmp_path) as cp:
        assert cp.http.put("/tiers/free", json={"output_tokens_per_second": 20}).status_code == 200
        # Engine scope: each engine enforces the full rates this test checks (fleet-scoped
        # limits would be split over its three engines, tests/control_plane/fleet cover that).
        default = {"output_tokens_per_second": 50, "scope": "engine"}
        assert cp.http.put("/default-limit", json=default).is_success
        for user, body in {"a": {"tier": "free"}, "b": {"output_tokens_per_second": 7}}.items():
            assert cp.http.put(f"/limits/{user}", json=body).status_code == 200
        engines = [Engine(cp, f"engine-{i}") for i in range(3)]
        try:
            before = converge(engines, cp)
            assert before[1:] == (50, {"a": 20, "b": 7})
            # Their rows name the vLLM each said it runs in its HELLO.
            said = [vllm_compat.installed_vllm_version()] * 3
            deadline = time.monotonic() + WAIT_S
            while listed_vllm_versions(cp) != said:
                assert time.monotonic() < deadline
                time.sleep(0.05)

            cp.kill_hard()
            cp.write_while_down()
            # Past the silence timeout: every engine noticed, and still enforces the last limits.
            deadline = time.monotonic() + WAIT_S
            while not all(e.client.num_silences for e in engines):
                assert time.monotonic() < deadline
                for e in engines:
                    e.state()
                time.sleep(0.05)
            assert all(e.state() == before for e in engines)

            cp.start()
            after = converge(engines, cp)
            assert after[0] > before[0]
            assert after[2] == {"a": 33, "b": 7, "offline": 11}

            # And live changes flow again, through the API.
            assert cp.http.put("/limits/a", json={"output_tokens_per_second": 5}).is_success
            version, _, rates = converge(engines, cp)
            assert rates["a"] == 5
            deadline = time.monotonic() + WAIT_S
            while True:
                listed = cp.http.get("/engines").json()["items"]
                done = len(listed) == 3 and all(
                    e["connected"] and e["applied_version"] == version for e in listed
                )
                if done:
                    break
                assert time.monotonic() < deadline, listed
                for e in engines:
                    e.state()  # the engine thread's part: apply, ack
                time.sleep(0.05)
            # Bound again by its heartbeat or resync (which do not say it), or by a new
            # HELLO: its row still names the vLLM it runs.
            assert said[0] and listed_vllm_versions(cp) == said
        finally:
            for e in engines:
                e.client.close()


def test_the_vllm_scheduler_takes_the_snapshot_at_start_and_deltas_at_each_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real vLLM 0.32 scheduler with the push client, against the real push server."""
    from control_plane.push.server import PushServer
    from engine_ext.config import OutputRateConfig
    from engine_ext.engine_core import connect_control_plane
    from harness.scheduler import make_scheduler

    db_url = f"sqlite:///{tmp_path / 'cp.db'}"
    upgrade(db_url)
    db = make_engine(db_url)
    database = Database(db)
    database.write_now(limits.put_default, actor="t", rate=40)
    database.write_now(limits.put_limit, actor="t", user="a", rate=7, tier=None)
    server = PushServer(endpoint="tcp://127.0.0.1:0", db=database)
    server.start()
    # The seam: the flags' config plus the endpoint, as --control-plane-endpoint gives it.
    from_flags = OutputRateConfig.from_vllm_config.__func__  # type: ignore[attr-defined]

    def with_endpoint(cls: type[OutputRateConfig], vllm_config: object) -> OutputRateConfig:
        flags = from_flags(cls, vllm_config)
        return OutputRateConfig(
            default_rate=flags.default_rate,
            user_rates=flags.user_rates,
            control_plane_endpoints=(server.endpoint,),
            engine_id="sched-1",
        )

    monkeypatch.setattr(OutputRateConfig, "from_vllm_config", classmethod(with_endpoint))
    scheduler = make_scheduler(default_rate=1000, user_rates={"b": 500})
    # What the engine-core side does before its busy loop reads a request.
    client = connect_control_plane(scheduler, wake=lambda: None)
    try:
        limiter = scheduler.output_rate_limiter  # type: ignore[attr-defined]
        # The connection waited for the snapshot: the flags' limits are replaced before any step.
        assert (limiter.default_rate, limiter.user_rates()) == (40, {"a": 7})
        database.write_now(limits.put_limit, actor="t", user="b", rate=3, tier=None)
        version = database.read_now(config.current_version)
        server.notify(version)
        deadline = time.monotonic() + WAIT_S
        while client.applied_version < version:
            assert time.monotonic() < deadline
            scheduler.schedule()
            time.sleep(0.01)
        assert scheduler.output_rate_limiter.user_rates() == {"a": 7, "b": 3}  # type: ignore[attr-defined]
    finally:
        client.close()
        scheduler.shutdown()
        server.close()
        db.dispose()
