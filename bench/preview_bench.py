"""Bulk import preview: POST /limits:bulk?dry_run=true with a CSV body, against a real
`output-rate serve` subprocess on SQLite and on PostgreSQL.

Seeded per database: 4 tiers, 5,000 configured users (a fifth with an override), and an
hour of usage history for all of them (60 minutes x 5,000 users = 300,000 usage_minutes
rows). The CSV has a header and quoted fields; its lines are the 5,000 existing users
(moved to another tier, overrides dropped) and new ones, cut to 1,000 or 10,000 lines.
Each preview is timed from the request to the whole response; the apply (the same body
without dry_run, alternating between two bodies so that every apply changes every line)
is timed for comparison.

    .venv/bin/python -m bench.preview_bench              # writes bench/results/preview.md
    .venv/bin/python -m bench.preview_bench --reps 5 --out -
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
from sqlalchemy import create_engine

from bench.report import pct, write_report
from control_plane.usage.repository import UsageRow, add_usage
from harness.control_plane import ADMIN_TOKEN, fresh_database
from harness.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
NUM_USERS = 5_000
TIERS = {"free": 20, "basic": 50, "pro": 200, "max": 1000}
SIZES = (1_000, 10_000)


def csv_body(num_lines: int, tier: str) -> str:
    lines = ["user,tier,output_tokens_per_second,scope,enforcement"]
    for i in range(num_lines):
        user = f"acme-{i:05d}"
        # Every other id quoted, every tenth with an override: real CSV, not split(",").
        shown = f'"{user}"' if i % 2 else user
        rate = "75" if i % 10 == 0 else ""
        lines.append(f"{shown},{tier},{rate},,")
    return "\n".join(lines) + "\n"


def seed(http: httpx.Client, db_url: str) -> None:
    for name, rate in TIERS.items():
        http.put(f"/tiers/{name}", json={"output_tokens_per_second": rate}).raise_for_status()
    names = list(TIERS)
    items = [
        {
            "user": f"acme-{i:05d}",
            "tier": names[i % len(names)],
            "output_tokens_per_second": 500 if i % 5 == 0 else None,
        }
        for i in range(NUM_USERS)
    ]
    http.post("/limits:bulk", json={"items": items}).raise_for_status()
    now_minute = int(time.time()) // 60 * 60
    rows = [
        UsageRow(f"acme-{i:05d}", now_minute - 60 * m, (i * 7 + m * 13) % 6000, 0, None)
        for i in range(NUM_USERS)
        for m in range(60)
    ]
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            for start in range(0, len(rows), 20_000):
                add_usage(conn, rows[start : start + 20_000])
    finally:
        engine.dispose()


def serve(stack: ExitStack, db_url: str, workdir: Path) -> httpx.Client:
    port = free_port()
    env = {
        **os.environ,
        "OUTPUT_RATE_DATABASE_URL": db_url,
        "OUTPUT_RATE_ADMIN_TOKEN": ADMIN_TOKEN,
        "OUTPUT_RATE_ZMQ_ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
    }
    log = stack.enter_context((workdir / "serve.log").open("wb"))
    process = subprocess.Popen(
        [sys.executable, "-m", "control_plane.cli", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def stop() -> None:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)

    stack.callback(stop)
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=120,
    )
    stack.callback(http.close)
    deadline = time.monotonic() + 60
    while True:
        try:
            if http.get("/healthz").status_code == 200:
                return http
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError(f"serve did not start; see {workdir / 'serve.log'}")
        time.sleep(0.1)


def timed(http: httpx.Client, path: str, body: str) -> tuple[float, dict[str, object]]:
    start = time.perf_counter()
    response = http.post(path, content=body, headers={"Content-Type": "text/csv"})
    elapsed = (time.perf_counter() - start) * 1000
    response.raise_for_status()
    return elapsed, response.json()


def run(kind: str, reps: int) -> tuple[list[tuple[str, int, list[float], str]], str]:
    """(what, lines, ms per call, a note) rows, and the machine's load while they ran."""
    rows: list[tuple[str, int, list[float], str]] = []
    load_before = os.getloadavg()[0]
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="preview-")))
        db_url = stack.enter_context(fresh_database(kind, workdir))
        http = serve(stack, db_url, workdir)
        seed(http, db_url)
        for size in SIZES:
            body = csv_body(size, "basic")
            timed(http, "/limits:bulk?dry_run=true", body)  # warm-up
            times, preview = [], {}
            for _ in range(reps):
                ms, preview = timed(http, "/limits:bulk?dry_run=true", body)
                times.append(ms)
            note = (
                f"down {preview['num_down']}, up {preview['num_up']}, same "
                f"{preview['num_same']}, new {preview['num_created']}, overrides dropped "
                f"{preview['num_overrides_dropped']}, over the new limit "
                f"{preview['num_over_new_limit']}"
            )
            rows.append(("preview (dry_run)", size, times, note))
            applies = []
            for rep in range(max(3, reps // 2)):
                ms, result = timed(http, "/limits:bulk", csv_body(size, ("pro", "basic")[rep % 2]))
                applies.append(ms)
            rows.append(("apply", size, applies, f"{result['num_changed']} changed per apply"))
    return rows, f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}"


def report(
    results: dict[str, tuple[list[tuple[str, int, list[float], str]], str]], reps: int
) -> str:
    lines = [
        "# Bulk import preview (CSV, dry_run)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; control plane = `output-rate serve` subprocess; "
        f"{NUM_USERS:,} configured users in {len(TIERS)} tiers and 60 minutes of usage "
        f"history for each ({NUM_USERS * 60:,} usage_minutes rows). Times are from the "
        "request to the whole response (httpx, one call at a time).",
        "",
        f"Reproduce: `.venv/bin/python -m bench.preview_bench` (default `--reps {reps}`)",
        "",
        "| database | call | CSV lines | calls | p50 | p99 | max | goal | figures |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, (rows, _) in results.items():
        for what, size, times, note in rows:
            goal = "< 2 s" if what.startswith("preview") and size == 10_000 else ""
            lines.append(
                f"| {kind} | {what} | {size:,} | {len(times)} | {pct(times, 50):.0f} ms "
                f"| {pct(times, 99):.0f} ms | {max(times):.0f} ms | {goal} | {note} |"
            )
    loads = ", ".join(f"{kind} {load}" for kind, (_, load) in results.items())
    lines += [
        "",
        f"1-minute load average at the start and the end of each database's run: {loads} "
        f"(on {os.cpu_count()} CPUs: other work shared the machine; the ratios to the apply "
        "measured beside each preview are steadier than the absolute times).",
        "",
        "Notes: a preview runs one read each of the config state, the tiers, the records "
        "of the listed users and the last hour of their usage history (no per-user query), "
        "then compares in Python; the response lists every user (10,000 items, about "
        "4 MB of JSON at 10,000 lines). The apply writes one version (change log, audit "
        "entry with every user's before/after, the records). Both processes share this "
        "machine's CPUs with whatever else runs on it.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "preview.md"))
    parser.add_argument("--databases", default="sqlite,postgres")
    args = parser.parse_args()
    results = {kind: run(kind, args.reps) for kind in args.databases.split(",")}
    text = report(results, args.reps)
    write_report(text, args.out)


if __name__ == "__main__":
    main()
