"""Control-plane replicas on one PostgreSQL database: what a highly available deployment
costs and how fast it recovers (docs/replicas.md). Real `output-rate serve` processes,
real push clients (engine_ext/push_client.py) in this process, PostgreSQL on 127.0.0.1.

1. Write throughput and latency through the REST API with 1, 2 and 3 replicas, NOTIFY on
   and off (OUTPUT_RATE_REPLICA_NOTIFY): client threads PUT limits round robin over the
   replicas.
2. Write-to-applied across replicas: one engine on each replica, sequential PUTs on the
   replicas in turn; from each response to every engine on another replica applying the
   version (NOTIFY on; off, the poll of the change log delivers).
3. Failover of an engine: kill -9 of its replica -> it applied a version written on the
   other replica after the kill.
4. Leader takeover: SIGSTOP of the leader -> another replica's /readyz says leader.
5. Database writes per engine per second: engines reporting usage every 0.5 s and a fleet
   demand, two replicas; rows inserted/updated/deleted per table (pg_stat_user_tables of
   the bench's schema) and the replicas' own transaction counters.

    .venv/bin/python -m bench.ha_bench                  # writes bench/results/ha.md
    .venv/bin/python -m bench.ha_bench --quick --out -
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text

from bench.report import concurrent_writes, pct, write_report
from harness.applying_engine import ApplyingEngine
from harness.control_plane import Served, fresh_database, kill_hard, serve


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


@contextmanager
def replicas(
    url: str, workdir: Path, n: int, *, notify: bool = True, tag: str = "r"
) -> Iterator[list[Served]]:
    env = {"OUTPUT_RATE_REPLICA_NOTIFY": "true" if notify else "false"}
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                serve(url, workdir, env={**env, "OUTPUT_RATE_REPLICA_ID": f"{tag}-{i}"})
            )
            for i in range(n)
        ]


class Engine(ApplyingEngine):
    """An engine that, once `report` is set, also reports usage and its streams twice a
    second, as a serving engine does."""

    def __init__(self, name: str, endpoints: list[str]) -> None:
        super().__init__(name, endpoints)
        self.streams: dict[str, int] = {}
        self.report = False
        self._next_report = 0.0

    def after_apply(self, now: float) -> None:
        if self.report and now >= self._next_report:
            self._next_report = now + 0.5
            self.client.report_usage(
                granted={"u1": 50, "u2": 30}, throttled={"u1": 5}, would_throttle={}
            )
            self.client.report_demand(dict(self.streams))


def admin(replica: Served) -> httpx.Client:
    return replica.client()


def put(http: httpx.Client, user: str) -> int:
    response = http.put(f"/limits/{user}", json={"output_tokens_per_second": 5, "scope": "engine"})
    assert response.status_code == 200, response.text
    return int(response.json()["version"])


# ---- 1. write throughput --------------------------------------------------------------


def throughput_round(
    served: list[Served], *, threads: int, writes: int, tag: str
) -> tuple[float, list[float]]:
    """(writes/s, latencies) of `threads` clients writing round robin over `served`, each
    with one HTTP connection per replica."""
    clients = [[admin(r) for r in served] for _ in range(threads)]

    def write(index: int, k: int) -> None:
        put(clients[index][(index + k) % len(served)], f"w{tag}-{index}-{k}")

    try:
        return concurrent_writes(threads=threads, writes=writes, write=write)
    finally:
        for mine in clients:
            for c in mine:
                c.close()


def write_throughput(url: str, workdir: Path, *, threads: int, writes: int) -> list[str]:
    lines = [
        f"{threads} client threads, {writes} PUT /limits each, round robin over the replicas "
        "(one HTTP connection per thread and replica):",
        "",
        "| replicas | NOTIFY | writes/s | p50 | p99 |",
        "|---|---|---|---|---|",
    ]
    for n in (1, 2, 3):
        for notify in (True, False):
            tag = f"{n}{int(notify)}"
            with replicas(url, workdir, n, notify=notify, tag=f"w{tag}") as served:
                rate, latencies = throughput_round(served, threads=threads, writes=writes, tag=tag)
            lines.append(
                f"| {n} | {'on' if notify else 'off'} | {rate:.0f} | {ms(pct(latencies, 50))} "
                f"| {ms(pct(latencies, 99))} |"
            )
    lines += [
        "",
        "Every write takes the one `config_state` row lock (versions gap-free, docs/replicas.md), "
        "so replicas add REST capacity, not write capacity: more replicas share the same "
        "serialised commit. On this 2-core machine, shared with other work, the replicas and the "
        "clients also share the CPUs: configurations differ by up to 2x between runs, so read "
        'the table as "one order of magnitude whatever the replicas and NOTIFY", not as a '
        "trend. The NOTIFY is sent after the commit on "
        "a session of its own (never inside the write); its cost to concurrent writers at the "
        "database alone is in bench/results/replicas.md (0.95x).",
    ]
    return lines


# ---- 2. write to applied ---------------------------------------------------------------


def write_to_applied(url: str, workdir: Path, *, writes: int) -> list[str]:
    lines = [
        f"Three replicas, one engine on each; {writes} sequential PUTs on the replicas in turn; "
        "from each response to its version applied by the engines on the two other replicas:",
        "",
        "| NOTIFY | p50 | p99 | max |",
        "|---|---|---|---|",
    ]
    for notify in (True, False):
        with (
            replicas(url, workdir, 3, notify=notify, tag=f"d{int(notify)}") as served,
            ExitStack() as stack,
        ):
            engines = [
                stack.enter_context(Engine(f"d{int(notify)}-e{i}", [r.zmq_endpoint]))
                for i, r in enumerate(served)
            ]
            clients = [stack.enter_context(admin(r)) for r in served]
            latencies = []
            for k in range(writes):
                at = k % 3
                version = put(clients[at], f"d{int(notify)}-{k}")
                returned = time.monotonic()
                for e in (e for i, e in enumerate(engines) if i != at):
                    latencies.append(e.wait_applied(version, timeout_s=10) - returned)
        lines.append(
            f"| {'on' if notify else 'off (poll 1 s)'} | {ms(pct(latencies, 50))} "
            f"| {ms(pct(latencies, 99))} | {ms(max(latencies))} |"
        )
    lines += [
        "",
        "With NOTIFY the other replicas' push threads wake on the notification and read the "
        "change log at once; without, at their next poll (`OUTPUT_RATE_PUSH_POLL_INTERVAL_S`, "
        "1 s): up to the poll interval, half of it on average.",
    ]
    return lines


# ---- 3. engine failover ----------------------------------------------------------------


def engine_failover(url: str, workdir: Path, *, runs: int) -> list[str]:
    times = []
    for run in range(runs):
        with (
            replicas(url, workdir, 2, tag=f"f{run}") as (a, b),
            Engine(f"f{run}", [a.zmq_endpoint, b.zmq_endpoint]) as engine,
            admin(b) as http,
        ):
            killed = time.monotonic()
            kill_hard(a)
            version = put(http, f"f{run}-after-kill")
            times.append(engine.wait_applied(version) - killed)
    return [
        f"kill -9 of the engine's replica (the first of two listed) -> the engine applied a "
        f"version written on the other replica right after the kill, {runs} runs: "
        + ", ".join(f"{t:.1f} s" for t in times)
        + f" (max {max(times):.1f} s). The engine moves after 10.5 s without a frame "
        "(3 x the 3.5 s silence), keeping its limits meanwhile.",
    ]


# ---- 4. leader takeover ---------------------------------------------------------------


def readiness(replica: Served) -> dict[str, object]:
    return httpx.get(f"{replica.url}/readyz", timeout=5).json()


def leader_takeover(url: str, workdir: Path, *, runs: int) -> list[str]:
    times = []
    for run in range(runs):
        with replicas(url, workdir, 2, tag=f"l{run}") as served:
            deadline = time.monotonic() + 30
            while not any(readiness(r)["leader"] for r in served):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            leader = next(r for r in served if readiness(r)["leader"])
            other = next(r for r in served if r is not leader)
            stopped = time.monotonic()
            leader.process.send_signal(signal.SIGSTOP)
            try:
                while not readiness(other)["leader"]:
                    assert time.monotonic() - stopped < 30, "no takeover"
                    time.sleep(0.02)
                times.append(time.monotonic() - stopped)
            finally:
                leader.process.send_signal(signal.SIGCONT)
    return [
        f"SIGSTOP of the leader -> the other replica's /readyz says leader, {runs} runs: "
        + ", ".join(f"{t:.1f} s" for t in times)
        + f" (max {max(times):.1f} s; bound: the 3 s lease + one 1 s attempt period).",
    ]


# ---- 5. database writes per engine ----------------------------------------------------


def schema_of(url: str) -> str:
    found = re.search(r"search_path%3D(\w+)", url)
    assert found is not None
    return found.group(1)


def table_writes(url: str) -> dict[str, int]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT pg_stat_clear_snapshot()"))
            rows = conn.execute(
                text(
                    "SELECT relname, n_tup_ins + n_tup_upd + n_tup_del AS n "
                    "FROM pg_stat_user_tables WHERE schemaname = :schema"
                ),
                {"schema": schema_of(url)},
            ).all()
        return {r.relname: int(r.n) for r in rows}
    finally:
        engine.dispose()


RELAY_WRITES = 'output_rate_fleet_relay_transactions_total{kind="write"}'


def counters(replica: Served) -> dict[str, float]:
    with admin(replica) as http:
        metrics = http.get("/metrics").text
    out = {}
    for name in (
        "output_rate_live_usage_rows_written_total",
        "output_rate_live_usage_transactions_total",
        RELAY_WRITES,
        "output_rate_fleet_relay_rows_written_total",
    ):
        found = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
        out[name] = float(found.group(1)) if found else 0.0
    return out


def write_load(url: str, workdir: Path, *, engines_per_replica: int, seconds: float) -> list[str]:
    n = 2 * engines_per_replica
    with replicas(url, workdir, 2, tag="load") as served, ExitStack() as stack:
        with admin(served[0]) as http:
            response = http.put("/limits/fleet-user", json={"output_tokens_per_second": 100})
            assert response.status_code == 200
        engines = [
            stack.enter_context(Engine(f"load-{i}", [served[i % 2].zmq_endpoint])) for i in range(n)
        ]
        for engine in engines:
            engine.streams = {"fleet-user": 1}
            engine.report = True
        time.sleep(8.0)  # every engine reporting, shares settled
        before_tables, before = table_writes(url), [counters(r) for r in served]
        time.sleep(seconds)
        after_tables, after = table_writes(url), [counters(r) for r in served]
    per_table = {
        t: (after_tables.get(t, 0) - before_tables.get(t, 0)) / seconds / n for t in after_tables
    }

    def rate(name: str) -> float:
        return sum(a[name] - b[name] for a, b in zip(after, before, strict=True)) / seconds / n

    lines = [
        f"{n} engines, {engines_per_replica} on each of two replicas, each reporting usage every "
        f"0.5 s and a steady fleet demand; {seconds:.0f} s, per engine per second:",
        "",
        "| what | per engine per second |",
        "|---|---|",
        f"| live_usage rows written (the replicas' counters) | "
        f"{rate('output_rate_live_usage_rows_written_total'):.2f} |",
        f"| live_usage transactions | {rate('output_rate_live_usage_transactions_total'):.2f} |",
        f"| fleet relay write transactions | {rate(RELAY_WRITES):.2f} |",
        f"| fleet relay rows written | {rate('output_rate_fleet_relay_rows_written_total'):.2f} |",
    ]
    for table in sorted(per_table):
        if per_table[table] > 0:
            lines.append(
                f"| rows inserted+updated+deleted in `{table}` (pg_stat_user_tables) "
                f"| {per_table[table]:.2f} |"
            )
    lines += [
        f"| all tables | {sum(per_table.values()):.2f} |",
        "",
        "The shared fleet view adds one `live_usage` row per engine a second (an upsert) and "
        "one transaction per replica a second whatever its engines (here 2 replicas / "
        f"{n} engines = {2 / n:.2f} per engine), plus the leader's one `fleet_shares` row a "
        "second. `engines` rows are the engine status the push server already wrote "
        "(applied version, last seen, home), and `fleet_relay` the relay's rows (written and "
        "deleted by the reader). pg_stat_user_tables counts reach the statistics with a "
        "delay (up to about 10 s for an idle session), so the small rows of the set-up "
        "writes (`audit_log`, `config_*`) show up; the per-replica counters are exact.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer writes and runs")
    parser.add_argument("--out", default="bench/results/ha.md")
    args = parser.parse_args()
    quick = args.quick
    sections: list[tuple[str, Callable[[str, Path], list[str]]]] = [
        (
            "Write throughput and latency",
            lambda u, w: write_throughput(u, w, threads=8, writes=10 if quick else 40),
        ),
        (
            "Write to applied across replicas",
            lambda u, w: write_to_applied(u, w, writes=30 if quick else 150),
        ),
        ("Failover of an engine", lambda u, w: engine_failover(u, w, runs=1 if quick else 3)),
        ("Leader takeover", lambda u, w: leader_takeover(u, w, runs=2 if quick else 5)),
        (
            "Database writes per engine per second",
            lambda u, w: write_load(u, w, engines_per_replica=4, seconds=5.0 if quick else 15.0),
        ),
    ]
    body: list[str] = []
    for title, run in sections:
        with tempfile.TemporaryDirectory() as tmp, fresh_database("postgres", Path(tmp)) as url:
            started = time.monotonic()
            lines = run(url, Path(tmp))
            print(f"{title}: {time.monotonic() - started:.0f} s", flush=True)
        body += [f"## {title}", "", *lines, ""]
    load = os.getloadavg()[0]
    text_ = "\n".join(
        [
            "# Control-plane replicas: throughput, delivery, failover, write load",
            "",
            f"`.venv/bin/python -m bench.ha_bench` ({time.strftime('%Y-%m-%d %H:%M UTC')}, "
            f"{platform.machine()}, {os.cpu_count()} cores shared with other work, load "
            f"{load:.1f} at the end; PostgreSQL on 127.0.0.1). Figures of one run on a shared "
            "machine: orders of magnitude and ratios, not capacity floors. The NOTIFY cost at "
            "the database alone and the first write-to-applied figures: "
            "bench/results/replicas.md (`bench.replica_bench`). How replicas work: "
            "docs/replicas.md.",
            "",
            *body,
        ]
    )
    write_report(text_, args.out)


if __name__ == "__main__":
    main()
