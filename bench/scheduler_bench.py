"""Scheduler step cost, output-rate scheduler vs upstream vLLM 0.32.0.

One step = schedule() + update_from_output() on the real scheduler and KV
manager with R running decode requests (model runner outputs built by hand).
Both variants run side by side in one process, interleaved in rounds, so
machine noise hits them alike. Limits are on but nobody is throttled
(default 1,000,000 tok/s, R/4 users with 4 streams each).

Two schedulers holding the same requests can differ by several percent in
step time from where their objects landed in memory alone, so each variant is
built ``--builds`` times and every build runs in every round; the figure is
the median over all of them. The last column times the plugin's own code
(the planner's plan and settle, the adapter applying the plan) inside the same steps: the part of
the difference that is the plugin's work rather than memory layout.

Run: .venv/bin/python -m bench.scheduler_bench [--steps N] [--rounds K] [--builds B]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from engine_ext.planner import StepPlanner
from engine_ext.scheduler import OutputRateMixin
from harness.scheduler import make_request, make_scheduler, runner_output

# (object, method) that run around upstream's schedule() in every step: the
# planner's plan and settle, the adapter's application of the plan.
OWN_CODE = (
    ("output_rate_planner", "plan"),
    (None, "_apply_plan"),
    ("output_rate_planner", "settle"),
)


def build(num_running: int, *, limited: bool, throttled: bool = False) -> Any:
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


def step(sched: Any) -> None:
    out = sched.schedule()
    sched.update_from_output(out, runner_output(sched, out))


def time_steps(sched: Any, num_steps: int) -> float:
    """Mean µs per step."""
    start = time.perf_counter_ns()
    for _ in range(num_steps):
        step(sched)
    return (time.perf_counter_ns() - start) / num_steps / 1000


def own_code_us(sched: Any, num_steps: int) -> float:
    """Mean µs per step spent in the mixin's own methods (timed on the instance)."""
    spent = [0]

    def timed(method: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return method(*args)
            finally:
                spent[0] += time.perf_counter_ns() - start

        return run

    owners = [(getattr(sched, holder) if holder else sched, name) for holder, name in OWN_CODE]
    for owner, name in owners:
        setattr(owner, name, timed(getattr(owner, name)))
    try:
        for _ in range(num_steps):
            step(sched)
    finally:
        for owner, name in owners:
            delattr(owner, name)
    return spent[0] / num_steps / 1000


def main() -> list[str]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--builds", type=int, default=3)
    args = parser.parse_args()
    assert all(callable(getattr(StepPlanner if h else OutputRateMixin, n)) for h, n in OWN_CODE)
    rows = [
        "| R running | upstream µs/step | output-rate µs/step | ratio "
        "| plugin's own code µs/step (share of upstream) | all throttled µs/step |",
        "|---|---|---|---|---|---|",
    ]
    for num_running in (64, 256, 1024):
        upstream = [build(num_running, limited=False) for _ in range(args.builds)]
        ours = [build(num_running, limited=True) for _ in range(args.builds)]
        throttled = build(num_running, limited=True, throttled=True)
        ups: list[float] = []
        our: list[float] = []
        thr: list[float] = []
        own: list[float] = []
        for _ in range(args.rounds):
            for up_sched, our_sched in zip(upstream, ours, strict=True):
                ups.append(time_steps(up_sched, args.steps))
                our.append(time_steps(our_sched, args.steps))
            thr.append(time_steps(throttled, args.steps))
            own.append(own_code_us(ours[0], args.steps))
        up_med, our_med, thr_med, own_med = (statistics.median(x) for x in (ups, our, thr, own))
        rows.append(
            f"| {num_running} | {up_med:.0f} | {our_med:.0f} | {our_med / up_med:.3f} "
            f"| {own_med:.0f} ({own_med / up_med:.1%}) | {thr_med:.0f} |"
        )
        print(rows[-1], flush=True)
    print("\n".join(rows))
    return rows


if __name__ == "__main__":
    main()
