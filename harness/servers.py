"""Real processes for end-to-end tests: a vLLM server on the tiny local model."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TINY_MODEL = ROOT / ".cache" / "tiny-llama"
STARTUP_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The plain server command; the async launcher keeps --async-scheduling on
# (vLLM's CPU platform turns it off; see harness/cpu_async_server.py).
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
ASYNC_SERVER_MODULE = "harness.cpu_async_server"


def vllm_command(port: int, *flags: str, async_scheduling: bool = False) -> list[str]:
    return [
        sys.executable,
        "-m",
        ASYNC_SERVER_MODULE if async_scheduling else SERVER_MODULE,
        "--model",
        str(TINY_MODEL),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *(["--async-scheduling"] if async_scheduling else []),
        *flags,
    ]


def vllm_env() -> dict[str, str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # Set in a test process that parsed limit flags; a server decides for itself.
    env.pop("VLLM_OUTPUT_RATE_LIMITING", None)
    env.pop("VLLM_OUTPUT_RATE_IDENTITY", None)
    # The async launcher is imported as harness.cpu_async_server.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def wait_healthy(
    url: str, process: subprocess.Popen[bytes], log_path: Path, *, timeout_s: float
) -> None:
    """Poll ``url`` until it answers 200; fail at once if ``process`` exits."""

    def log_tail() -> str:
        return log_path.read_text(errors="replace")[-3000:]

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited early:\n{log_tail()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(
        f"not healthy in {timeout_s}s:\n{log_path.read_text(errors='replace')[-3000:]}"
    )


class Process:
    """A child process in its own process group, killed with everything it spawned."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.popen = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()
        self._log.close()


class VllmServer(Process):
    def __init__(
        self,
        log_path: Path,
        *flags: str,
        async_scheduling: bool = False,
        extra_env: dict[str, str] | None = None,
        state_dir: Path | None = None,
        port: int | None = None,
    ) -> None:
        """``state_dir``: where its control-plane connections save what they applied
        (default: a folder of its own beside its log, never the shared cache root);
        ``port``: a restart on the port of an earlier server (default: a free one)."""
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.async_scheduling = async_scheduling
        self.state_dir = state_dir or log_path.with_name(f"{log_path.stem}-state")
        command = vllm_command(
            self.port,
            *flags,
            "--output-rate-state-dir",
            str(self.state_dir),
            async_scheduling=async_scheduling,
        )
        # extra_env: e.g. the engine's CURVE secret key, which comes from the environment.
        super().__init__(command, log_path, env={**vllm_env(), **(extra_env or {})})

    def metric(self, name: str) -> float:
        """Sum of a Prometheus metric over its label sets, from /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith((name + "{", name + " "))
        )

    def metric_by_user(self, name: str) -> dict[str, float]:
        """user -> a per-user Prometheus metric of the plugin (summed over its other
        labels), from /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        found: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(name + "{"):
                user = re.search(r'user="([^"]*)"', line)
                assert user is not None, line
                found[user.group(1)] = found.get(user.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
        return found

    def wait_ready(self) -> None:
        wait_until_serving(self, self.url)


def wait_until_serving(server: Process, url: str) -> None:
    """Until the vLLM server at ``url`` lists its models; raises with its log if it exits."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.popen.poll() is not None:
            raise RuntimeError(
                f"vLLM exited with {server.popen.returncode}:\n{server.log()[-4000:]}"
            )
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"vLLM not ready in {STARTUP_TIMEOUT_S}s:\n{server.log()[-4000:]}")


class ControlPlane(Process):
    """`output-rate serve` on the given ports, with an admin token."""

    TOKEN = "e2e-admin-token"

    def __init__(
        self,
        log_path: Path,
        db_url: str,
        port: int,
        zmq_port: int,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.zmq_endpoint = f"tcp://127.0.0.1:{zmq_port}"
        self.db_url = db_url
        env = {
            **os.environ,
            "OUTPUT_RATE_DATABASE_URL": db_url,
            "OUTPUT_RATE_ADMIN_TOKEN": self.TOKEN,
            "OUTPUT_RATE_PORT": str(port),
            "OUTPUT_RATE_ZMQ_ENDPOINT": self.zmq_endpoint,
            **(extra_env or {}),
        }
        super().__init__([sys.executable, "-m", "control_plane.cli", "serve"], log_path, env)

    @classmethod
    def auth_headers(cls) -> dict[str, str]:
        return {"Authorization": f"Bearer {cls.TOKEN}"}

    def wait_ready(self) -> None:
        wait_healthy(f"{self.url}/healthz", self.popen, self.log_path, timeout_s=60)

    def put(self, user: str, rate: int | None) -> int:
        response = httpx.put(
            f"{self.url}/limits/{user}",
            json={"output_tokens_per_second": rate},
            headers=self.auth_headers(),
        )
        response.raise_for_status()
        return int(response.json()["version"])

    def wait_applied(self, version: int, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            engines = httpx.get(f"{self.url}/engines", headers=self.auth_headers()).json()["items"]
            if engines and all(e["applied_version"] >= version and e["connected"] for e in engines):
                return
            time.sleep(0.1)
        raise AssertionError(f"engines did not apply {version}: {engines}")


def fleet_engine(log_dir: Path, cp: ControlPlane, engine_id: str) -> VllmServer:
    """A vLLM engine (16 resident slots) in the fleet of the control plane ``cp``."""
    return VllmServer(
        log_dir / f"engine-{engine_id}.log",
        "--control-plane-endpoint",
        cp.zmq_endpoint,
        "--output-rate-engine-id",
        engine_id,
        "--max-num-seqs",
        "16",
    )
