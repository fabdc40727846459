"""Scheduler step cost, output-rate scheduler vs upstream vLLM (the release imported).

One step = schedule() + update_from_output() on the real scheduler and KV
manager with R running decode requests (model runner outputs built by hand).
Both variants run side by side in one process, interleaved in rounds, so
machine noise hits them alike. Limits are on but nobody is throttled
(default 1,000,000 tok/s; ``--streams-per-user`` streams per user, 4 unless told).

Two schedulers holding the same requests can differ by several percent in
step time from where their objects landed in memory alone, so each variant is
built ``--builds`` times and every build runs in every round; the figure is
the median over all of them. Two columns time the plugin's own work inside
the same steps: the planner's plan and settle with the adapter applying the
plan, and everything the mixin's schedule() adds around upstream's (the
planner, the gate, the bookkeeping): the part of the difference that is the
plugin's work rather than memory layout. The last column is a step when
every request is throttled. ``--shadow-users N``: the first N users have a shadow
limit of 1 tok/s (refused every step if enforced: counted, served as unlimited).

Run: .venv/bin/python -m bench.scheduler_bench [--steps N] [--rounds K] [--builds B]
     [--running R [R ...]] [--streams-per-user S] [--shadow-users N]
On another supported release, put its folder first (scripts/setup.sh installs them):
     PYTHONPATH=.cache/vllm-releases/0.34.0:. .venv/bin/python -m bench.scheduler_bench
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import vllm
from vllm.v1.core.sched.scheduler import Scheduler

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


@dataclass
class Workload:
    num_running: int
    streams_per_user: int
    # 0: every request decodes for the whole run. Otherwise requests finish
    # after 1 to 2x this many tokens and new ones (16-token prompts) arrive
    # in their place, so ``running`` changes most steps.
    mean_output_tokens: int = 0
    # Users (the first ones) whose limit is a shadow limit of 1 tok/s.
    num_shadow_users: int = 0


def build(workload: Workload, *, limited: bool, throttled: bool = False) -> Any:
    num_running = workload.num_running
    sched = make_scheduler(
        limited=limited,
        default_rate=(1 if throttled else 1_000_000) if limited else None,
        max_num_seqs=num_running,
        max_num_batched_tokens=max(8192, num_running * 16),
        max_model_len=2048,
        num_blocks=num_running * 64 + 16,
    )
    # Same seed for every build: each scheduler sees the same arrivals.
    rng = random.Random(num_running)
    num_users = max(1, num_running // workload.streams_per_user)
    if limited:
        for i in range(workload.num_shadow_users):
            sched.output_rate_limiter.set_milli_rate(f"user-{i}", 1000, shadow=True)

    def top_up() -> None:
        while len(sched.requests) < num_running:
            user = f"user-{len(sched.requests) % num_users}"
            if not workload.mean_output_tokens:
                sched.add_request(make_request(user, max_tokens=1900))
                continue
            max_tokens = rng.randint(1, 2 * workload.mean_output_tokens)
            sched.add_request(make_request(user, num_prompt_tokens=16, max_tokens=max_tokens))

    sched.bench_top_up = top_up
    top_up()
    # Prefill everything so the measured steps start as decode steps.
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running) or sched.waiting:
        step(sched)
    return sched


def step(sched: Any) -> None:
    out = sched.schedule()
    sched.update_from_output(out, runner_output(sched, out))
    sched.bench_top_up()


def time_steps(sched: Any, num_steps: int) -> float:
    """Mean µs per step."""
    start = time.perf_counter_ns()
    for _ in range(num_steps):
        step(sched)
    return (time.perf_counter_ns() - start) / num_steps / 1000


def own_code_us(sched: Any, num_steps: int) -> tuple[float, float]:
    """Mean µs per step (in the planner and adapter, in all of the mixin's schedule()).

    The first figure times the ``OWN_CODE`` methods on the instance. The
    second is the time of the mixin's ``schedule()`` less the upstream
    ``Scheduler.schedule()`` it calls: everything the plugin adds to a step.
    """
    spent = [0, 0]

    def timed(method: Callable[..., Any], slot: int) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return method(*args, **kwargs)
            finally:
                spent[slot] += time.perf_counter_ns() - start

        return run

    owners = [(getattr(sched, holder) if holder else sched, name) for holder, name in OWN_CODE]
    for owner, name in owners:
        setattr(owner, name, timed(getattr(owner, name), 0))
    # The bound schedule() on the instance (mixin), upstream's on its class.
    sched.schedule = timed(sched.schedule, 1)
    upstream_schedule = Scheduler.schedule
    inside = [0]

    def timed_upstream(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return upstream_schedule(self, *args, **kwargs)
        finally:
            inside[0] += time.perf_counter_ns() - start

    Scheduler.schedule = timed_upstream  # type: ignore[method-assign]
    try:
        for _ in range(num_steps):
            step(sched)
    finally:
        Scheduler.schedule = upstream_schedule  # type: ignore[method-assign]
        del sched.schedule
        for owner, name in owners:
            delattr(owner, name)
    return spent[0] / num_steps / 1000, (spent[1] - inside[0]) / num_steps / 1000


def main() -> list[str]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--builds", type=int, default=3)
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument(
        "--streams-per-user", type=int, default=4, help="running requests per user (default 4)"
    )
    parser.add_argument(
        "--mean-output-tokens",
        type=int,
        default=0,
        help="requests finish after 1 to 2x this many tokens and are replaced "
        "(default 0: all decode for the whole run)",
    )
    parser.add_argument(
        "--shadow-users",
        type=int,
        default=0,
        help="the first N users have a shadow limit of 1 tok/s (default 0)",
    )
    args = parser.parse_args()
    assert all(callable(getattr(StepPlanner if h else OutputRateMixin, n)) for h, n in OWN_CODE)
    print(f"vLLM {vllm.__version__}", flush=True)
    rows = [
        "| R running | upstream µs/step | output-rate µs/step | ratio "
        "| planner + adapter µs/step (share of upstream) "
        "| all the plugin adds to schedule() µs/step (share) | all throttled µs/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for num_running in args.running:
        workload = Workload(
            num_running, args.streams_per_user, args.mean_output_tokens, args.shadow_users
        )
        upstream = [build(workload, limited=False) for _ in range(args.builds)]
        ours = [build(workload, limited=True) for _ in range(args.builds)]
        throttled = build(workload, limited=True, throttled=True)
        ups: list[float] = []
        our: list[float] = []
        thr: list[float] = []
        own: list[float] = []
        added: list[float] = []
        for _ in range(args.rounds):
            for up_sched, our_sched in zip(upstream, ours, strict=True):
                ups.append(time_steps(up_sched, args.steps))
                our.append(time_steps(our_sched, args.steps))
            thr.append(time_steps(throttled, args.steps))
            planner_us, added_us = own_code_us(ours[0], args.steps)
            own.append(planner_us)
            added.append(added_us)
        up_med, our_med, thr_med, own_med, add_med = (
            statistics.median(x) for x in (ups, our, thr, own, added)
        )
        rows.append(
            f"| {num_running} | {up_med:.0f} | {our_med:.0f} | {our_med / up_med:.3f} "
            f"| {own_med:.0f} ({own_med / up_med:.1%}) | {add_med:.0f} ({add_med / up_med:.1%}) "
            f"| {thr_med:.0f} |"
        )
        print(rows[-1], flush=True)
    print("\n".join(rows))
    return rows


if __name__ == "__main__":
    main()
