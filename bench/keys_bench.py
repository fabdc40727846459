"""API key push latency: REST call -> the delta at an engine's API server.

Starts `output-rate serve` (SQLite, CURVE with an engine-key allow-list, the key bounds
raised so that the run is not refused) as a subprocess and connects a raw DEALER as
engine `bench-1`'s API server (Hello role "api"). A thread reads its socket, ACKs each
delta, heartbeats every second and records when each key's op arrived. Then, one at a
time: POST /users/{user}/keys (N creations), then DELETE /keys/{id} (the same N keys);
for each, the time from the HTTP response (and from the request) to the delta naming
that key arriving at the peer.

    .venv/bin/python -m bench.keys_bench                  # writes bench/results/keys.md
    .venv/bin/python -m bench.keys_bench --keys 50 --out -
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import zmq

from bench.report import pct, write_report
from control_plane.cli import upgrade
from harness.servers import free_port
from output_rate_core import protocol as p

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "keys-bench-token"
ENGINE_ID = "bench-1"


class ApiPeer:
    """A raw API-server connection; `arrived[(op, key id)]` is when its delta came."""

    def __init__(self, endpoint: str, server_public: str, secret: str) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.curve_secretkey = secret.encode()
        self.sock.curve_publickey = zmq.curve_public(secret.encode())
        self.sock.curve_serverkey = server_public.encode()
        self.sock.connect(endpoint)
        self.arrived: dict[tuple[str, str], float] = {}
        self.snapshot = threading.Event()
        self.version = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.sock.send(p.encode(p.Hello(ENGINE_ID, "", 0, role=p.API_ROLE)))
        self._thread.start()
        if not self.snapshot.wait(30):
            raise RuntimeError("no key snapshot")

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            if self.sock.poll(20):
                frame = self.sock.recv()
                at = time.perf_counter()
                message = p.decode(frame)
                if isinstance(message, p.Snapshot):
                    self.version = message.version
                    self.snapshot.set()
                elif isinstance(message, p.Delta):
                    for op in message.ops:
                        kind = "set" if isinstance(op, p.SetKey) else "delete"
                        self.arrived[kind, getattr(op, "id", "")] = at
                    self.version = message.version
                    self.sock.send(p.encode(p.Ack(ENGINE_ID, message.version)))
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + p.HEARTBEAT_INTERVAL_S
                self.sock.send(p.encode(p.Heartbeat(self.version, ENGINE_ID, "", role=p.API_ROLE)))

    def wait(self, kind: str, key_id: str, timeout_s: float = 30.0) -> float:
        deadline = time.monotonic() + timeout_s
        while (kind, key_id) not in self.arrived:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {kind} delta for {key_id}")
            time.sleep(0.0005)
        return self.arrived[kind, key_id]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        self.context.term()


def run(num_keys: int) -> dict[str, tuple[list[float], list[float]]]:
    """phase -> (response -> arrived ms, request -> arrived ms)."""
    workdir = Path(tempfile.mkdtemp(prefix="keys-bench-"))
    db_url = f"sqlite:///{workdir / 'cp.db'}"
    upgrade(db_url)
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server_public, server_secret = (k.decode() for k in zmq.curve_keypair())
    engine_public, engine_secret = (k.decode() for k in zmq.curve_keypair())
    env = {
        **os.environ,
        "OUTPUT_RATE_DATABASE_URL": db_url,
        "OUTPUT_RATE_ADMIN_TOKEN": TOKEN,
        "OUTPUT_RATE_ZMQ_ENDPOINT": endpoint,
        "OUTPUT_RATE_ZMQ_SECRET_KEY": server_secret,
        "OUTPUT_RATE_ZMQ_CLIENT_KEYS": f"{engine_public}={ENGINE_ID}",
        "OUTPUT_RATE_MAX_KEYS_PER_USER": str(num_keys),
        "OUTPUT_RATE_KEY_CREATIONS_PER_MINUTE": str(100 * num_keys),
        "OUTPUT_RATE_KEY_CREATION_BURST": str(num_keys),
    }
    log = (workdir / "serve.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "control_plane.cli", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    peer: ApiPeer | None = None
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if http.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"serve did not start; see {workdir / 'serve.log'}")
            time.sleep(0.1)
        peer = ApiPeer(endpoint, server_public, engine_secret)
        peer.start()
        results: dict[str, tuple[list[float], list[float]]] = {}
        ids: list[str] = []
        after_response, after_request = [], []
        for i in range(num_keys):
            sent = time.perf_counter()
            response = http.post(f"/users/user-{i % 10}/keys")
            answered = time.perf_counter()
            response.raise_for_status()
            key_id = response.json()["id"]
            ids.append(key_id)
            arrived = peer.wait("set", key_id)
            after_response.append(max(0.0, arrived - answered) * 1000)
            after_request.append((arrived - sent) * 1000)
        results["create"] = (after_response, after_request)
        after_response, after_request = [], []
        for key_id in ids:
            sent = time.perf_counter()
            response = http.delete(f"/keys/{key_id}")
            answered = time.perf_counter()
            response.raise_for_status()
            arrived = peer.wait("delete", key_id)
            after_response.append(max(0.0, arrived - answered) * 1000)
            after_request.append((arrived - sent) * 1000)
        results["revoke"] = (after_response, after_request)
        return results
    finally:
        if peer is not None:
            peer.close()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        http.close()
        log.close()


def report(num_keys: int, results: dict[str, tuple[list[float], list[float]]]) -> str:
    rows = []
    for phase, label in (("create", "POST /users/{user}/keys"), ("revoke", "DELETE /keys/{id}")):
        after_response, after_request = results[phase]
        for what, values in (("response", after_response), ("request sent", after_request)):
            rows.append(
                f"| {label}: {what} -> delta at the API server ({num_keys}) "
                f"| {pct(values, 50):.2f} ms | {pct(values, 99):.2f} ms | {max(values):.2f} ms "
                f"| {'p99 <= 50 ms' if what == 'response' else ''} |"
            )
    return "\n".join(
        [
            "# API key push latency",
            "",
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
            f"{platform.python_version()}; control plane = `output-rate serve` subprocess "
            "(SQLite, CURVE + engine-key allow-list); the API server = a raw DEALER with "
            "role `api` in the bench process (a thread reads, ACKs and heartbeats).",
            "",
            "Reproduce: `.venv/bin/python -m bench.keys_bench` (default `--keys 200`)",
            "",
            "| measurement | p50 | p99 | max | goal |",
            "|---|---|---|---|---|",
            *rows,
            "",
            "Notes: the calls are sequential; each waits for its delta before the next. A "
            "write's on-commit hook wakes the push server before the HTTP response is sent, "
            "so 'response -> delta' is often 0 (clipped). Both processes share this "
            "machine's CPUs with whatever else runs on it.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "keys.md"))
    args = parser.parse_args()
    text = report(args.keys, run(args.keys))
    write_report(text, args.out)


if __name__ == "__main__":
    main()
