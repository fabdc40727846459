"""Engine status rows (GET /engines) against a real `output-rate serve`: an engine that
reports usage as often as its client sends (five times a second) costs its row about one
write a second, and a version it applies is still written."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from control_plane.push.status import STATUS_REFRESH_S
from harness.control_plane import fresh_database, serve
from tests.control_plane.push.test_trust import RealEngine, engine_row, wait_for

BUSY_S = 3.0
ROWS = "output_rate_push_engine_status_rows_written"


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_chatty_engine_costs_its_row_one_write_a_second(kind: str, tmp_path: Path) -> None:
    with fresh_database(kind, tmp_path) as url, serve(url, tmp_path) as served:
        engine = RealEngine(served.zmq_endpoint, "chatty")
        try:
            with served.client() as api:
                wait_for(lambda: engine.client.wait_for_snapshot(0.1), "a snapshot")
                engine.step()
                first = wait_for(lambda: engine_row(api, "chatty"), "its row")
                before = served.metric(ROWS)
                started = time.monotonic()
                while time.monotonic() - started < BUSY_S:
                    engine.step()
                    engine.client.report_usage(granted={"u": 1}, throttled={})
                    time.sleep(0.02)
                elapsed = time.monotonic() - started
                written = served.metric(ROWS) - before
                # One rewrite per refresh period (and one more for a period cut by the
                # window's ends); a write per report would be about 5 a second.
                assert written <= elapsed / STATUS_REFRESH_S + 2, written
                now = engine_row(api, "chatty")
                assert now["last_seen"] > first["last_seen"]  # still rewritten
                version = api.put("/limits/u", json={"output_tokens_per_second": 7}).json()[
                    "version"
                ]
                wait_for(lambda: engine.step() == version, "the delta")
                row = wait_for(
                    lambda: (r := engine_row(api, "chatty")) and r["applied_version"] == version,
                    "the applied version in GET /engines",
                )
                assert row
        finally:
            engine.client.close()
