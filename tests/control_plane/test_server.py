"""The served control plane as a real process: durability and concurrent writers."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import httpx

from harness.control_plane import kill_hard, serve
from harness.servers import free_port
from tests.control_plane.factories import writers_lock_held

WRITERS = 50


def test_acknowledged_writes_survive_kill_9(db_url: str, tmp_path: Path) -> None:
    with serve(db_url, tmp_path) as served, served.client() as c:
        assert c.put("/tiers/gold", json={"output_tokens_per_second": 300}).status_code == 200
        assert c.put("/default-limit", json={"output_tokens_per_second": 9}).status_code == 200
        for i in range(20):
            body = {"output_tokens_per_second": i + 1, "tier": "gold" if i % 2 else None}
            assert c.put(f"/limits/user-{i}", json=body).status_code == 200
        items = [{"user": f"bulk-{i}", "tier": "gold"} for i in range(100)]
        assert c.post("/limits:bulk", json={"items": items}).status_code == 200
        before = c.get("/limits?limit=1000").json()
        version = c.get("/engines").json()["version"]
        kill_hard(served)
    with serve(db_url, tmp_path) as served, served.client() as c:
        assert c.get("/engines").json()["version"] == version == 23
        assert c.get("/limits?limit=1000").json() == before
        assert before["total"] == 120
        assert c.get("/tiers/gold").json()["num_users"] == 110
        assert c.get("/default-limit").json()["output_tokens_per_second"] == 9


def _put(url: str, headers: dict[str, str], user: str, rate: int) -> int:
    with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
        response = c.put(f"/limits/{user}", json={"output_tokens_per_second": rate})
        assert response.status_code == 200, response.text
        return int(response.json()["version"])


def test_concurrent_writers_get_unique_gap_free_versions(db_url: str, tmp_path: Path) -> None:
    with serve(db_url, tmp_path) as served, served.client() as c:
        headers = dict(c.headers)
        with ThreadPoolExecutor(max_workers=WRITERS) as pool:
            different = list(
                pool.map(lambda i: _put(served.url, headers, f"u{i}", i + 1), range(WRITERS))
            )
            same = list(
                pool.map(lambda i: _put(served.url, headers, "shared", i + 1), range(WRITERS))
            )
        # Every acknowledged write to a different user is its own version.
        assert sorted(different) == list(range(1, WRITERS + 1))
        # The same user: every PUT sets a new rate, so each is one effective change.
        assert sorted(same) == list(range(WRITERS + 1, 2 * WRITERS + 1))
        assert c.get("/engines").json()["version"] == 2 * WRITERS
        for i in range(WRITERS):
            view = c.get(f"/limits/u{i}").json()
            assert view["output_tokens_per_second"] == i + 1
        audit = c.get("/audit?limit=1000").json()["items"]
        assert sorted(e["version"] for e in audit) == list(range(1, 2 * WRITERS + 1))
        shared = [e for e in audit if e["target"] == "shared"]
        # The final record is the one of the highest version, and audit chains link up.
        last = max(shared, key=lambda e: e["version"])
        final = c.get("/limits/shared").json()["output_tokens_per_second"]
        assert last["after"]["output_tokens_per_second"] == final
        chain = sorted(shared, key=lambda e: e["version"])
        for prev, nxt in pairwise(chain):
            assert nxt["before"] == prev["after"]


def test_same_put_concurrently_is_one_change(db_url: str, tmp_path: Path) -> None:
    with serve(db_url, tmp_path) as served, served.client() as c:
        headers = dict(c.headers)
        with ThreadPoolExecutor(max_workers=WRITERS) as pool:
            versions = set(pool.map(lambda _: _put(served.url, headers, "x", 42), range(WRITERS)))
        assert versions == {1}
        assert len(c.get("/audit").json()["items"]) == 1


def test_serve_refuses_without_admin_token_and_warns_when_insecure(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "OUTPUT_RATE_DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}",
        "OUTPUT_RATE_ZMQ_ENDPOINT": f"tcp://127.0.0.1:{free_port()}",
    }
    env.pop("OUTPUT_RATE_ADMIN_TOKEN", None)
    cmd = [sys.executable, "-m", "control_plane.cli", "serve", "--port", str(free_port())]
    refused = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, timeout=60)
    assert refused.returncode == 2
    assert b"OUTPUT_RATE_ADMIN_TOKEN" in refused.stderr
    assert not (tmp_path / "x.db").exists()
    with serve(f"sqlite:///{tmp_path / 'y.db'}", tmp_path, extra_args=("--insecure-no-auth",)) as s:
        response = httpx.put(f"{s.url}/limits/a", json={"output_tokens_per_second": 1})
        assert response.status_code == 200
        assert "AUTHENTICATION IS DISABLED" in s.log.read_text()


def test_reads_go_on_while_another_writer_holds_the_lock(db_url: str, tmp_path: Path) -> None:
    """An operator's script (another process) holds the writers' lock: the served
    process keeps answering reads, and its PUT waits for the lock, then commits."""
    with serve(db_url, tmp_path) as served, served.client() as http:
        http.put("/limits/early", json={"output_tokens_per_second": 3}).raise_for_status()
        with writers_lock_held(db_url) as conn, ThreadPoolExecutor(1) as pool:
            put = pool.submit(http.put, "/limits/late", json={"output_tokens_per_second": 4})
            for _ in range(20):
                response = http.get("/limits/early")
                assert response.json()["effective_output_tokens_per_second"] == 3
                assert http.get("/limits?limit=5").json()["total"] == 1
            # Every read above answered while the PUT was still waiting.
            assert not put.done()
            conn.rollback()
            assert put.result(timeout=60).status_code == 200
        assert http.get("/limits/late").json()["effective_output_tokens_per_second"] == 4
        assert http.get("/default-limit").json()["version"] == 2
