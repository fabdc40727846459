"""Slot reclaim on the real scheduler: churn, recompute cost and deep-queue step cost.

The real vLLM 0.32.0 scheduler and KV manager with hand-built model outputs
and a fake clock (10 ms per step), as in tests/engine_ext.

1. Churn vs the re-admission cooldown: a hog (20 tok/s) keeps 3 x 8 streams
   on an engine with 8 worker slots; an unlimited user sends a 20-token
   request every 25 or every 10 steps. For each cooldown, with the prefix
   cache off and on: reclaims, tokens the hog had to recompute, and the
   victims' wait from arrival to first scheduling (steps).
2. Step cost with a throttled user's queue 10 vs 2,000 deep (one victim
   arriving now and then), side by side in rounds.

Run: .venv/bin/python -m bench.reclaim_bench [--steps 3000] [--out bench/results/reclaim.md]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from harness.scheduler import FakeClock, make_request, make_scheduler, runner_output

NUM_SLOTS = 8
COOLDOWNS = (0, 8, 32, 128)


def hog_scheduler(clock: FakeClock, cooldown: int | None = None, *, prefix_cache: bool = False):
    sched = make_scheduler(
        user_rates={"hog": 20},
        max_num_seqs=NUM_SLOTS,
        max_num_active_seqs=NUM_SLOTS // 2,
        enable_prefix_caching=prefix_cache,
        clock=clock,
    )
    if cooldown is not None:
        sched.reclaim_cooldown_steps = cooldown
    return sched


def step(sched, clock: FakeClock) -> object:
    out = sched.schedule()
    sched.update_from_output(out, runner_output(sched, out))
    clock.advance_ms(10)
    return out


def churn(cooldown: int, num_steps: int, every: int, prefix_cache: bool) -> dict[str, float]:
    """One run: a victim request every ``every`` steps beside the hog."""
    clock = FakeClock()
    sched = hog_scheduler(clock, cooldown, prefix_cache=prefix_cache)
    hog = [
        make_request(
            "hog", max_tokens=500, prompt_token_ids=[3 + (i * 7 + j) % 200 for j in range(64)]
        )
        for i in range(3 * NUM_SLOTS)
    ]
    for r in hog:
        sched.add_request(r)
    arrived: dict[str, int] = {}
    waits: list[int] = []
    # request id -> tokens scheduled for it (prefill, recompute and decode).
    num_scheduled: dict[str, int] = {}
    for i in range(num_steps):
        if i % every == 0 and i > 200:
            victim = make_request(f"victim-{i % 3}", max_tokens=20)
            sched.add_request(victim)
            arrived[victim.request_id] = i
        out = step(sched, clock)
        for req_id, n in out.num_scheduled_tokens.items():
            num_scheduled[req_id] = num_scheduled.get(req_id, 0) + n
        for req_id in list(arrived):
            if req_id in out.num_scheduled_tokens:
                waits.append(i - arrived.pop(req_id))
    # Recomputed: scheduled for a hog stream beyond its prompt and its outputs.
    recomputed = sum(
        num_scheduled.get(r.request_id, 0) - r.num_prompt_tokens - len(r.output_token_ids) + 1
        for r in hog
        if r.request_id in num_scheduled
    )
    generated = sum(len(r.output_token_ids) for r in hog)
    stats = sched.reclaim_stats
    waits.sort()
    return {
        "reclaims": stats.num_reclaims,
        "recomputed": max(recomputed, 0),
        "hog_tokens": generated,
        "wait_p50": statistics.median(waits),
        "wait_max": waits[-1],
        "victims": len(waits),
    }


def deep_queue_step_us(num_queued: int, num_steps: int) -> float:
    clock = FakeClock()
    sched = hog_scheduler(clock)
    for _ in range(NUM_SLOTS + num_queued):
        sched.add_request(make_request("hog", max_tokens=400))
    for _ in range(150):
        step(sched, clock)
    assert len(sched.waiting) == num_queued
    start = time.perf_counter_ns()
    for i in range(num_steps):
        if i % 50 == 0:
            sched.add_request(make_request("victim", max_tokens=5))
        step(sched, clock)
    return (time.perf_counter_ns() - start) / num_steps / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/reclaim.md"))
    args = parser.parse_args()
    lines = [
        "# Slot reclaim: churn, recompute cost, deep-queue step cost",
        "",
        f"Command: `.venv/bin/python -m bench.reclaim_bench --steps {args.steps} "
        f"--rounds {args.rounds}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). "
        "Real scheduler and KV manager, hand-built outputs, fake clock at 10 ms a step.",
        "",
        f"## Churn vs cooldown ({args.steps} steps of 10 ms, hog 20 tok/s with "
        f"{3 * NUM_SLOTS} streams of 64-token prompts on {NUM_SLOTS} slots, a 20-token "
        "victim request every N steps)",
        "",
        "Recomputed: prompt and output tokens the hog's reclaimed streams had to "
        "compute again when re-admitted (prefix cache off: every dropped token; on: "
        "what the cache no longer held).",
        "",
        "| victim every | prefix cache | cooldown | reclaims | tokens recomputed | hog tokens "
        "generated | victim wait p50 / max (steps) | victims |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for every in (25, 10):
        for prefix_cache in (False, True):
            for cooldown in COOLDOWNS:
                r = churn(cooldown, args.steps, every, prefix_cache)
                lines.append(
                    f"| {every} | {'on' if prefix_cache else 'off'} | {cooldown} | "
                    f"{r['reclaims']} | {r['recomputed']} | {r['hog_tokens']} | "
                    f"{r['wait_p50']} / {r['wait_max']} | {r['victims']} |"
                )
    shallow: list[float] = []
    deep: list[float] = []
    for _ in range(args.rounds):
        shallow.append(deep_queue_step_us(10, 500))
        deep.append(deep_queue_step_us(2000, 500))
    lines += [
        "",
        f"## Step cost, hog queue 10 vs 2,000 deep ({args.rounds} rounds of 500 steps, "
        "alternating)",
        "",
        "| queued | µs per step (median) | all rounds |",
        "|---|---|---|",
        f"| 10 | {statistics.median(shallow):.0f} | {', '.join(f'{x:.0f}' for x in shallow)} |",
        f"| 2,000 | {statistics.median(deep):.0f} | {', '.join(f'{x:.0f}' for x in deep)} |",
        "",
        f"Ratio 2,000 / 10: {statistics.median(deep) / statistics.median(shallow):.2f}.",
    ]
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
