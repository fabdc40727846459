"""Control-plane cost of the fleet share allocator (docs/fleet.md, "Cost").

50 simulated engines, 10,000 active fleet users spread over 1-3 engines each. Simulated time
advances in ticks of 50 ms: engines report the demand that changed during the tick, the
allocator steps once, every message is acked at the next tick. Per simulated second, a fraction
of the users change their streams (one in five of those moves to another engine). Measured: CPU
time spent in the allocator per simulated second, messages per engine per second, and the size of
a message encoded with msgspec msgpack (as the push server would send it).

    .venv/bin/python -m bench.fleet_alloc_bench
"""

from __future__ import annotations

import random
import statistics
import time

import msgspec

from control_plane.fleet.allocator import FleetAllocator, ShareUpdate
from control_plane.settings import DEFAULT_SHARE_LEASE_S

NUM_ENGINES = 50
NUM_USERS = 10_000
TICK_S = 0.05
MEASURE_S = 20


class WireShares(msgspec.Struct, frozen=True):
    seq: int
    num_engines: int
    lease_s: float
    full: bool
    shares: dict[str, int]


def encoded_size(update: ShareUpdate) -> int:
    wire = WireShares(update.seq, update.num_engines, update.lease_s, update.full, update.shares)
    return 1 + len(msgspec.msgpack.encode(wire))  # + the one-byte message type


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(churn_per_s: float, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    clock = Clock()
    alloc = FleetAllocator(lease_s=DEFAULT_SHARE_LEASE_S, clock=clock)
    engines = [f"engine-{i:02d}" for i in range(NUM_ENGINES)]
    users = [f"user-{i:05d}" for i in range(NUM_USERS)]
    # user -> engine -> streams
    placement = {
        user: {engine: rng.randint(1, 8) for engine in rng.sample(engines, rng.randint(1, 3))}
        for user in users
    }
    for engine in engines:
        alloc.engine_heard(engine)
    for user in users:
        alloc.set_limit(user, rng.choice([5, 20, 100, 1000]))
    for engine in engines:
        alloc.set_demand(
            engine, {u: p[engine] for u, p in placement.items() if engine in p}, full=True
        )

    # engine -> seq to ack at the next tick
    to_ack: dict[str, int] = {}
    measuring = False
    cpu_s = 0.0
    num_messages = 0
    sizes: list[int] = []
    num_ticks = int(MEASURE_S / TICK_S)
    changes_per_tick = churn_per_s * NUM_USERS * TICK_S
    owed = 0.0
    for tick in range(2 * num_ticks):
        measuring = tick >= num_ticks  # the first half settles the initial split
        clock.now = round(tick * TICK_S, 9)
        # engine -> user -> streams changed this tick
        reports: dict[str, dict[str, int]] = {}
        owed += changes_per_tick if measuring else 0.0
        while owed >= 1:
            owed -= 1
            user = rng.choice(users)
            streams = placement[user]
            if rng.random() < 0.2:
                gone = rng.choice(list(streams))
                del streams[gone]
                reports.setdefault(gone, {})[user] = 0
                streams[rng.choice(engines)] = rng.randint(1, 8)
            else:
                streams[rng.choice(list(streams))] = rng.randint(1, 8)
            for engine, num in streams.items():
                reports.setdefault(engine, {})[user] = num
        start = time.process_time()
        for engine, seq in to_ack.items():
            alloc.acked(engine, seq)
        for engine, delta in reports.items():
            alloc.set_demand(engine, delta, full=False)
        updates = alloc.step()
        elapsed = time.process_time() - start
        to_ack = {engine: update.seq for engine, update in updates.items()}
        if measuring:
            cpu_s += elapsed
            num_messages += len(updates)
            sizes.extend(encoded_size(update) for update in updates.values())
    full_sizes = [encoded_size(alloc.full_update(engine)) for engine in engines]
    return {
        "cpu_ms_per_s": 1000 * cpu_s / MEASURE_S,
        "messages_per_engine_s": num_messages / MEASURE_S / NUM_ENGINES,
        "mean_bytes": statistics.fmean(sizes),
        "max_bytes": max(sizes),
        "full_bytes": statistics.fmean(full_sizes),
    }


def main() -> list[str]:
    rows = [
        f"{NUM_ENGINES} engines, {NUM_USERS:,} active fleet users on 1-3 engines each, "
        f"{MEASURE_S} simulated seconds, a step every {TICK_S * 1000:.0f} ms",
        "",
        "| users changing streams per s | allocator CPU ms per s | messages per engine per s "
        "| bytes per message (mean / max) | full update bytes (mean) |",
        "|---|---|---|---|---|",
    ]
    for churn in (0.0, 0.05, 0.20):
        result = run(churn)
        rows.append(
            f"| {churn:.0%} ({churn * NUM_USERS:,.0f}) | {result['cpu_ms_per_s']:.1f} "
            f"| {result['messages_per_engine_s']:.1f} "
            f"| {result['mean_bytes']:.0f} / {result['max_bytes']:.0f} "
            f"| {result['full_bytes']:,.0f} |"
        )
    print("\n".join(rows))
    return rows


if __name__ == "__main__":
    main()
