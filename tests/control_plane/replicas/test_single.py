"""SQLite is single-replica; readiness reports the database."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from control_plane.app import create_app
from control_plane.db import Database, make_engine
from harness.control_plane import ADMIN_TOKEN, empty_database, fresh_database, serve
from harness.servers import free_port
from tests.control_plane.factories import make_settings


def test_a_second_serve_on_one_sqlite_file_is_refused_clearly(tmp_path: Path) -> None:
    with fresh_database("sqlite", tmp_path) as url, serve(url, tmp_path) as first:
        second = subprocess.run(
            [sys.executable, "-m", "control_plane.cli", "serve", "--port", str(free_port())],
            env={**first_env(url), "OUTPUT_RATE_ZMQ_ENDPOINT": f"tcp://127.0.0.1:{free_port()}"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2
        assert "SQLite is single-replica" in second.stderr
        assert f"pid {first.process.pid}" in second.stderr
        # The first one is untouched.
        with first.client() as http:
            assert http.get("/readyz").status_code == 200
    # Once the first is gone (its lock with it), a new one starts on the same file.
    with serve(url, tmp_path) as again, again.client() as http:
        assert http.get("/readyz").json()["status"] == "ready"


def first_env(url: str) -> dict[str, str]:
    return {**os.environ, "OUTPUT_RATE_DATABASE_URL": url, "OUTPUT_RATE_ADMIN_TOKEN": ADMIN_TOKEN}


def test_readiness_is_503_when_the_database_is_unreachable() -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test?connect_timeout=1"
    db = Database(make_engine(url))
    with TestClient(create_app(make_settings(url), db=db)) as client:
        response = client.get("/readyz")
        assert response.status_code == 503
        assert response.json() == {
            "status": "unready",
            "database": "unreachable",
            "replica": None,
            "leader": None,
        }
        assert client.get("/healthz").status_code == 200
    db.dispose()


def test_replicas_starting_at_once_migrate_one_after_the_other(tmp_path: Path) -> None:
    """Three `output-rate db upgrade` at once on an empty schema: all succeed, head once."""
    with empty_database("postgres", tmp_path) as url:
        env = {**os.environ, "OUTPUT_RATE_DATABASE_URL": url}
        upgrades = [
            subprocess.Popen(
                [sys.executable, "-m", "control_plane.cli", "db", "upgrade"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(3)
        ]
        outputs = [u.communicate(timeout=120)[0] for u in upgrades]
        assert [u.returncode for u in upgrades] == [0, 0, 0], outputs
        engine = create_engine(url)
        with engine.connect() as conn:
            versions = conn.execute(text("SELECT version_num FROM alembic_version")).all()
        engine.dispose()
        assert len(versions) == 1
