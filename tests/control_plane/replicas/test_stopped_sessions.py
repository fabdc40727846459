"""A replica stopped (SIGSTOP, a frozen VM) inside a transaction holds its row locks only
STOPPED_SESSION_TIMEOUT_S: PostgreSQL ends its session, so another replica's claim of an
engine row does not wait on it for ever (real PostgreSQL; the stop is a connection left
idle inside its transaction, which is what the server sees of a stopped process)."""

from __future__ import annotations

import time
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from control_plane.db import make_engine
from control_plane.replicas.lease import (
    STOPPED_SESSION_TIMEOUT_S,
    release_locks_of_stopped_replicas,
)
from harness.control_plane import fresh_database


def test_a_stopped_replicas_row_lock_is_released_after_the_timeout(tmp_path: Path) -> None:
    with fresh_database("postgres", tmp_path) as url:
        stopped, other = make_engine(url), make_engine(url)
        release_locks_of_stopped_replicas(stopped)
        try:
            with other.begin() as conn:
                conn.execute(
                    text(
                        "INSERT INTO engines (engine_id, model, applied_version, connected,"
                        " first_seen, last_seen) VALUES ('e1', '', 0, true, now(), now())"
                    )
                )
            frozen = stopped.connect()
            frozen.begin()
            lock = text("SELECT 1 FROM engines WHERE engine_id = 'e1' FOR UPDATE")
            frozen.execute(lock)
            # ... and nothing more from it. A session without the timeout waits on it:
            with other.connect() as conn:
                started = time.monotonic()
                try:
                    with conn.begin():
                        conn.execute(text("SET LOCAL lock_timeout = 500"))
                        conn.execute(lock)
                    raise AssertionError("the row was not locked")
                except OperationalError as e:
                    assert "lock timeout" in str(e)
                with conn.begin():  # waits until the server ends the frozen session
                    conn.execute(lock)
                waited = time.monotonic() - started
            assert waited <= STOPPED_SESSION_TIMEOUT_S + 3.0
            frozen.invalidate()
        finally:
            stopped.dispose()
            other.dispose()
