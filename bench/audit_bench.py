"""The cost of a bulk change's audit rows, and a user's history among many bulk changes.

For SQLite and PostgreSQL, on a fresh database, in this process (the app behind
FastAPI's TestClient, so the numbers are the server's work without a socket): time
POST /limits:bulk with 10,000 users, every user changed each time (the audit entry and,
since migration 0008, its 10,000 audit_targets rows are written in the same
transaction), then, once every bulk is in, GET /audit?target=<user> (each bulk touched
the user) and GET /audit?limit=<runs> (the bulk entries themselves, truncated). Medians.

    .venv/bin/python -m bench.audit_bench                  # both databases, median of 7
    .venv/bin/python -m bench.audit_bench --db sqlite --runs 3

Compare code side by side by running it with another checkout first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from control_plane.app import create_app
from control_plane.settings import Settings
from harness.control_plane import fresh_database

TOKEN = "bench-admin-token"
NUM_BULK_USERS = 10_000


def timed(call: Callable[[], Any]) -> tuple[Any, float, float]:
    """call's result, its wall-clock ms and this process's CPU ms (SQLite runs in this
    process; PostgreSQL's own work is in its server process, not counted)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = call()
    return result, (time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000


def run(kind: str, runs: int) -> str:
    with tempfile.TemporaryDirectory() as tmp, fresh_database(kind, Path(tmp)) as url:
        settings = Settings(database_url=url, admin_token=TOKEN)  # type: ignore[arg-type]
        with TestClient(create_app(settings)) as client:
            client.headers["Authorization"] = f"Bearer {TOKEN}"
            bulk_wall, bulk_cpu = [], []
            for run_index in range(runs):
                items = [
                    {"user": f"bulk-{i:05d}", "output_tokens_per_second": run_index + 1}
                    for i in range(NUM_BULK_USERS)
                ]
                response, wall, cpu = timed(
                    partial(client.post, "/limits:bulk", json={"items": items})
                )
                assert response.json()["num_changed"] == NUM_BULK_USERS, response.text
                bulk_wall.append(wall)
                bulk_cpu.append(cpu)
            history, listing = [], []
            for i in range(runs):
                params: dict[str, str | int] = {"target": f"bulk-{i:05d}", "limit": 50}
                response, wall, _ = timed(partial(client.get, "/audit", params=params))
                assert response.status_code == 200, response.text
                history.append(wall)
                found = len(response.json()["items"])
                response, wall, _ = timed(partial(client.get, "/audit", params={"limit": runs}))
                listing.append(wall)
            client.app.state.control_plane.db.dispose()  # type: ignore[attr-defined]
    median = statistics.median
    return (
        f"| {kind} | {median(bulk_wall):.0f} | {median(bulk_cpu):.0f} | "
        f"{median(history):.1f} | {found} | {median(listing):.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    kinds = ["sqlite", "postgres"] if args.db == "both" else [args.db]
    print(
        f"| database | bulk of {NUM_BULK_USERS:,}: ms | its CPU ms in this process "
        "| GET /audit?target=<user> ms | entries found | GET /audit?limit=<runs> ms |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for kind in kinds:
        print(run(kind, args.runs), flush=True)


if __name__ == "__main__":
    main()
