"""A fleet of engines on different vLLM releases: one real `output-rate serve` (SQLite:
engines bound at once; PostgreSQL: bound once the database's claim answers) and two real
push clients feeding limiters (harness/applying_engine.py), announcing vLLM 0.32.0 and
0.34.0. Both get the snapshot and every change alike, and GET /engines names the
release of each."""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from harness.applying_engine import ApplyingEngine
from harness.control_plane import fresh_database, serve

WAIT_S = 30.0
RELEASES = {"on-0.32": "0.32.0", "on-0.34": "0.34.0"}


def wait_for(predicate: Any, what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while not (found := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return found


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_engines_of_two_vllm_releases_share_one_control_plane(kind: str, tmp_path: Path) -> None:
    with (
        fresh_database(kind, tmp_path) as url,
        serve(url, tmp_path) as served,
        served.client() as api,
        ExitStack() as stack,
    ):
        body = {"output_tokens_per_second": 40, "scope": "engine"}
        before = api.put("/limits/alice", json=body).json()["version"]
        # Each gets its snapshot on entering.
        engines = [
            stack.enter_context(ApplyingEngine(name, [served.zmq_endpoint], vllm_version=release))
            for name, release in RELEASES.items()
        ]
        for engine in engines:
            engine.wait_applied(before)
            assert engine.limiter.user_rates() == {"alice": 40}, engine.name

        body["output_tokens_per_second"] = 9
        after = api.put("/limits/alice", json=body).json()["version"]
        for engine in engines:
            engine.wait_applied(after)
            assert engine.limiter.user_rates() == {"alice": 9}, engine.name

        def listed() -> dict[str, tuple[str | None, int, bool]] | None:
            rows = {
                e["engine_id"]: (e["vllm_version"], e["applied_version"], e["connected"])
                for e in api.get("/engines").json()["items"]
            }
            done = len(rows) == 2 and all(applied == after for _, applied, _ in rows.values())
            return rows if done else None

        assert wait_for(listed, "both engines' rows at the new version") == {
            "on-0.32": ("0.32.0", after, True),
            "on-0.34": ("0.34.0", after, True),
        }
