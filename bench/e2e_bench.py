"""End-to-end benchmark: real vLLM servers on the tiny local model, measured as clients.

Three servers run side by side in one run, started together:

- ``plain``: upstream vLLM, no output-rate flag.
- ``plugin``: the plugin on, sync scheduling, every user far below its limit
  (default 1,000,000 tok/s) except the ``hog`` user (20 tok/s) and the
  accuracy users.
- ``plugin-async``: the same with ``--async-scheduling`` (kept on on CPU by
  harness/cpu_async_server.py).

Measured:

1. Unthrottled throughput, plugin vs plain: rounds of S concurrent streams x T
   tokens, the two servers back to back with the order flipped every round so
   machine noise hits both, each run 1.5 s after the last (below).
2. Isolation: an unlimited user's tokens/s alone vs beside the throttled
   ``hog`` with many streams (plugin), and beside an unthrottled hog (plain,
   for reference); several alone/beside pairs, the two servers taking turns.
3. Accuracy: limit vs measured tokens/s for 20/100/300 tok/s with 1/4/16
   streams, sync and async; the three users of one limit run concurrently.
4. Engine CPU while every request is throttled (EngineCore process CPU time).

Run: .venv/bin/python -m bench.e2e_bench [--rounds 3] [--out bench/results/e2e.md]
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
from typing import Any

import httpx

from harness.client import StreamResult, stream_completion, user_rate, wall_rate
from harness.servers import VllmServer

LIMITS = (20, 100, 300)
STREAMS = (1, 4, 16)
HOG_LIMIT = 20
ACCURACY_SECONDS = 6.0
# --max-model-len 512 minus the prompt: fast single streams get fewer seconds.
MAX_TOKENS_PER_STREAM = 480
COMMON_FLAGS = ("--max-num-seqs", "32", "--max-num-active-seqs", "16")
# vLLM's CPU worker busy-polls for 1 s after its last step (the plugin's worker
# parks after 5 ms), so a run that starts at once after another server's run
# shares the 2 cores with that spinning worker. Every run waits this long first.
SETTLE_S = 1.5


def accuracy_user(limit: int, streams: int) -> str:
    return f"acc-{limit}-{streams}"


def plugin_flags() -> tuple[str, ...]:
    users: dict[str, int | None] = {"hog": HOG_LIMIT, "idle": 1}
    users.update({accuracy_user(lim, n): lim for lim in LIMITS for n in STREAMS})
    return (
        *COMMON_FLAGS,
        "--default-user-output-tokens-per-second",
        "1000000",
        "--user-output-tokens-per-second",
        json.dumps(users),
    )


async def streams(
    url: str, user: str | None, num_streams: int, max_tokens: int
) -> list[StreamResult]:
    async with httpx.AsyncClient(timeout=600) as client:
        return list(
            await asyncio.gather(
                *(
                    stream_completion(client, url, user=user, max_tokens=max_tokens)
                    for _ in range(num_streams)
                )
            )
        )


def throughput(url: str, num_streams: int, max_tokens: int, *, user: str | None = None) -> float:
    """Tokens/s of ``num_streams`` concurrent streams, after waiting ``SETTLE_S``."""
    time.sleep(SETTLE_S)
    start = time.monotonic()
    results = asyncio.run(streams(url, user, num_streams, max_tokens))
    elapsed = time.monotonic() - start
    return sum(r.completion_tokens for r in results) / elapsed


def isolation(url: str, hog_streams: int) -> tuple[float, float]:
    """(user-c tok/s alone, beside a hog with ``hog_streams`` streams)."""

    async def main() -> tuple[float, float]:
        await asyncio.sleep(SETTLE_S)
        async with httpx.AsyncClient(timeout=600) as client:
            alone = await stream_completion(client, url, user="user-c", max_tokens=300)
            hog = [
                asyncio.create_task(stream_completion(client, url, user="hog", max_tokens=400))
                for _ in range(hog_streams)
            ]
            await asyncio.sleep(1.0)
            beside = await stream_completion(client, url, user="user-c", max_tokens=300)
            for task in hog:
                task.cancel()
            await asyncio.gather(*hog, return_exceptions=True)
            return wall_rate(alone), wall_rate(beside)

    return asyncio.run(main())


def accuracy(url: str) -> dict[tuple[int, int], tuple[float, float, int]]:
    """(limit, streams) -> (first-to-last tok/s, tok/s from the first request sent, tokens)."""
    table: dict[tuple[int, int], tuple[float, float, int]] = {}
    for limit in LIMITS:

        async def group(limit: int = limit) -> list[list[StreamResult]]:
            jobs = []
            for n in STREAMS:
                per_stream = min(MAX_TOKENS_PER_STREAM, max(2, round(limit * ACCURACY_SECONDS / n)))
                jobs.append(streams(url, accuracy_user(limit, n), n, per_stream))
            return list(await asyncio.gather(*jobs))

        for n, results in zip(STREAMS, asyncio.run(group()), strict=True):
            num_tokens, span = user_rate(results)
            last = max(r.token_times[-1] for r in results)
            since_send = last - min(r.started for r in results)
            table[(limit, n)] = ((num_tokens - 1) / span, num_tokens / since_send, num_tokens)
    return table


def engine_core_pid(server: VllmServer) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == server.popen.pid and b"EngineCore" in cmdline:
            return int(entry.name)
    return None


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throttled_engine_cpu(server: VllmServer, window_s: float = 3.0) -> float | None:
    """EngineCore CPU share while 16 streams of a 1 tok/s user are all throttled."""
    pid = engine_core_pid(server)
    if pid is None:
        return None

    async def main() -> float:
        async with httpx.AsyncClient(timeout=600) as client:
            tasks = [
                asyncio.create_task(
                    stream_completion(client, server.url, user="idle", max_tokens=50)
                )
                for _ in range(16)
            ]
            await asyncio.sleep(1.5)  # admitted, first tokens out, now all throttled
            before = cpu_seconds(pid)
            await asyncio.sleep(window_s)
            share = (cpu_seconds(pid) - before) / window_s
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return share

    return asyncio.run(main())


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    plain, plugin = results["throughput_plain"], results["throughput_plugin"]
    ratio = statistics.median(plugin) / statistics.median(plain)
    paired = statistics.median(b / a for a, b in zip(plain, plugin, strict=True))
    lines = [
        "# End-to-end benchmark (real vLLM 0.32.0 servers, tiny model, CPU)",
        "",
        "Reproduce: `.venv/bin/python -m bench.e2e_bench "
        f"--rounds {args.rounds} --streams {args.streams} --tokens {args.tokens}`",
        "",
        f"Machine: {os.cpu_count()} CPU cores, shared; servers: "
        f"`--max-model-len 512 --enforce-eager {' '.join(COMMON_FLAGS)}`, "
        "`VLLM_CPU_KVCACHE_SPACE=1`. Client-side measurement (usage block per chunk).",
        "",
        "## Unthrottled throughput, plugin on (limits far above capacity) vs plain vLLM",
        "",
        f"{args.streams} concurrent streams x {args.tokens} tokens, {args.rounds} rounds "
        "back to back, order flipped every round, each run 1.5 s after the previous one.",
        "",
        "| round | plain tok/s | plugin tok/s |",
        "|---|---|---|",
        *(
            f"| {i + 1} | {a:.0f} | {b:.0f} |"
            for i, (a, b) in enumerate(zip(plain, plugin, strict=True))
        ),
        f"| **median** | **{statistics.median(plain):.0f}** | "
        f"**{statistics.median(plugin):.0f}** |",
        "",
        f"Ratio plugin / plain (medians): **{ratio:.3f}**; median of the per-round "
        f"ratios: **{paired:.3f}** (goal >= 0.98).",
        "",
        "## Isolation",
        "",
        "Tokens per wall second (request sent to last byte) of one unlimited stream "
        f"(300 tokens) alone, then beside a second user with {args.hog_streams} streams; "
        f"{args.isolation_pairs} such pairs per server, the servers taking turns. "
        "Medians; the ratio is the median of the per-pair ratios (range in brackets).",
        "",
        "| server | hog | alone tok/s | beside tok/s | ratio |",
        "|---|---|---|---|---|",
    ]
    for name, hog, pairs in results["isolation"]:
        ratios = sorted(beside / alone for alone, beside in pairs)
        lines.append(
            f"| {name} | {hog} | {statistics.median(a for a, _ in pairs):.0f} "
            f"| {statistics.median(b for _, b in pairs):.0f} "
            f"| {statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}) |"
        )
    lines += [
        "",
        "Goal for the plugin row: ratio >= 0.9. The plain row shows what the limit prevents.",
        "",
        "## Accuracy: limit vs measured",
        "",
        f"Each user asks for ~{ACCURACY_SECONDS:.0f} s of tokens at its limit (at most "
        f"{MAX_TOKENS_PER_STREAM} per stream), split over its "
        "streams; the three users of one limit run at the same time. Two client-side "
        "measures: A = (tokens - 1) / first-to-last token span over all of the user's "
        "streams (a late first delivery shortens the span and reads high); B = tokens / "
        "(last token - first request sent) (includes time to first token, reads low). "
        "The 100 ms burst makes short runs read slightly above the limit. A single "
        "stream gets at most one token per engine step, so 300 tok/s on one stream is "
        "above what this CPU's step time allows beside the other users.",
        "",
        "| mode | limit | streams | tokens | A tok/s | A / limit | B tok/s | B / limit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, table in results["accuracy"].items():
        for (limit, n), (rate, from_send, tokens) in table.items():
            lines.append(
                f"| {mode} | {limit} | {n} | {tokens} | {rate:.1f} | {rate / limit:.3f} "
                f"| {from_send:.1f} | {from_send / limit:.3f} |"
            )
    cpu = results["throttled_cpu"]
    lines += [
        "",
        "## Engine CPU while every request is throttled",
        "",
        "16 streams of one user at 1 tok/s, all throttled after their first tokens; "
        "EngineCore process CPU over 3 s: "
        + ", ".join(
            f"{mode}: {share * 100:.1f}%" for mode, share in cpu.items() if share is not None
        )
        + " of one core.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--hog-streams", type=int, default=16)
    parser.add_argument("--isolation-pairs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/e2e.md"))
    args = parser.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="e2e-bench-"))
    servers = {
        "plain": VllmServer(log_dir / "plain.log", *COMMON_FLAGS),
        "plugin": VllmServer(log_dir / "plugin.log", *plugin_flags()),
        "plugin-async": VllmServer(
            log_dir / "plugin-async.log", *plugin_flags(), async_scheduling=True
        ),
    }
    try:
        for server in servers.values():
            server.wait_ready()
        plain, plugin = servers["plain"], servers["plugin"]
        for server in (plain, plugin):  # warm-up
            throughput(server.url, 4, 20)
        results: dict[str, Any] = {"throughput_plain": [], "throughput_plugin": []}
        for i in range(args.rounds):
            order = ("plain", "plugin") if i % 2 == 0 else ("plugin", "plain")
            for name in order:
                results[f"throughput_{name}"].append(
                    throughput(servers[name].url, args.streams, args.tokens)
                )
            print("throughput", results["throughput_plain"][-1], results["throughput_plugin"][-1])
        hogs = {"plugin": f"throttled at {HOG_LIMIT} tok/s", "plain": "unthrottled"}
        pairs: dict[str, list[tuple[float, float]]] = {name: [] for name in hogs}
        for _ in range(args.isolation_pairs):
            for name in hogs:
                pairs[name].append(isolation(servers[name].url, args.hog_streams))
        results["isolation"] = [(name, hog, pairs[name]) for name, hog in hogs.items()]
        print("isolation", results["isolation"])
        results["accuracy"] = {
            "sync": accuracy(plugin.url),
            "async": accuracy(servers["plugin-async"].url),
        }
        print("accuracy", results["accuracy"])
        results["throttled_cpu"] = {
            mode: throttled_engine_cpu(servers[name])
            for mode, name in (("sync", "plugin"), ("async", "plugin-async"))
        }
    finally:
        for server in servers.values():
            server.kill()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(results, args))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
