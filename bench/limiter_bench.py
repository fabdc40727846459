"""Cost of OutputRateLimiter.try_take in CPython (ns per call).

Run: .venv/bin/python -m bench.limiter_bench
"""

from __future__ import annotations

import random
import time

from engine_ext.limiter import OutputRateLimiter

NUM_CALLS = 1_000_000


def ns_per_take(num_users: int, *, limited: bool, num_active: int | None = None) -> float:
    """``num_users`` tracked; calls spread over ``num_active`` of them (all if None)."""
    limiter = OutputRateLimiter(1_000_000 if limited else None)
    users = [f"user-{i}" for i in range(num_users)]
    rng = random.Random(0)
    active = rng.sample(users, num_active) if num_active else users
    sequence = [active[rng.randrange(len(active))] for _ in range(NUM_CALLS)]
    for user in users:  # every user has state, as in steady operation
        limiter.try_take(user)
    take = limiter.try_take
    start = time.perf_counter_ns()
    for user in sequence:
        take(user)
    elapsed = time.perf_counter_ns() - start
    return elapsed / NUM_CALLS


def loop_overhead_ns() -> float:
    sequence = ["u"] * NUM_CALLS

    def noop(user: str) -> bool:
        return True

    start = time.perf_counter_ns()
    for user in sequence:
        noop(user)
    return (time.perf_counter_ns() - start) / NUM_CALLS


def main() -> list[str]:
    rows = [
        "| users tracked | users called | limited ns/call | unlimited ns/call | empty call ns |",
        "|---|---|---|---|---|",
    ]
    empty = loop_overhead_ns()
    for num_users, num_active in ((10, None), (100_000, 256), (100_000, None)):
        limited = min(ns_per_take(num_users, limited=True, num_active=num_active) for _ in range(3))
        unlimited = min(
            ns_per_take(num_users, limited=False, num_active=num_active) for _ in range(3)
        )
        called = f"{num_active:,} (random)" if num_active else f"all {num_users:,} (random)"
        rows.append(f"| {num_users:,} | {called} | {limited:.0f} | {unlimited:.0f} | {empty:.0f} |")
    print("\n".join(rows))
    return rows


if __name__ == "__main__":
    main()
