"""The cost of a bulk change's audit rows, and a user's history among many bulk changes.

For SQLite and PostgreSQL, on a fresh database, in this process (the app behind
FastAPI's TestClient, so the numbers are the server's work without a socket): time
POST /limits:bulk with 10,000 users, every user changed each time (the audit entry and,
since migration 0008, its 10,000 audit_targets rows are written in the same
transaction), then GET /audit?target=<user> once every bulk is in.

    .venv/bin/python -m bench.audit_bench                  # both databases, median of 7
    .venv/bin/python -m bench.audit_bench --db sqlite --runs 3

Compare code side by side by running it with another checkout first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from fastapi.testclient import TestClient

from bench.api_bench import database
from control_plane.app import create_app
from control_plane.cli import upgrade
from control_plane.settings import Settings

TOKEN = "bench-admin-token"
NUM_BULK_USERS = 10_000


def run(kind: str, runs: int) -> str:
    with tempfile.TemporaryDirectory() as tmp, database(kind, Path(tmp)) as url:
        upgrade(url)
        settings = Settings(database_url=url, admin_token=TOKEN)  # type: ignore[arg-type]
        with TestClient(create_app(settings)) as client:
            client.headers["Authorization"] = f"Bearer {TOKEN}"
            bulk_ms = []
            for run_index in range(runs):
                items = [
                    {"user": f"bulk-{i:05d}", "output_tokens_per_second": run_index + 1}
                    for i in range(NUM_BULK_USERS)
                ]
                start = time.perf_counter()
                response = client.post("/limits:bulk", json={"items": items})
                bulk_ms.append((time.perf_counter() - start) * 1000)
                assert response.json()["num_changed"] == NUM_BULK_USERS, response.text
            history_ms = []
            for i in range(runs):
                start = time.perf_counter()
                response = client.get("/audit", params={"target": f"bulk-{i:05d}", "limit": 50})
                history_ms.append((time.perf_counter() - start) * 1000)
                assert response.status_code == 200, response.text
            num_found = len(response.json()["items"])
            client.app.state.control_plane.db.dispose()  # type: ignore[attr-defined]
    return (
        f"| {kind} | {statistics.median(bulk_ms):.0f} | {min(bulk_ms):.0f} | "
        f"{max(bulk_ms):.0f} | {statistics.median(history_ms):.1f} | {num_found} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    kinds = ["sqlite", "postgres"] if args.db == "both" else [args.db]
    print(
        f"| database | bulk of {NUM_BULK_USERS:,} ms (median) | min | max "
        f"| GET /audit?target= ms (median) | entries found |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for kind in kinds:
        print(run(kind, args.runs), flush=True)


if __name__ == "__main__":
    main()
