"""What engine metrics and a scraper cost the engine (a benchmark, not a test).

1. In process (no server): the per-step call (``EngineMetrics.on_step``) with R
   users in a step and T of them watched (throttled), and the once-a-second
   snapshot with K users, in microseconds.
2. One real server (plugin on, a limit configured, so every step runs the
   output-rate path and the metrics): the step time of one unlimited stream,
   taken from vLLM's own inter-token latency histogram (engine-core
   timestamps, so client-side delivery bunching does not count), with no
   scraper and with a scraper polling ``/metrics`` every second, alternating
   runs (order flipped every round) so a load burst from other processes hits
   both. Also the time one scrape takes (API server process).

Run: .venv/bin/python -m bench.metrics_scrape_bench [--rounds 4] [--out FILE]
Start it under ``flock /work/notes/vllm.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from engine_ext.metrics import EngineMetrics, SchedulerFigures, encode_snapshot

ROOT = Path(__file__).resolve().parents[1]
FAST_TOKENS = 480  # + the prompt stays within --max-model-len 512


def step_loop_us(
    users: list[str], num_watched: int, on_step: Callable[[dict[str, int], int], None] | None
) -> float:
    """µs per step of counting grants the way the scheduler does, calling ``on_step``.

    A throttled user gets a token in few steps (its limit is far below the step
    rate): here in 1 step of 10; the others get one every step.
    """
    granted = dict.fromkeys(users, 0)
    n = 20_000
    start = time.perf_counter()
    for i in range(n):
        for user in users[num_watched:] if i % 10 else users:
            granted[user] += 1
        if on_step is not None:
            on_step(granted, num_watched)
    return (time.perf_counter() - start) / n * 1e6


def micro() -> list[str]:
    lines = ["| case | µs per call |", "|---|---|"]
    for num_users, num_watched in ((16, 0), (16, 4), (256, 64), (256, 256)):
        metrics = EngineMetrics(max_users=20)
        users = [f"u{i}" for i in range(num_users)]
        metrics.add_usage(dict.fromkeys(users, 1), dict.fromkeys(users[:num_watched], 1))
        metrics.add_usage({}, dict.fromkeys(users[:num_watched], 1))
        elapsed = step_loop_us(users, num_watched, metrics.on_step)
        # Below the noise of the subtraction it reads as 0.
        per_call = max(0.0, elapsed - step_loop_us(users, num_watched, None))
        lines.append(
            f"| on_step, {num_users} users in the step, {num_watched} of them throttled | "
            f"{per_call:.2f} |"
        )
    for k in (20, 200):
        metrics = EngineMetrics(max_users=k)
        metrics.add_usage({f"u{i}": 5 for i in range(k)}, {f"u{i}": 1 for i in range(k)})
        figures = SchedulerFigures(
            rate_of=lambda user: 20,
            default_rate=None,
            is_unlimited=False,
            num_reclaims=0,
            num_reclaimed_tokens=0,
            config_version=3,
            connected=True,
            tier_of=lambda user: None,
        )
        n = 2_000
        start = time.perf_counter()
        for _ in range(n):
            encode_snapshot(metrics.snapshot(figures))
        per_call = (time.perf_counter() - start) / n * 1e6
        lines.append(f"| snapshot (once a second), K = {k} users | {per_call:.1f} |")
    return lines


class Scraper(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.durations: list[float] = []

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stop.is_set():
                start = time.perf_counter()
                client.get(f"{self.url}/metrics").raise_for_status()
                self.durations.append(time.perf_counter() - start)
                self.stop.wait(1.0)


def itl_totals(url: str) -> tuple[float, float]:
    """(sum, count) of vLLM's inter-token latency histogram: engine-core timestamps."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    totals = {"_sum": 0.0, "_count": 0.0}
    for line in text.splitlines():
        for suffix in totals:
            if line.startswith(f"vllm:inter_token_latency_seconds{suffix}"):
                totals[suffix] += float(line.rsplit(" ", 1)[1])
    return totals["_sum"], totals["_count"]


async def one_run(url: str) -> float:
    """Mean engine-side step time of one unlimited stream (one token per step)."""
    from harness.client import stream_completion

    before = itl_totals(url)
    async with httpx.AsyncClient(timeout=300) as client:
        await stream_completion(client, url, user="fast", max_tokens=FAST_TOKENS)
    after = itl_totals(url)
    return (after[0] - before[0]) / (after[1] - before[1])


def server_runs(rounds: int) -> list[str]:
    from harness.servers import VllmServer

    tmp = Path(tempfile.mkdtemp(prefix="metrics-bench-"))
    server = VllmServer(
        tmp / "engine.log",
        "--user-output-tokens-per-second",
        json.dumps({"slow": 20}),
    )
    try:
        server.wait_ready()
        asyncio.run(one_run(server.url))  # warm-up
        step: dict[str, list[float]] = {"no scraper": [], "scraper at 1 Hz": []}
        scrapes: list[float] = []
        for i in range(rounds):
            order = [False, True] if i % 2 == 0 else [True, False]
            for scraping in order:
                scraper = Scraper(server.url) if scraping else None
                if scraper is not None:
                    scraper.start()
                step_s = asyncio.run(one_run(server.url))
                if scraper is not None:
                    scraper.stop.set()
                    scraper.join()
                    scrapes.extend(scraper.durations)
                step["scraper at 1 Hz" if scraping else "no scraper"].append(step_s)
        size = len(httpx.get(f"{server.url}/metrics").content)
    finally:
        server.kill()
    base = statistics.median(step["no scraper"])
    lines = [
        "| | median step time of the fast stream (ms) | runs (ms) |",
        "|---|---|---|",
    ]
    for name, values in step.items():
        runs = ", ".join(f"{v * 1e3:.2f}" for v in values)
        lines.append(f"| {name} | {statistics.median(values) * 1e3:.2f} | {runs} |")
    ratio = statistics.median(step["scraper at 1 Hz"]) / base
    paired = [a / b for a, b in zip(step["scraper at 1 Hz"], step["no scraper"], strict=True)]
    lines += [
        "",
        f"Ratio of medians (scraper / none): {ratio:.3f}; per-round ratios: "
        + ", ".join(f"{r:.2f}" for r in paired)
        + f" (median {statistics.median(paired):.3f}). One scrape of /metrics ({size} bytes): "
        f"median {statistics.median(scrapes) * 1e3:.1f} ms, max {max(scrapes) * 1e3:.1f} ms "
        f"({len(scrapes)} scrapes).",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "metrics.md")
    args = parser.parse_args()
    lines = [
        "# Engine metrics: cost per step and of a scraper",
        "",
        "`python -m bench.metrics_scrape_bench` (see its docstring).",
        "",
        "## In process",
        "",
        *micro(),
        "",
        f"## Real server ({args.rounds} rounds, alternating)",
        "",
        *server_runs(args.rounds),
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
