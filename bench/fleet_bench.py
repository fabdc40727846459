"""Fleet accuracy on two real engines: one user's traffic shifts between them.

A control plane (SQLite) and two tiny-model vLLM engines; one user with a fleet limit.
Every ``--shift-s`` seconds the user's streams move: all on engine A, split, all on B,
... for ``--duration-s``. Reported (bench/results/fleet.md):

- accuracy: tokens received summed over both engines / (limit x seconds);
- the worst window: most tokens in any 1 s window over the limit (the bound allows
  1.1 x limit + 2 + the propagation term);
- convergence after each shift: seconds from the shift until the engine that took the
  traffic runs at >= 95 % of the limit (over a sliding 0.5 s window);
- first-token delay on an engine that held no share of the user, against the same
  request to an engine with no limit at all (side by side, alternating).

    python -m bench.fleet_bench --duration-s 60 --shift-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from harness.client import StreamResult, run, stream_completion
from harness.servers import ControlPlane, VllmServer, fleet_engine, free_port

USER = "bench-fleet-user"


def start_stack(tmp: Path, limit: int) -> tuple[ControlPlane, list[VllmServer]]:
    port, zmq_port = free_port(), free_port()
    cp = ControlPlane(tmp / "cp.log", f"sqlite:///{tmp / 'cp.db'}", port, zmq_port)
    cp.wait_ready()
    engines = [fleet_engine(tmp, cp, name) for name in ("bench-a", "bench-b")]
    for engine in engines:
        engine.wait_ready()
    cp.wait_applied(cp.put(USER, limit))
    return cp, engines


# Phases: streams on (A, B).
PHASES = [(4, 0), (2, 2), (0, 4), (2, 2)]


async def shifting_load(
    urls: list[str], duration_s: float, shift_s: float
) -> tuple[list[tuple[float, int]], list[tuple[float, str]]]:
    """Keep the phase's streams open (each re-opened when it ends); returns (token time,
    engine index) samples and (shift time, engine that takes the traffic)."""
    samples: list[tuple[float, int]] = []
    shifts: list[tuple[float, str]] = []
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as client:

        async def stream(index: int, until: float) -> None:
            while time.monotonic() < until:
                result = await stream_completion(client, urls[index], user=USER, max_tokens=40)
                samples.extend((t, index) for t in result.token_times)

        phase = 0
        while time.monotonic() - start < duration_s:
            on_a, on_b = PHASES[phase % len(PHASES)]
            until = min(start + duration_s, time.monotonic() + shift_s)
            shifts.append((time.monotonic(), "A" if on_a >= on_b else "B"))
            await asyncio.gather(
                *(stream(0, until) for _ in range(on_a)), *(stream(1, until) for _ in range(on_b))
            )
            phase += 1
    return samples, shifts


def worst_window(times: list[float], window_s: float = 1.0) -> int:
    times = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] < t - window_s:
            j += 1
        best = max(best, i - j + 1)
    return best


def convergence_s(samples: list[tuple[float, int]], shifts: list[tuple[float, str]], limit: int):
    """Per shift to a single engine: seconds until that engine runs at >= 95 % of the limit."""
    results = []
    for k, (at, target) in enumerate(shifts):
        phase = PHASES[k % len(PHASES)]
        if 0 not in phase:
            continue
        index = 0 if target == "A" else 1
        end = shifts[k + 1][0] if k + 1 < len(shifts) else at + 10
        times = sorted(t for t, i in samples if i == index and at <= t < end)
        for j, t in enumerate(times):
            window = [u for u in times[j:] if u < t + 0.5]
            if len(window) >= 0.95 * limit * 0.5:
                results.append(t - at)
                break
        else:
            results.append(float("nan"))
    return results


def first_token_delays(
    fleet_url: str, plain_url: str, rounds: int
) -> tuple[list[float], list[float]]:
    """Time to first token of a user new to the engine (no share held) vs a plain user."""

    async def ttft(url: str, user: str | None) -> float:
        async with httpx.AsyncClient(timeout=60) as client:
            result: StreamResult = await stream_completion(client, url, user=user, max_tokens=2)
            return result.token_times[0] - result.started

    fleet, plain = [], []
    for i in range(rounds):
        # A fresh fleet user each round: the engine holds no share for it yet.
        fleet.append(run(ttft(fleet_url, f"{USER}-new-{i}")))
        plain.append(run(ttft(plain_url, None)))
    return fleet, plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--duration-s", type=float, default=60)
    parser.add_argument("--shift-s", type=float, default=10)
    parser.add_argument("--ttft-rounds", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cp, engines = start_stack(Path(tmp), args.limit)
        plain = VllmServer(Path(tmp) / "plain.log")
        plain.wait_ready()
        try:
            # The default limit makes every new user a fleet user.
            httpx.put(
                f"{cp.url}/default-limit",
                json={"output_tokens_per_second": args.limit},
                headers=cp.auth_headers(),
            ).raise_for_status()
            urls = [e.url for e in engines]
            samples, shifts = run(shifting_load(urls, args.duration_s, args.shift_s))
            times = [t for t, _ in samples]
            span = max(times) - shifts[0][0]
            converge = convergence_s(samples, shifts, args.limit)
            fleet_ttft, plain_ttft = first_token_delays(urls[1], plain.url, args.ttft_rounds)
        finally:
            plain.kill()
            for engine in engines:
                engine.kill()
            cp.kill()
    print(f"limit {args.limit} tok/s, {args.duration_s:.0f} s, shift every {args.shift_s:.0f} s")
    print("| figure | value |")
    print("|---|---|")
    print(f"| tokens received / (limit x s) | {len(times) / (args.limit * span):.3f} |")
    print(f"| most tokens in any 1 s window / limit | {worst_window(times) / args.limit:.3f} |")
    print(
        "| convergence after a shift to one engine (s, each) | "
        + ", ".join(f"{c:.2f}" for c in converge)
        + " |"
    )
    p50 = statistics.median
    print(
        f"| first token, user new to the engine (p50 / max ms) | "
        f"{p50(fleet_ttft) * 1000:.1f} / {max(fleet_ttft) * 1000:.1f} |"
    )
    print(
        f"| first token, plain vLLM, no limit (p50 / max ms) | "
        f"{p50(plain_ttft) * 1000:.1f} / {max(plain_ttft) * 1000:.1f} |"
    )


if __name__ == "__main__":
    main()
