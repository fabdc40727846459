"""Isolation benchmark: a victim's TTFT and TPOT alone and beside an aggressor.

Two real vLLM servers on the tiny local model, the same slots on both
(``--max-num-seqs 16``):

- ``plugin``: the output-rate plugin, the aggressor limited to 20 tok/s;
- ``plain``: upstream vLLM 0.32.0, the aggressor unlimited (nothing can limit it).

The victim is vLLM's own load generator (``vllm.benchmarks.serve``, random
dataset, 16-token prompts, 32 output tokens, a steady 2 requests/s). The
aggressor holds 3 x ``--max-num-seqs`` concurrent streams for the whole run
(a finished stream is reopened at once). Each server is measured alone and
beside the aggressor, alternating servers and repeating, so machine noise hits
every configuration alike; the figures are the victim's p50/p99 TTFT and TPOT
and the ratio beside/alone per server.

Run: .venv/bin/python -m bench.isolation_bench [--rounds 2] [--servers plugin plain]
     [--out bench/results/isolation.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from harness.client import stream_completion
from harness.servers import ROOT, TINY_MODEL, VllmServer, vllm_env

NUM_SLOTS = 16
AGGRESSOR_LIMIT = 20
NUM_AGGRESSOR_STREAMS = 3 * NUM_SLOTS
AGGRESSOR_TOKENS = 400
VICTIM_RATE = 2.0
NUM_VICTIM_REQUESTS = 60
SETTLE_S = 1.5  # vLLM's CPU worker spins 1 s after its last step (bench/e2e_bench.py)
FILL_S = 4.0  # the aggressor's streams are resident (plugin: throttled) by then
METRICS = ("ttft", "tpot")
PERCENTILES = ("p50", "p99")

SERVERS = {
    "plugin": (
        "--max-num-seqs",
        str(NUM_SLOTS),
        "--max-num-active-seqs",
        str(NUM_SLOTS // 2),
        "--user-output-tokens-per-second",
        json.dumps({"aggressor": AGGRESSOR_LIMIT}),
    ),
    "plain": ("--max-num-seqs", str(NUM_SLOTS)),
}


class Aggressor:
    """Holds ``NUM_AGGRESSOR_STREAMS`` concurrent streams open until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> Aggressor:
        self._thread.start()
        time.sleep(FILL_S)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=NUM_AGGRESSOR_STREAMS + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:

            async def hold_one() -> None:
                while not self._stop.is_set():
                    await stream_completion(
                        client, self.url, user="aggressor", max_tokens=AGGRESSOR_TOKENS
                    )

            tasks = [asyncio.create_task(hold_one()) for _ in range(NUM_AGGRESSOR_STREAMS)]
            while not self._stop.is_set():
                await asyncio.sleep(0.1)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def run_victim_load(url: str, out_dir: Path, label: str) -> dict[str, float]:
    """vLLM's load generator as the victim; returns its p50/p99 TTFT and TPOT in ms."""
    port = url.rsplit(":", 1)[1]
    args = [
        "--backend",
        "openai",
        "--host",
        "127.0.0.1",
        "--port",
        port,
        "--endpoint",
        "/v1/completions",
        "--model",
        "tiny",
        "--tokenizer",
        str(TINY_MODEL),
        "--dataset-name",
        "random",
        "--random-input-len",
        "16",
        "--random-output-len",
        "32",
        "--num-prompts",
        str(NUM_VICTIM_REQUESTS),
        "--request-rate",
        str(VICTIM_RATE),
        "--ignore-eos",
        "--disable-tqdm",
        "--percentile-metrics",
        ",".join(METRICS),
        "--metric-percentiles",
        "50,99",
        "--extra-body",
        json.dumps({"vllm_xargs": {"output_rate_user": "victim"}}),
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        f"{label}.json",
    ]
    code = (
        "import sys, argparse\n"
        "from vllm.benchmarks.serve import add_cli_args, main\n"
        "parser = argparse.ArgumentParser()\n"
        "add_cli_args(parser)\n"
        "main(parser.parse_args(sys.argv[1:]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=vllm_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    result = json.loads((out_dir / f"{label}.json").read_text())
    figures = {f"{p}_{m}": float(result[f"{p}_{m}_ms"]) for m in METRICS for p in PERCENTILES}
    # The three slowest first tokens, to tell one outlier from a shifted tail.
    figures["max3_ttft"] = sorted(1000 * t for t in result["ttfts"])[-3:]  # type: ignore[assignment]
    figures["failed"] = float(NUM_VICTIM_REQUESTS - result["completed"])
    return figures


def measure(url: str, out_dir: Path, label: str, *, beside: bool) -> dict[str, float]:
    time.sleep(SETTLE_S)
    if not beside:
        return run_victim_load(url, out_dir, label)
    with Aggressor(url):
        return run_victim_load(url, out_dir, label)


def report(runs: dict[tuple[str, str], list[dict[str, float]]], args: argparse.Namespace) -> str:
    names = args.servers

    def med(server: str, case: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[(server, case)])

    lines = [
        "# Isolation: victim latency alone and beside an aggressor",
        "",
        f"Command: `.venv/bin/python -m bench.isolation_bench --rounds {args.rounds} "
        f"--servers {' '.join(names)}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, 2 shared cores).",
        "",
        f"Both servers: tiny model, `--max-num-seqs {NUM_SLOTS}`; plugin also "
        f"`--max-num-active-seqs {NUM_SLOTS // 2}` and the aggressor limited to "
        f"{AGGRESSOR_LIMIT} tok/s (plain vLLM cannot limit it). Victim: "
        f"`vllm.benchmarks.serve`, random 16-token prompts, 32 output tokens, "
        f"{VICTIM_RATE:g} requests/s, {NUM_VICTIM_REQUESTS} requests per run. Aggressor: "
        f"{NUM_AGGRESSOR_STREAMS} concurrent streams of {AGGRESSOR_TOKENS} tokens, reopened as "
        f"they finish. {args.rounds} rounds, servers and cases alternating; medians over rounds.",
        "",
        "| server | case | p50 TTFT ms | p99 TTFT ms | p50 TPOT ms | p99 TPOT ms |",
        "|---|---|---|---|---|---|",
    ]
    for server in names:
        for case in ("alone", "beside"):
            cells = [f"{med(server, case, f'{p}_{m}'):.1f}" for m in METRICS for p in PERCENTILES]
            lines.append(f"| {server} | {case} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Ratio beside / alone (goal for the plugin: p99 TTFT <= 1.5, p99 TPOT <= 1.2):",
        "",
        "| server | p50 TTFT | p99 TTFT | p50 TPOT | p99 TPOT |",
        "|---|---|---|---|---|",
    ]
    for server in names:
        cells = [
            f"{med(server, 'beside', f'{p}_{m}') / med(server, 'alone', f'{p}_{m}'):.2f}"
            for m in METRICS
            for p in PERCENTILES
        ]
        lines.append(f"| {server} | " + " | ".join(cells) + " |")
    lines += ["", "Every run (ms):", ""]
    for (server, case), results in runs.items():
        for i, r in enumerate(results):
            cells = ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {[round(x) for x in v]}"
                for k, v in r.items()
            )
            lines.append(f"- {server} {case} #{i + 1}: {cells}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "isolation.md")
    parser.add_argument(
        "--servers",
        nargs="+",
        choices=list(SERVERS),
        default=list(SERVERS),
        help="which servers to measure (the ratios are per server)",
    )
    args = parser.parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="isolation-bench-"))
    servers = {name: VllmServer(out_dir / f"{name}.log", *SERVERS[name]) for name in args.servers}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    try:
        for server in servers.values():
            server.wait_ready()
        for round_no in range(args.rounds):
            order = list(servers) if round_no % 2 == 0 else list(reversed(servers))
            for name in order:
                for case in ("alone", "beside") if round_no % 2 == 0 else ("beside", "alone"):
                    label = f"{name}-{case}-{round_no}"
                    figures = measure(servers[name].url, out_dir, label, beside=case == "beside")
                    runs.setdefault((name, case), []).append(figures)
                    print(label, json.dumps(figures), flush=True)
    finally:
        for server in servers.values():
            server.kill()
    text = report(runs, args)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
