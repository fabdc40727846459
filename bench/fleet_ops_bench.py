"""Fleet operations: how long an engine takes to reach the next control-plane replica when
its own dies (kill -9) or loses PostgreSQL (its sessions terminated and reconnections
refused; a black-holed connection), measured as what an operator sees: from the kill or
the cut to a write made through the other replica applied by the engine.

Two real `output-rate serve` replicas on one PostgreSQL schema and a real push client
(harness/applying_engine.py, default timeouts) listing both; the cut goes through a TCP
proxy only the engine's replica uses (harness/tcp_proxy.py). Fresh replicas for each run.

    .venv/bin/python -m bench.fleet_ops_bench [--runs 5] [--out bench/results/fleet_ops.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

from bench.report import write_section
from harness.control_plane import fresh_database, kill_hard, serve
from harness.failover import session_terminator, start_on_first, write_through
from harness.tcp_proxy import Cut, TcpProxy

WAIT_S = 60.0


def one_run(how: Cut | None, tmp: Path, index: int) -> float:
    """Seconds from the kill (how=None) or the cut to the write applied."""
    with ExitStack() as stack:
        terminate = stack.enter_context(session_terminator())
        url = stack.enter_context(fresh_database("postgres", tmp))
        proxy = TcpProxy(("127.0.0.1", 5432))
        stack.callback(proxy.close)
        a_url = url if how is None else url.replace(":5432/", f":{proxy.port}/")
        a = stack.enter_context(serve(a_url, tmp))
        stack.callback(proxy.restore)
        b = stack.enter_context(serve(url, tmp))
        name = f"bench-{how or 'kill'}-{index}"
        engine = start_on_first(name, a, b, WAIT_S)
        stack.callback(engine.close)
        if how is None:
            kill_hard(a)
        else:
            proxy.cut(how, terminate)
        started = time.monotonic()
        version = write_through(b, f"after-{index}", 5)
        applied_at = engine.wait_applied(version, WAIT_S)
        assert engine.client.endpoint_index == 1
        return applied_at - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default="bench/results/fleet_ops.md")
    args = parser.parse_args()
    cases: list[tuple[str, Cut | None]] = [
        ("kill -9 of the engine's replica", None),
        ("database sessions terminated, reconnections refused", "terminate"),
        ("database connection black-holed", "blackhole"),
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, how in cases:
            times = [one_run(how, Path(tmp), i) for i in range(args.runs)]
            print(label, " ".join(f"{t:.2f}" for t in times), flush=True)
            rows.append((label, times))
    load = os.getloadavg()[0]
    lines = [
        "# Fleet operations: failover",
        "",
        f"`.venv/bin/python -m bench.fleet_ops_bench --runs {args.runs}` "
        f"({datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"{os.cpu_count()} cores shared with other work, load {load:.1f} at the end; PostgreSQL "
        "on 127.0.0.1). Two real `output-rate serve` replicas on one PostgreSQL schema, a real "
        "push client with the default timeouts listing both (harness/applying_engine.py); "
        "fresh replicas each run. From the kill, or the cut of the engine's replica from "
        "PostgreSQL (through a TCP proxy only it uses, harness/tcp_proxy.py), to a write "
        "made through the other replica applied by the engine. Goal: 5 s. How it works: "
        'docs/replicas.md, "Failover".',
        "",
        "| case | runs (s) | median | max |",
        "|---|---|---|---|",
    ]
    for label, times in rows:
        shown = ", ".join(f"{t:.2f}" for t in times)
        lines.append(f"| {label} | {shown} | {statistics.median(times):.2f} | {max(times):.2f} |")
    lines += [
        "",
        "Before (fleet-leave branch: three silences, and the claim waited out "
        "`OUTPUT_RATE_ENGINE_TIMEOUT_S`): 10.5-11 s after kill -9 (docs/replicas.md); a replica "
        "that lost its database kept its engines until they heard nothing for 10.5 s.",
        "",
        "Kill -9: the engine leaves after 3.5 s of silence counted from the last frame it heard "
        "(a heartbeat, up to 1 s before the kill), and the other replica binds it at once (the "
        "dead home's row is then at least 2.5 s old). Database loss: the replica's watch "
        "finds no round trip for 1.5 s (a round trip every 0.5 s) and says Goodbye; the other "
        "replica's claim waits until the engine's row is 2.5 s old, asking every 0.25 s.",
        "",
    ]
    # The file's other sections (the rolling restart's, bench/rolling_restart_bench.py) stay.
    write_section("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
