"""Scheduler step cost, output-rate scheduler vs upstream vLLM 0.32.0.

One step = schedule() + update_from_output() on the real scheduler and KV
manager with R running decode requests (model runner outputs built by hand).
Both variants run side by side in one process, interleaved in rounds, so
machine noise hits them alike. Limits are on but nobody is throttled
(default 1,000,000 tok/s, R/4 users with 4 streams each).

Run: .venv/bin/python -m bench.scheduler_bench [--steps N] [--rounds K]
"""

from __future__ import annotations

import argparse
import statistics
import time

from tests.engine_ext.sched_helpers import make_request, make_scheduler, runner_output


def build(num_running: int, *, limited: bool, throttled: bool = False):
    sched = make_scheduler(
        limited=limited,
        default_rate=(1 if throttled else 1_000_000) if limited else None,
        max_num_seqs=num_running,
        max_num_batched_tokens=max(8192, num_running * 16),
        max_model_len=2048,
        num_blocks=num_running * 64 + 16,
    )
    for i in range(num_running):
        sched.add_request(make_request(f"user-{i // 4}", max_tokens=1900))
    # Prefill everything so the measured steps are pure decode steps.
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or sched.waiting:
        step(sched)
    return sched


def step(sched) -> None:
    out = sched.schedule()
    sched.update_from_output(out, runner_output(sched, out))


def time_steps(sched, num_steps: int) -> float:
    """Mean µs per step."""
    start = time.perf_counter_ns()
    for _ in range(num_steps):
        step(sched)
    return (time.perf_counter_ns() - start) / num_steps / 1000


def main() -> list[str]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    rows = [
        "| R running | upstream µs/step | output-rate µs/step | ratio | all throttled µs/step |",
        "|---|---|---|---|---|",
    ]
    for num_running in (64, 256, 1024):
        upstream = build(num_running, limited=False)
        ours = build(num_running, limited=True)
        throttled = build(num_running, limited=True, throttled=True)
        ups, our, thr = [], [], []
        for _ in range(args.rounds):
            ups.append(time_steps(upstream, args.steps))
            our.append(time_steps(ours, args.steps))
            thr.append(time_steps(throttled, args.steps))
        up_med, our_med, thr_med = (statistics.median(x) for x in (ups, our, thr))
        rows.append(
            f"| {num_running} | {up_med:.0f} | {our_med:.0f} | {our_med / up_med:.3f} "
            f"| {thr_med:.0f} |"
        )
        print(rows[-1], flush=True)
    print("\n".join(rows))
    return rows


if __name__ == "__main__":
    main()
