"""Borrowing idle capacity on the real scheduler: service and step cost.

The real vLLM scheduler and KV manager with hand-built model outputs and a fake clock
(10 ms per step), as in tests/engine_ext (the engine's pace is one token per active
stream per step: 400 tok/s with 4 active slots).

1. Alone: engine tokens/s of a user of 20 tok/s with a ceiling of 100,000 (4 streams),
   of an unlimited user, and of the 20 tok/s user without a ceiling; the ratio
   borrower / unlimited.
2. Two backlogged borrowers of 20 and 60 tok/s (4 streams each, 4 active slots): tokens
   lent to each, per unit of its rate, and the weighted difference.
3. Step cost: wall time per schedule() + update_from_output() with 16 streams of 4
   borrowers beside 16 streams of 4 users without a ceiling (the lending pass runs every
   step) vs the same users all without a ceiling, side by side in rounds.

Run: .venv/bin/python -m bench.borrow_bench [--steps 1000] [--out bench/results/borrow.md]
(replaces only its own section of the results file; "--out -": print only)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from typing import Any

from bench.report import write_section
from harness.scheduler import FakeClock, make_request, make_scheduler, runner_output
from output_rate_core.protocol import MILLI

STEP_MS = 10
HIGH = 100_000
CASES = {
    "hard": "8 users of 20 tok/s, no ceiling",
    "fast": "4 of them at 100,000 tok/s instead (no lending, same work)",
    "borrowing": f"4 of them with a ceiling of {HIGH:,} (lent every step)",
}


def scheduler(
    rates: dict[str, int | None], ceilings: dict[str, int], clock: FakeClock, **kwargs: Any
) -> Any:
    sched: Any = make_scheduler(user_rates=rates, clock=clock, **kwargs)
    for user, ceiling in ceilings.items():
        sched.output_rate_limiter.set_milli_ceiling(user, ceiling * MILLI)
    sched.output_rate_planner.count_granted = True
    return sched


def add(sched: Any, user: str, num: int, max_tokens: int = 100_000) -> None:
    for i in range(num):
        sched.add_request(
            make_request(user, max_tokens=max_tokens, request_id=f"{user}-{i}"),
        )


def run(sched: Any, clock: FakeClock, num_steps: int) -> tuple[Counter[str], float]:
    """Tokens per user sampled, and the wall seconds the steps took."""
    tokens: Counter[str] = Counter()
    start = time.perf_counter()
    for _ in range(num_steps):
        out = sched.schedule()
        model_out = runner_output(sched, out)
        sched.update_from_output(out, model_out)
        for req_id, sampled in zip(model_out.req_ids, model_out.sampled_token_ids, strict=True):
            if sampled:
                tokens[req_id.rsplit("-", 1)[0]] += 1
        clock.advance_ms(STEP_MS)
    return tokens, time.perf_counter() - start


def alone(num_steps: int) -> dict[str, float]:
    rates = {}
    for case, rate, ceilings in (
        ("borrower", 20, {"a": HIGH}),
        ("unlimited", None, {}),
        ("hard", 20, {}),
    ):
        clock = FakeClock()
        sched = scheduler({"a": rate}, ceilings, clock, max_num_seqs=8, max_num_active_seqs=4)
        add(sched, "a", 4)
        tokens, _ = run(sched, clock, num_steps)
        rates[case] = tokens["a"] / (num_steps * STEP_MS / 1000)
    return rates


def two_borrowers(num_steps: int) -> tuple[dict[str, int], dict[str, int]]:
    clock = FakeClock()
    sched = scheduler(
        {"a": 20, "b": 60},
        {"a": HIGH, "b": HIGH},
        clock,
        max_num_seqs=8,
        max_num_active_seqs=4,
    )
    add(sched, "a", 4)
    add(sched, "b", 4)
    tokens, _ = run(sched, clock, num_steps)
    return dict(tokens), dict(sched.output_rate_planner.num_borrowed)


def step_cost_us(case: str, num_steps: int) -> float:
    """``case``: "hard" (no ceiling), "borrowing" (4 users borrow), "fast" (those 4 at a
    rate that never binds instead: the same work scheduled, no lending)."""
    clock = FakeClock()
    users = [f"u{i}" for i in range(8)]
    rates: dict[str, int | None] = {user: 20 for user in users}
    if case == "fast":
        rates.update((user, HIGH) for user in users[:4])
    ceilings = {user: HIGH for user in users[:4]} if case == "borrowing" else {}
    sched = scheduler(rates, ceilings, clock, max_num_seqs=32, max_num_active_seqs=16)
    for user in users:
        add(sched, user, 4)
    run(sched, clock, 50)  # admitted, steady
    _, wall = run(sched, clock, num_steps)
    return wall / num_steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench/results/borrow.md", help='"-": print only')
    args = parser.parse_args()
    seconds = args.steps * STEP_MS / 1000
    rates = alone(args.steps)
    tokens, borrowed = two_borrowers(args.steps)
    costs: dict[str, list[float]] = {"hard": [], "fast": [], "borrowing": []}
    for _ in range(args.rounds):
        for case, values in costs.items():
            values.append(step_cost_us(case, args.steps))
    lines = [
        "# Borrowing idle capacity (scheduler level)",
        "",
        f"`.venv/bin/python -m bench.borrow_bench --steps {args.steps} --rounds {args.rounds}`: "
        "the real vLLM scheduler, hand-built model outputs, a fake clock of "
        f"{STEP_MS} ms per step ({seconds:.0f} s simulated per run); 4 active slots "
        "(engine pace 400 tok/s) unless said.",
        "",
        "## A borrower alone (4 streams)",
        "",
        "| user | tok/s |",
        "|---|---|",
        f"| rate 20, ceiling {HIGH:,} | {rates['borrower']:.1f} |",
        f"| unlimited | {rates['unlimited']:.1f} |",
        f"| rate 20, no ceiling | {rates['hard']:.1f} |",
        "",
        f"Borrower / unlimited: {rates['borrower'] / rates['unlimited']:.3f}.",
        "",
        "## Two backlogged borrowers (rates 20 and 60, 4 streams each, 4 active slots)",
        "",
        "| user | tokens | of which borrowed | borrowed per tok/s of rate |",
        "|---|---|---|---|",
        f"| a (20) | {tokens['a']} | {borrowed['a']} | {borrowed['a'] / 20:.2f} |",
        f"| b (60) | {tokens['b']} | {borrowed['b']} | {borrowed['b'] / 60:.2f} |",
        "",
        f"Weighted difference |borrowed_b - 3 x borrowed_a| = "
        f"{abs(borrowed['b'] - 3 * borrowed['a'])} tokens of {borrowed['a'] + borrowed['b']} "
        f"lent; total ratio b / a = {tokens['b'] / tokens['a']:.3f} (rates: 3).",
        "",
        f"## Step cost ({args.rounds} rounds of {args.steps} steps, alternating)",
        "",
        "8 users with 4 streams each, 32 worker slots, 16 active. Wall time per "
        "schedule() + update_from_output(), this machine (2 cores shared with other work).",
        "",
        "| case | µs per step (median) | all rounds |",
        "|---|---|---|",
        *(
            f"| {CASES[case]} | {statistics.median(values):.0f} | "
            f"{', '.join(f'{x:.0f}' for x in values)} |"
            for case, values in costs.items()
        ),
        "",
        "Without a ceiling most steps schedule a token or two (8 users of 20 tok/s); with 4 "
        "borrowers, or 4 users at a rate that never binds, every step runs 16 streams, so "
        "the cost of lending is the borrowing row against the fast row.",
    ]
    # The file's other sections (bench/vtc_bench.py's, the notes by hand) stay.
    write_section("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
