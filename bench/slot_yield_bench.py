"""The cost of giving arriving users active slots (the planner's yield) on the real scheduler.

The real vLLM scheduler and KV manager with hand-built model outputs and a fake clock
(20 ms per step), as in tests/engine_ext. N users at 50 tok/s (one token a step each)
hold all N active slots, a throttled user (1 tok/s) keeps N more streams resident, and then N new
users within their rates arrive in one step: that step parks N running requests and
admits the N newcomers (the largest yield one step can make). Reported: the wall time of
that step against the median step just before, and how many newcomers it scheduled; the
same with N more active slots, where the newcomers take free ones (no yield): the
difference between the two arrival steps is what the yield costs.

Run: .venv/bin/python -m bench.slot_yield_bench [--active 64 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.report import write_section
from harness.scheduler import FakeClock, make_request, make_scheduler, runner_output

STEP_MS = 20


def step(sched, clock: FakeClock) -> object:
    out = sched.schedule()
    sched.update_from_output(out, runner_output(sched, out))
    clock.advance_ms(STEP_MS)
    return out


def arrival_step(num_active: int, *, slots_free: bool) -> tuple[float, float, int]:
    """(µs of the step in which num_active newcomers arrive, median µs of the 20 steps
    before, newcomers scheduled in it). ``slots_free``: N more active slots, so the
    newcomers are admitted into free ones (the same admissions, no yield)."""
    crowd = [f"u{i}" for i in range(num_active)]
    newcomers = [f"n{i}" for i in range(num_active)]
    clock = FakeClock()
    sched = make_scheduler(
        user_rates=dict.fromkeys([*crowd, *newcomers], 50),
        max_num_seqs=4 * num_active,
        max_num_active_seqs=2 * num_active if slots_free else num_active,
        max_num_batched_tokens=16 * num_active,
        clock=clock,
    )
    for _ in range(num_active):
        sched.add_request(make_request("hog", max_tokens=1000))
    step(sched, clock)  # the hog's streams admitted while it is unlimited, then held
    sched.output_rate_limiter.set_rate("hog", 1)
    for user in crowd:
        sched.add_request(make_request(user, max_tokens=1000))
    for _ in range(100):
        step(sched, clock)
    assert len(sched.running) == 2 * num_active, len(sched.running)
    before = []
    for _ in range(20):
        started = time.perf_counter_ns()
        step(sched, clock)
        before.append((time.perf_counter_ns() - started) / 1000)
    arrivals = [make_request(user, max_tokens=10) for user in newcomers]
    for request in arrivals:
        sched.add_request(request)
    started = time.perf_counter_ns()
    out = step(sched, clock)
    elapsed = (time.perf_counter_ns() - started) / 1000
    num_scheduled = sum(r.request_id in out.num_scheduled_tokens for r in arrivals)
    return elapsed, statistics.median(before), num_scheduled


def report(sizes: list[int], rounds: int) -> str:
    lines = [
        "# Giving arriving users active slots (scheduler level)",
        "",
        f"`.venv/bin/python -m bench.slot_yield_bench --active {' '.join(map(str, sizes))} "
        f"--rounds {rounds}`: {__doc__.split(chr(10) + chr(10))[1].replace(chr(10), ' ')}",
        "Median over the rounds (each a fresh scheduler); this machine, 2 shared cores.",
        "",
        "| active slots (N) | newcomers get | step with N arrivals (µs) | "
        "median step before (µs) | newcomers scheduled in it |",
        "|---|---|---|---|---|",
    ]
    for size in sizes:
        for slots_free, how in ((False, "slots yielded"), (True, "N free slots")):
            runs = [arrival_step(size, slots_free=slots_free) for _ in range(rounds)]
            arrival = statistics.median(r[0] for r in runs)
            before = statistics.median(r[1] for r in runs)
            scheduled = min(r[2] for r in runs)
            lines.append(
                f"| {size} | {how} | {arrival:.0f} | {before:.0f} | {scheduled} of {size} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--active", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench/results/slot_yield.md", help='"-": print only')
    args = parser.parse_args()
    write_section(report(args.active, args.rounds), args.out)


if __name__ == "__main__":
    main()
