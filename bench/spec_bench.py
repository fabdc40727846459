"""Speculative decoding with per-user limits: real vLLM servers on the tiny model, as clients.

Four servers run side by side in one run, started together, all with greedy
requests on a repetitive prompt (so the n-gram drafter's proposals are accepted):

- ``plain-spec``: upstream vLLM with n-gram speculative decoding (4 drafts), no plugin.
- ``plugin-spec``: the same with the plugin on: user ``limited`` at ``--limit`` tok/s,
  everyone else unlimited.
- ``plain`` and ``plugin``: the same two without speculative decoding (reference).

Measured:

1. An unlimited user's tokens/s (one stream, wall time from request to last byte),
   plugin vs plain, with and without speculative decoding: rounds with the two
   servers of a pair back to back, order flipped every round; and the acceptance
   rate over those rounds (vLLM's own counters: accepted / draft tokens).
2. The limited user (``--streams`` streams) on each plugin server: measured
   tokens/s against the limit (first to last token, the first token left out) and
   the worst 1 s window of client arrival times against the bound 1.1 x N + 1.

Run: .venv/bin/python -m bench.spec_bench [--rounds 5] [--limit 100] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.report import write_report
from harness.client import StreamResult, stream_completion, wall_rate
from harness.servers import VllmServer

SPEC_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
PROMPT = "one two three four five one two three four five one two three four five"
UNLIMITED_TOKENS = 400
SETTLE_S = 1.5  # plain vLLM's worker busy-polls 1 s after its last step
COMMON_FLAGS = ("--max-num-seqs", "16")
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTS = "vllm:spec_decode_num_draft_tokens_total"


async def _streams(url: str, user: str, num: int, max_tokens: int) -> list[StreamResult]:
    async with httpx.AsyncClient(timeout=300) as client:
        return list(
            await asyncio.gather(
                *(
                    stream_completion(
                        client,
                        url,
                        user=user,
                        max_tokens=max_tokens,
                        prompt=PROMPT,
                        temperature=0.0,
                    )
                    for _ in range(num)
                )
            )
        )


def unlimited_rate(url: str) -> float:
    time.sleep(SETTLE_S)
    (result,) = asyncio.run(_streams(url, "fast", 1, UNLIMITED_TOKENS))
    assert result.completion_tokens == UNLIMITED_TOKENS
    return wall_rate(result)


def limited_run(url: str, limit: int, num_streams: int, seconds: float) -> dict[str, float]:
    time.sleep(SETTLE_S)
    max_tokens = min(480, int(limit * seconds / num_streams))
    results = asyncio.run(_streams(url, "limited", num_streams, max_tokens))
    times = sorted(t for r in results for t in r.token_times)[1:]
    rate = (len(times) - 1) / (times[-1] - times[0])
    worst = 0
    j = 0
    for i, start in enumerate(times):  # tokens in [start, start + 1 s)
        while j < len(times) and times[j] < start + 1.0:
            j += 1
        worst = max(worst, j - i)
    return {"rate": rate, "worst_1s": worst, "bound_1s": 1.1 * limit + 1}


def acceptance(server: VllmServer, before: tuple[float, float]) -> float:
    accepted, drafts = server.metric(ACCEPTED) - before[0], server.metric(DRAFTS) - before[1]
    return accepted / drafts if drafts else float("nan")


def report(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "# Speculative decoding with per-user limits (real vLLM 0.32.0 servers, tiny model, CPU)",
        "",
        f"Reproduce: `.venv/bin/python -m bench.spec_bench --rounds {args.rounds} "
        f"--limit {args.limit} --streams {args.streams}`",
        "",
        "Machine: 2 CPU cores, shared; four servers started together "
        f"(`--max-model-len 512 --enforce-eager {' '.join(COMMON_FLAGS)}`), n-gram speculative "
        f"decoding `{json.dumps(SPEC_CONFIG)}` on the two `-spec` servers; greedy requests on "
        "a repetitive prompt. Client-side measurement (usage block per chunk, so a chunk's "
        "several tokens are counted one by one).",
        "",
        f"## An unlimited user, plugin vs plain ({UNLIMITED_TOKENS} tokens, one stream)",
        "",
        "Tokens per wall second, request to last byte; the two servers of a pair back to "
        f"back, order flipped each round, {SETTLE_S} s apart. Acceptance: vLLM's accepted / "
        "draft token counters over all rounds.",
        "",
        "| pair | round | plain tok/s | plugin tok/s | plugin / plain |",
        "|---|---|---|---|---|",
    ]
    for pair in ("spec", "no spec"):
        plain, plugin = results[pair]["plain"], results[pair]["plugin"]
        for i, (a, b) in enumerate(zip(plain, plugin, strict=True), 1):
            lines.append(f"| {pair} | {i} | {a:.0f} | {b:.0f} | {b / a:.3f} |")
        ratios = [b / a for a, b in zip(plain, plugin, strict=True)]
        lines.append(
            f"| {pair} | **median** | **{statistics.median(plain):.0f}** | "
            f"**{statistics.median(plugin):.0f}** | **{statistics.median(ratios):.3f}** |"
        )
    spec = results["spec"]
    spec_ratio = statistics.median(
        b / a for a, b in zip(spec["plain"], spec["plugin"], strict=True)
    )
    lines += [
        "",
        f"Acceptance rate: plain **{spec['acceptance_plain']:.3f}**, plugin "
        f"**{spec['acceptance_plugin']:.3f}** (goal: equal). Median per-round ratio plugin / "
        "plain with speculative decoding (goal >= 0.97): "
        f"**{spec_ratio:.3f}**.",
        "",
        f"## The limited user: {args.limit} tok/s, {args.streams} streams",
        "",
        "| server | measured tok/s | / limit | worst 1 s window (tokens) | bound 1.1 N + 1 |",
        "|---|---|---|---|---|",
    ]
    for name, runs in results["limited"].items():
        for run in runs:
            lines.append(
                f"| {name} | {run['rate']:.1f} | {run['rate'] / args.limit:.3f} | "
                f"{run['worst_1s']} | {run['bound_1s']:.0f} |"
            )
    lines += [
        "",
        "The worst window is taken on client arrival times, which add delivery jitter to "
        "the engine's; tests/e2e/test_spec_decode.py checks the bound exactly on the "
        "engine's dispatch times.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--out", default="bench/results/spec_decode.md")
    args = parser.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    spec = ("--speculative-config", json.dumps(SPEC_CONFIG))
    limits = ("--user-output-tokens-per-second", json.dumps({"limited": args.limit}))
    servers = {
        "plain-spec": VllmServer(log_dir / "plain-spec.log", *COMMON_FLAGS, *spec),
        "plugin-spec": VllmServer(log_dir / "plugin-spec.log", *COMMON_FLAGS, *spec, *limits),
        "plain": VllmServer(log_dir / "plain.log", *COMMON_FLAGS),
        "plugin": VllmServer(log_dir / "plugin.log", *COMMON_FLAGS, *limits),
    }
    results: dict[str, Any] = {}
    try:
        for server in servers.values():
            server.wait_ready()
        for server in servers.values():  # warm-up
            unlimited_rate(server.url)
        for pair, (plain, plugin) in {
            "spec": ("plain-spec", "plugin-spec"),
            "no spec": ("plain", "plugin"),
        }.items():
            counters = {
                name: (servers[name].metric(ACCEPTED), servers[name].metric(DRAFTS))
                for name in (plain, plugin)
            }
            rates: dict[str, list[float]] = {"plain": [], "plugin": []}
            for i in range(args.rounds):
                order = (("plain", plain), ("plugin", plugin))
                for role, name in order if i % 2 == 0 else order[::-1]:
                    rates[role].append(unlimited_rate(servers[name].url))
                print(pair, rates["plain"][-1], rates["plugin"][-1], flush=True)
            results[pair] = rates
            if pair == "spec":
                rates_any: dict[str, Any] = results[pair]
                rates_any["acceptance_plain"] = acceptance(servers[plain], counters[plain])
                rates_any["acceptance_plugin"] = acceptance(servers[plugin], counters[plugin])
        results["limited"] = {"plugin-spec": [], "plugin": []}
        for _ in range(2):  # the two servers take turns
            for name, runs in results["limited"].items():
                runs.append(limited_run(servers[name].url, args.limit, args.streams, args.seconds))
        print(results["limited"], flush=True)
    finally:
        for server in servers.values():
            server.kill()
    write_report(report(results, args), args.out)


if __name__ == "__main__":
    main()
