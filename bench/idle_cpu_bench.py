"""CPU of an engine whose every request is throttled, and unthrottled throughput.

Five servers of the same plugin run in one run, started together, with a
default limit of 1 tok/s and one unlimited user ``fast``, in three variants
(two servers each for the first two, so a difference between two identical
servers is not read as the patch's effect):

- ``patched``: the plugin as shipped (EngineCore idle wait + the worker's
  short input-reader busy window, engine_ext/worker_spin.py);
- ``engine wait only``: the worker keeps vLLM's 1 s busy-poll after each read
  (bench/spin_server.py with ``BENCH_UPSTREAM=worker``);
- ``upstream``: both idle patches off, i.e. upstream's 1 ms engine loop and
  1 s worker busy-poll (``BENCH_UPSTREAM=engine,worker``).

Measured:

1. Unthrottled throughput of the ``fast`` user, patched vs engine wait only
   (the worker patch is the only difference): rounds of 1 stream and of 16
   concurrent streams; each run on one server is followed at once by the same
   run on the other (order flipped every round), and the ratio is also taken
   per round, so a burst of load from other processes hits both. Each run
   starts 1.5 s after the previous one, when no worker is still busy-polling.
2. All throttled: 8 users stream at once; 3 s later every user has spent its
   burst and every request is throttled; CPU time of the engine-core and the
   worker process (psutil) over the next ``--window`` seconds, one server at
   a time (the first server of each variant) while the others hold no request.

Run: .venv/bin/python -m bench.idle_cpu_bench [--rounds 10] [--window 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench.e2e_bench import throughput
from harness.client import stream_completion
from harness.servers import Process, free_port, vllm_command, vllm_env, wait_until_serving

FLAGS = (
    "--default-user-output-tokens-per-second",
    "1",
    "--user-output-tokens-per-second",
    json.dumps({"fast": None}),
    "--max-num-seqs",
    "16",
)
# Variant -> patches replaced by upstream behaviour (None: the plain server command).
VARIANTS: dict[str, str | None] = {
    "patched": None,
    "engine wait only": "worker",
    "upstream": "engine,worker",
}
WORKER_PATCH_LOG = "output-rate: worker input reader spins"
THROTTLED_USERS = 8
TOKENS = 200
STREAMS = (1, 16)


class Server(Process):
    def __init__(self, upstream: str | None, log: Path) -> None:
        self.upstream = upstream
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = vllm_command(port, *FLAGS)
        env = vllm_env()
        if upstream is not None:
            command[1:3] = ["-m", "bench.spin_server"]
            env["BENCH_UPSTREAM"] = upstream
        super().__init__(command, log, env=env)

    def wait_ready(self) -> None:
        wait_until_serving(self, self.url)
        # The variant is what it claims: the worker patch logs from the worker.
        patched_worker = self.upstream is None or "worker" not in self.upstream
        if (WORKER_PATCH_LOG in self.log()) != patched_worker:
            raise RuntimeError(f"worker patch state is not {patched_worker}: {self.log_path}")

    def running(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))
        )


def cpu_by_role(root_pid: int) -> dict[str, float]:
    totals: dict[str, float] = {}
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            name = child.name()
            times = child.cpu_times()
        except psutil.Error:
            continue
        role = "engine_core" if "EngineCor" in name else ("worker" if "Wor" in name else "other")
        totals[role] = totals.get(role, 0.0) + times.user + times.system
    return totals


def throttled_cpu(server: Server, window_s: float) -> dict[str, float]:
    """CPU share (% of one core) per process while every request is throttled."""

    async def main() -> dict[str, float]:
        async with httpx.AsyncClient(timeout=600) as client:
            tasks = [
                asyncio.create_task(
                    stream_completion(client, server.url, user=f"u{i}", max_tokens=40)
                )
                for i in range(THROTTLED_USERS)
            ]
            await asyncio.sleep(3.0)  # every user spent its burst: all requests throttled
            before = cpu_by_role(server.popen.pid)
            await asyncio.sleep(window_s)
            after = cpu_by_role(server.popen.pid)
            for task in tasks:  # closing the streams aborts the requests
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return {role: (after[role] - before.get(role, 0.0)) / window_s * 100 for role in after}

    shares = asyncio.run(main())
    deadline = time.monotonic() + 60
    while server.running() and time.monotonic() < deadline:
        time.sleep(0.2)
    return shares


def report(
    tput: dict[str, list[dict[int, list[float]]]],
    cpu: dict[str, dict[str, float]],
    args: argparse.Namespace,
) -> str:
    lines = [
        "| process | " + " | ".join(f"{name} (% of a core)" for name in cpu) + " |",
        "|---|" + "---|" * len(cpu),
    ]
    for role in ("engine_core", "worker"):
        lines.append(
            f"| {role} | " + " | ".join(f"{c.get(role, 0.0):.1f}" for c in cpu.values()) + " |"
        )
    lines += [
        "",
        f"Unthrottled `fast` user, {TOKENS} tokens per stream, {args.rounds} rounds per "
        "server pair (tok/s, median over both servers of a variant; per server in brackets):",
        "",
        "| streams | patched | engine wait only | ratio of medians | median of paired ratios |",
        "|---|---|---|---|---|",
    ]
    a, b = tput["patched"], tput["engine wait only"]
    for n in STREAMS:
        ma = statistics.median(x for server in a for x in server[n])
        mb = statistics.median(x for server in b for x in server[n])
        paired = statistics.median(
            x / y for sa, sb in zip(a, b, strict=True) for x, y in zip(sa[n], sb[n], strict=True)
        )
        each_a = " / ".join(f"{statistics.median(server[n]):.0f}" for server in a)
        each_b = " / ".join(f"{statistics.median(server[n]):.0f}" for server in b)
        lines.append(
            f"| {n} | {ma:.0f} ({each_a}) | {mb:.0f} ({each_b}) | {ma / mb:.3f} | {paired:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="idle-cpu-"))
    # Two servers per compared variant, started A B B A: in a check on this
    # machine the first-started of two servers ran ~10 % slower whichever
    # variant it was, which must not be read as the patch's effect.
    order = [("patched", 0), ("engine wait only", 0), ("engine wait only", 1), ("patched", 1)]
    order.append(("upstream", 0))
    servers: dict[str, list[Server]] = {name: [] for name in VARIANTS}
    for name, k in order:
        log = log_dir / f"{name.replace(' ', '-')}-{k}.log"
        servers[name].append(Server(VARIANTS[name], log))
    try:
        for group in servers.values():
            for server in group:
                server.wait_ready()
        pair = ("patched", "engine wait only")
        for name in pair:  # warm-up
            for server in servers[name]:
                throughput(server.url, 4, TOKENS, user="fast")
        tput: dict[str, list[dict[int, list[float]]]] = {
            name: [{n: [] for n in STREAMS} for _ in servers[name]] for name in pair
        }
        for i in range(args.rounds):
            for n in STREAMS:
                for k in range(2):  # each pair back to back, so a burst of load hits both
                    for name in pair if (i + k) % 2 == 0 else pair[::-1]:
                        url = servers[name][k].url
                        tput[name][k][n].append(throughput(url, n, TOKENS, user="fast"))
            print(
                "round",
                i + 1,
                {k: [{n: round(d[n][-1]) for n in d} for d in v] for k, v in tput.items()},
            )
        cpu = {}
        for name, group in servers.items():
            cpu[name] = throttled_cpu(group[0], args.window)
            print(name, {k: round(v, 1) for k, v in cpu[name].items()})
    finally:
        for group in servers.values():
            for server in group:
                server.kill()
    text = report(tput, cpu, args)
    print(text)
    if args.out:
        args.out.write_text(
            f"Run: `.venv/bin/python -m bench.idle_cpu_bench --rounds {args.rounds} "
            f"--window {args.window:g}` on {os.cpu_count()} cores "
            f"at load average {os.getloadavg()[0]:.1f}\n\n{text}\n"
        )


if __name__ == "__main__":
    main()
