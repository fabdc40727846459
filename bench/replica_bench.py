"""Replicas on one PostgreSQL database: what the NOTIFY wake-up costs writers, and what it
buys engines on another replica.

1. Writer cost: N threads each commit config writes (PUT-limit service calls, the same
   transaction a REST write runs) through one Database, with its announcer (NOTIFY after
   each commit) attached and not, alternating rounds in one run; writes/s and p50/p99.
2. Cross-replica delivery: two real `output-rate serve` replicas (their poll of the
   change log at 30 s, so only the wake-up delivers fast); a push client on B; sequential
   writes through A's REST API; from each response to B's engine applying the version.

    .venv/bin/python -m bench.replica_bench                  # writes bench/results/replicas.md
    .venv/bin/python -m bench.replica_bench --writes 100 --out -
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from bench.report import concurrent_writes, pct, write_report
from control_plane.db import Database, make_engine
from control_plane.limits import service as limits
from control_plane.replicas.notify import ChangeAnnouncer, current_channel
from harness.applying_engine import ApplyingEngine
from harness.control_plane import ADMIN_TOKEN, fresh_database, serve


def writer_round(db: Database, *, threads: int, writes: int, tag: str) -> tuple[float, list[float]]:
    def write(index: int, k: int) -> None:
        db.write_now(
            limits.put_limit.fn, actor="bench", user=f"{tag}-{index}-{k}", rate=10, tier=None
        )

    return concurrent_writes(threads=threads, writes=writes, write=write)


def writer_cost(url: str, *, threads: int, writes: int, rounds: int) -> list[str]:
    engine = make_engine(url)
    db = Database(engine)
    with engine.connect() as conn:
        announcer = ChangeAnnouncer(engine, current_channel(conn))
    announcer.start()
    # (writes/s, latencies) per mode
    results: dict[bool, list[tuple[float, list[float]]]] = {True: [], False: []}
    try:
        for r in range(rounds):
            for announce in (True, False) if r % 2 == 0 else (False, True):
                db.on_commit[:] = [announcer.committed] if announce else []
                results[announce].append(
                    writer_round(db, threads=threads, writes=writes, tag=f"r{r}{int(announce)}")
                )
    finally:
        announcer.close()
        db.dispose()
    lines = [
        f"{threads} writer threads x {writes} writes, {rounds} rounds per mode (alternating):",
        "",
        "| NOTIFY | writes/s (median of rounds) | p50 commit | p99 commit |",
        "|---|---|---|---|",
    ]
    rates = {}
    for announce in (False, True):
        rate = statistics.median(r for r, _ in results[announce])
        rates[announce] = rate
        every = [x for _, lat in results[announce] for x in lat]
        lines.append(
            f"| {'on' if announce else 'off'} | {rate:.0f} | {pct(every, 50) * 1000:.2f} ms "
            f"| {pct(every, 99) * 1000:.2f} ms |"
        )
    lines += ["", f"Ratio with / without NOTIFY: **{rates[True] / rates[False]:.3f}** writes/s."]
    return lines


def cross_replica(url: str, workdir: Path, *, writes: int) -> list[str]:
    env = {"OUTPUT_RATE_PUSH_POLL_INTERVAL_S": "30"}
    with serve(url, workdir, env=env) as a, serve(url, workdir, env=env) as b:
        latencies = []
        with (
            ApplyingEngine("bench-b", [b.zmq_endpoint]) as engine,
            httpx.Client(
                base_url=a.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
            ) as http,
        ):
            for n in range(writes):
                response = http.put(
                    f"/limits/x{n}", json={"output_tokens_per_second": 5, "scope": "engine"}
                )
                returned = time.monotonic()
                version = response.json()["version"]
                latencies.append(engine.wait_applied(version, timeout_s=10) - returned)
    return [
        f"Write on replica A -> applied by an engine on replica B, {writes} sequential PUTs "
        "(poll at 30 s: only NOTIFY delivers):",
        "",
        f"p50 **{pct(latencies, 50) * 1000:.1f} ms**, "
        f"p99 **{pct(latencies, 99) * 1000:.1f} ms**, max {max(latencies) * 1000:.1f} ms.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--writes", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default="bench/results/replicas.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        url = stack.enter_context(fresh_database("postgres", Path(tmp)))
        per_thread = args.writes // 4
        writers = writer_cost(url, threads=args.threads, writes=per_thread, rounds=args.rounds)
        delivery = cross_replica(url, Path(tmp), writes=args.writes)
    load = os.getloadavg()[0]
    text = "\n".join(
        [
            "# Replicas on one PostgreSQL database",
            "",
            f"`.venv/bin/python -m bench.replica_bench` ({time.strftime('%Y-%m-%d %H:%M UTC')}, "
            f"{platform.machine()}, {os.cpu_count()} cores, load {load:.1f}; PostgreSQL on "
            "127.0.0.1).",
            "",
            "## What NOTIFY costs concurrent writers",
            "",
            *writers,
            "",
            "The NOTIFY is sent after each commit by a thread on a session of its own "
            "(control_plane/replicas/notify.py), versions committed meanwhile folded into one "
            "announcement, so writers never wait for it or hold the version row through "
            "PostgreSQL's notify lock. Writes that make no version (usage history, engine "
            "status) send none.",
            "",
            "## Cross-replica delivery",
            "",
            *delivery,
            "",
        ]
    )
    write_report(text, args.out)


if __name__ == "__main__":
    main()
