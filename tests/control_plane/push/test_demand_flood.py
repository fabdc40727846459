"""A Demand flood from one connection (issue 34): a real `output-rate serve` (SQLite, plain
TCP) and a raw socket bound to its own engine id that sends Demand frames as fast as the
server takes them for FLOOD_S, each naming MAX_DEMAND_USERS users.
Before: 8 s took the control plane from 97 MB to 3.2 GB and REST p50 from 1 ms to
33-220 ms. Now frames beyond the rate are refused and counted, a connection's users are
bounded, and ZMQ queues at most PEER_RECV_HWM frames of it: the server's memory and its
REST latency stay within ratios of their own baseline measured first in the same test."""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import httpx
import zmq

from harness.control_plane import fresh_database, serve
from output_rate_core import protocol as p

FLOOD_S = 6.0
# Distinct frames sent in turn, each naming this many users never named before (a frame
# of ~0.3 MB); beyond the bound of users per connection, every later one is new to it too.
NUM_FRAMES = 24

# Peak memory over the baseline (a process that starts around 100 MB; before: 30x).
MAX_MEMORY_RATIO = 2.0
# REST p50 under the flood over the p50 before it (before: 33-220x).
MAX_LATENCY_RATIO = 10.0


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def probe(url: str, headers: dict[str, str], until: float) -> list[float]:
    latencies = []
    with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
        while time.monotonic() < until:
            started = time.perf_counter()
            assert http.get("/default-limit").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.02)
    return latencies


def test_a_demand_flood_leaves_memory_and_rest_latency_near_their_baseline(
    tmp_path: Path,
) -> None:
    with fresh_database("sqlite", tmp_path) as url, serve(url, tmp_path) as cp:
        with cp.client() as http:
            assert http.put("/default-limit", json={"output_tokens_per_second": 10}).is_success
            headers = dict(http.headers)
        pid = cp.process.pid
        context = zmq.Context()
        rogue = context.socket(zmq.DEALER)
        rogue.setsockopt(zmq.SNDHWM, 4)
        try:
            rogue.connect(cp.zmq_endpoint)
            rogue.send(p.encode(p.Hello("flooder", "tiny", 0)))
            assert rogue.poll(30_000), "no snapshot"
            # Encoded before anything is measured: this process's own work (and its GIL)
            # must not slow the probes down.
            frames = [
                p.encode(
                    p.Demand("flooder", False, {f"f{b}-{i}": 1 for i in range(p.MAX_DEMAND_USERS)})
                )
                for b in range(NUM_FRAMES)
            ]
            baseline_latency = probe(cp.url, headers, time.monotonic() + 3.0)
            baseline_rss = rss_bytes(pid)
            peak_rss = baseline_rss
            flood_latency: list[float] = []
            until = time.monotonic() + FLOOD_S
            prober = threading.Thread(
                target=lambda: flood_latency.extend(probe(cp.url, headers, until))
            )
            prober.start()
            num_sent = 0
            while time.monotonic() < until:
                try:
                    rogue.send(frames[num_sent % len(frames)], zmq.NOBLOCK)
                    num_sent += 1
                except zmq.Again:
                    time.sleep(0.001)
                while rogue.poll(0):
                    rogue.recv()
                peak_rss = max(peak_rss, rss_bytes(pid))
            prober.join()
            time.sleep(1.0)
            peak_rss = max(peak_rss, rss_bytes(pid))
            with cp.client() as http:
                metrics = http.get("/metrics").text
        finally:
            rogue.close(linger=0)
            context.term()
    refused = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("output_rate_push_demand_refused_total ")
    )
    before_p50 = statistics.median(baseline_latency)
    during_p50 = statistics.median(flood_latency)
    print(
        f"\n{num_sent} frames of {p.MAX_DEMAND_USERS} users each in {FLOOD_S:.0f} s, "
        f"{refused:.0f} refused; RSS {baseline_rss / 1e6:.0f} MB -> peak {peak_rss / 1e6:.0f} "
        f"MB; REST p50 {before_p50 * 1000:.1f} ms -> {during_p50 * 1000:.1f} ms"
    )
    assert refused > 0
    assert peak_rss <= MAX_MEMORY_RATIO * baseline_rss
    assert during_p50 <= MAX_LATENCY_RATIO * before_p50
