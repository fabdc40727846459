"""Peers that never read their socket cost the real `output-rate serve` bounded memory and
do not slow a real engine's deltas (issue 23: 10 such peers used to add 135 MB in 20 s
with a 1 MB snapshot, each asking for a new snapshot every 0.1 s)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import zmq

from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import PushClient
from harness.control_plane import Served, fresh_database, serve
from output_rate_core import protocol as p

NUM_SILENT_PEERS = 10
NUM_USERS = 30_000  # a snapshot of ~1 MB
FLOOD_S = 8.0
# 10 peers x one unread ~1 MB snapshot each, plus socket buffers and the allocator's slack.
MAX_GROWTH_MB = 60


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def seed(served: Served) -> None:
    with served.client() as http:
        for start in range(0, NUM_USERS, 10_000):
            items = [
                {"user": f"user-{n:06d}", "output_tokens_per_second": 10 + n % 90}
                for n in range(start, start + 10_000)
            ]
            response = http.post("/limits:bulk", json={"items": items})
            assert response.status_code == 200, response.text


def silent_peer(context: zmq.Context, endpoint: str, name: str) -> zmq.Socket:
    """A peer that says HELLO and asks for snapshots, and never reads: its receive queue
    and kernel buffer are tiny, so what the server sends it piles up on the server."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    sock.send(p.encode(p.Hello(name, "tiny", 0)))
    return sock


class Engine:
    """A real push client; ``put_and_wait`` times a write to its applying the version."""

    def __init__(self, served: Served) -> None:
        self.served = served
        self.limiter = OutputRateLimiter(None)
        self.woken = threading.Event()
        self.client = PushClient(
            endpoints=[served.zmq_endpoint],
            engine_id="real",
            model="tiny",
            server_public_key=None,
            wake=self.woken.set,
        )

    def put_and_wait(self, http, user: str) -> float:
        response = http.put(f"/limits/{user}", json={"output_tokens_per_second": 5})
        version = response.json()["version"]
        sent = time.monotonic()
        while self.client.applied_version < version:
            assert time.monotonic() - sent < 30, "the real engine's delta never came"
            self.woken.wait(0.01)
            self.woken.clear()
            self.client.apply_pending(self.limiter)
        return time.monotonic() - sent


def test_non_reading_peers_cost_bounded_memory_and_delay_no_delta(tmp_path: Path) -> None:
    with fresh_database("sqlite", tmp_path) as url, serve(url, tmp_path) as served:
        seed(served)
        engine = Engine(served)
        engine.client.start()
        context = zmq.Context()
        peers: list[zmq.Socket] = []
        try:
            assert engine.client.wait_for_snapshot(30)
            engine.client.apply_pending(engine.limiter)
            with served.client() as http:
                baseline = sorted(engine.put_and_wait(http, f"base-{n}") for n in range(20))
            rss_before = rss_mb(served.process.pid)
            sent_before = served.metric("output_rate_push_snapshots_sent_total")
            resyncs_before = engine.client.num_resyncs
            peers = [
                silent_peer(context, served.zmq_endpoint, f"silent-{i}")
                for i in range(NUM_SILENT_PEERS)
            ]
            flood = []
            deadline = time.monotonic() + FLOOD_S
            with served.client() as http:
                while time.monotonic() < deadline:
                    for i, sock in enumerate(peers):
                        sock.send(p.encode(p.Resync(f"silent-{i}", 0)), zmq.NOBLOCK)
                    flood.append(engine.put_and_wait(http, f"probe-{len(flood)}"))
                    time.sleep(0.1)
            growth = rss_mb(served.process.pid) - rss_before
            snapshots = served.metric("output_rate_push_snapshots_sent_total") - sent_before
            flood.sort()
            print(
                f"\n{NUM_SILENT_PEERS} silent peers asking every ~0.1 s for {FLOOD_S:.0f} s: "
                f"{snapshots:.0f} snapshots sent, server RSS {growth:+.0f} MB; real engine "
                f"delta p50 {flood[len(flood) // 2] * 1000:.1f} ms (alone "
                f"{baseline[len(baseline) // 2] * 1000:.1f} ms)"
            )
            # One snapshot each (the HELLO's), never read, so never another.
            assert snapshots == NUM_SILENT_PEERS
            assert growth < MAX_GROWTH_MB
            # The real engine's deltas are not held up by them (median against its own
            # median alone, measured here; slack for the 2 shared cores).
            assert flood[len(flood) // 2] < 5 * baseline[len(baseline) // 2] + 0.05
            assert engine.client.num_resyncs == resyncs_before
        finally:
            for sock in peers:
                sock.close(linger=0)
            context.term()
            engine.client.close()
