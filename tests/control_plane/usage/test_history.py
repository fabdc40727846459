"""Usage history: rollups from reported usage, pruning with a fake clock, the endpoint
(SQLite and PostgreSQL), and rows kept across a restart of a real `output-rate serve`."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import zmq
from fastapi.testclient import TestClient
from pydantic import ValidationError

from control_plane.settings import Settings
from control_plane.usage.history import (
    FLUSH_CHUNK_ROWS,
    MAX_NEW_USERS_PER_ENGINE_PER_MINUTE,
    UsageRecorder,
)
from harness.control_plane import fresh_database, serve
from output_rate_core import protocol as p
from tests.control_plane.factories import FakeClock

T0 = 1_800_000_000.0  # a minute boundary (divisible by 60)


def recorder(client: TestClient, clock: FakeClock, retention_days: int = 7) -> UsageRecorder:
    db = client.app.state.control_plane.db  # type: ignore[attr-defined]
    return UsageRecorder(db, retention_days=retention_days, clock=clock)


def usage(granted: dict[str, int], throttled: dict[str, int] | None = None) -> p.Usage:
    return p.Usage("e1", 1.0, granted, throttled or {})


def rows(client: TestClient) -> list[tuple[str, int, int, int, int | None]]:
    from sqlalchemy import text

    db = client.app.state.control_plane.db  # type: ignore[attr-defined]
    with db.engine.connect() as conn:
        result = conn.execute(
            text(
                "SELECT user, minute, tokens, throttled, limit_rate FROM usage_minutes "
                "ORDER BY user, minute"
            )
            if conn.dialect.name == "sqlite"
            else text(
                'SELECT "user", minute, tokens, throttled, limit_rate FROM usage_minutes '
                'ORDER BY "user", minute'
            )
        )
        return [tuple(r) for r in result]  # type: ignore[misc]


def test_reports_are_summed_per_user_and_minute_with_the_limit(client: TestClient) -> None:
    client.put("/limits/alice", json={"output_tokens_per_second": 50})
    clock = FakeClock(T0 + 5)
    rec = recorder(client, clock)
    rec.add(usage({"alice": 40, "bob": 10}, {"alice": 3}))
    rec.add(p.Usage("e2", 1.0, {"alice": 20}, {}))  # a second engine
    rec.flush()
    clock.now = T0 + 30
    rec.add(usage({"alice": 5}))
    rec.flush()
    clock.now = T0 + 61
    rec.add(usage({"alice": 1}))
    rec.flush()
    assert rows(client) == [
        ("alice", int(T0), 65, 3, 50),
        ("alice", int(T0) + 60, 1, 0, 50),
        ("bob", int(T0), 10, 0, None),
    ]


def test_rows_older_than_the_retention_are_pruned(client: TestClient) -> None:
    clock = FakeClock(T0)
    rec = recorder(client, clock, retention_days=7)
    rec.add(usage({"old": 1}))
    rec.flush()
    clock.now = T0 + 6 * 86_400
    rec.add(usage({"recent": 1}))
    rec.flush()
    assert [r[0] for r in rows(client)] == ["old", "recent"]
    clock.now = T0 + 7 * 86_400 + 3600
    rec.flush()
    assert [r[0] for r in rows(client)] == ["recent"]
    clock.now = T0 + 14 * 86_400
    rec.flush()
    assert rows(client) == []


def test_the_endpoint_buckets_rates_gaps_and_limits(client: TestClient) -> None:
    # The endpoint's window ends at the real current minute: keep the test inside one.
    if 60 - time.time() % 60 < 10:
        time.sleep(60 - time.time() % 60 + 0.1)
    client.put("/limits/alice", json={"output_tokens_per_second": 50})
    now = time.time()
    minute = int(now) // 60 * 60
    clock = FakeClock(minute - 600 + 59)  # 10 minutes ago
    rec = recorder(client, clock)
    # Reports covering the whole minute (the rate is over the seconds reports cover).
    rec.add(p.Usage("e1", 59.0, {"alice": 600, "bob": 60}, {"alice": 200}))
    rec.flush()
    clock.now = minute - 300  # 5 minutes ago, a limit change
    client.put("/limits/alice", json={"output_tokens_per_second": 20})
    rec.refresh_limits()
    clock.now = minute - 300 + 59
    rec.add(p.Usage("e1", 59.0, {"alice": 1180}, {}))
    rec.flush()
    since = datetime.fromtimestamp(minute - 900, UTC).isoformat()
    body = client.get("/usage/history", params={"since": since, "step": 60}).json()
    assert body["step"] == 60
    assert body["retention_days"] == 7
    assert body["times"][0] == minute - 900
    assert len(body["times"]) == 16
    # Most throttled first.
    assert [i["user"] for i in body["items"]] == ["alice", "bob"]
    alice = body["items"][0]
    rates = alice["output_tokens_per_second"]
    assert rates[5] == round(600 / 59, 3)  # 600 tokens in the 59 s reported
    assert rates[10] == 20.0
    # Minutes with no report are gaps, not zeros.
    assert rates[4] is None and rates[6] is None and rates[15] is None
    assert alice["limit"][5] == 50 and alice["limit"][10] == 20
    assert alice["throttled_fraction"][5] == 0.25
    assert (alice["tokens"], alice["throttled"]) == (1780, 200)
    one = client.get("/usage/history", params={"since": since, "user": "bob"}).json()
    assert [i["user"] for i in one["items"]] == ["bob"]
    busiest = client.get(
        "/usage/history", params={"since": since, "order": "tokens", "top": 1}
    ).json()
    assert [i["user"] for i in busiest["items"]] == ["alice"]
    # Buckets of 5 minutes: the rate is over the minutes reported.
    five = client.get("/usage/history", params={"since": since, "step": 300}).json()
    assert five["items"][0]["output_tokens_per_second"][1] == round(600 / 59, 3)


def test_would_throttles_are_summed_per_minute_and_shown_per_bucket(client: TestClient) -> None:
    if 60 - time.time() % 60 < 10:  # keep the test inside one real minute
        time.sleep(60 - time.time() % 60 + 0.1)
    client.put("/limits/carol", json={"output_tokens_per_second": 10, "enforcement": "shadow"})
    minute = int(time.time()) // 60 * 60
    clock = FakeClock(minute - 120 + 1)  # 2 minutes ago
    rec = recorder(client, clock)
    rec.add(p.Usage("e1", 1.0, {"carol": 300}, {}, would_throttle={"carol": 200}))
    rec.add(p.Usage("e2", 1.0, {"carol": 100, "dan": 5}, {}, would_throttle={"carol": 100}))
    rec.flush()
    since = datetime.fromtimestamp(minute - 180, UTC).isoformat()
    body = client.get("/usage/history", params={"since": since, "order": "tokens"}).json()
    carol, dan = body["items"]
    assert (carol["user"], dan["user"]) == ("carol", "dan")
    assert carol["would_throttle_fraction"][1] == 0.75  # 300 of 400 request-steps
    assert carol["would_throttle_fraction"][0] is None  # a gap, not a zero
    assert carol["throttled_fraction"][1] == 0.0
    assert (carol["tokens"], carol["throttled"], carol["would_throttle"]) == (400, 0, 300)
    assert dan["would_throttle_fraction"][1] == 0.0 and dan["would_throttle"] == 0


def test_borrowed_tokens_are_summed_per_minute_and_shown_per_bucket(client: TestClient) -> None:
    if 60 - time.time() % 60 < 10:  # keep the test inside one real minute
        time.sleep(60 - time.time() % 60 + 0.1)
    limit = {"output_tokens_per_second": 20, "ceiling_output_tokens_per_second": 60}
    put = client.put("/limits/erin", json=limit)
    assert put.status_code == 200
    minute = int(time.time()) // 60 * 60
    clock = FakeClock(minute - 120 + 1)  # 2 minutes ago
    rec = recorder(client, clock)
    # Two engines over the same second: 60 tokens, 36 of them lent beyond the rate.
    rec.add(p.Usage("e1", 1.0, {"erin": 50, "finn": 5}, {}, borrowed={"erin": 30}))
    rec.add(p.Usage("e2", 1.0, {"erin": 10}, {"erin": 2}, borrowed={"erin": 6}))
    rec.flush()
    since = datetime.fromtimestamp(minute - 180, UTC).isoformat()
    body = client.get("/usage/history", params={"since": since, "order": "tokens"}).json()
    erin, finn = body["items"]
    assert (erin["user"], finn["user"]) == ("erin", "finn")
    assert erin["output_tokens_per_second"][1] == 60.0
    assert erin["borrowed_output_tokens_per_second"][1] == 36.0
    assert erin["borrowed_output_tokens_per_second"][0] is None  # a gap, not a zero
    assert (erin["tokens"], erin["borrowed"]) == (60, 36)
    assert finn["borrowed_output_tokens_per_second"][1] == 0.0 and finn["borrowed"] == 0


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"step": 90}, "step"),
        ({"step": 0}, "step"),
        ({"step": 60, "since": "2000-01-01T00:00:00Z"}, "step"),
        ({"since": "2999-01-01T00:00:00Z"}, "since"),
        ({"since": "yesterday"}, "since"),
        ({"top": 0}, "top"),
        ({"order": "random"}, "order"),
        ({"user": ""}, "user"),
    ],
)
def test_bad_history_queries_name_the_field(
    client: TestClient, params: dict[str, object], field: str
) -> None:
    response = client.get("/usage/history", params=params)
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field


def test_retention_setting_is_validated() -> None:
    assert Settings(usage_retention_days=30).usage_retention_days == 30
    with pytest.raises(ValidationError, match="usage_retention_days"):
        Settings(usage_retention_days=0)
    with pytest.raises(ValidationError, match="usage_retention_days"):
        Settings(usage_retention_days="week")  # type: ignore[arg-type]


def test_history_from_a_real_peer_survives_a_restart(tmp_path: Path) -> None:
    with fresh_database("sqlite", tmp_path) as url:
        with serve(url, tmp_path) as served:
            endpoint = _zmq_endpoint(served.log)
            context = zmq.Context()
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            try:
                sock.send(p.encode(p.Hello("hist-engine", "tiny", 0)))
                assert sock.poll(10_000)
                sock.recv()
                for _ in range(3):
                    sock.send(p.encode(p.Usage("hist-engine", 1.0, {"carol": 30}, {"carol": 2})))
                    time.sleep(0.2)
                # Received (/usage shows it); stopping the server writes the history at once.
                with served.client() as http:
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline:
                        if http.get("/usage").json()["items"]:
                            break
                        time.sleep(0.1)
            finally:
                sock.close()
                context.term()
        with serve(url, tmp_path) as served, served.client() as http:
            body = http.get("/usage/history", params={"user": "carol"}).json()
            series = body["items"][0]
            assert (series["tokens"], series["throttled"]) == (90, 6)
            assert any(r is not None for r in series["output_tokens_per_second"])


def _zmq_endpoint(log: Path) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if "push:" in line and "tcp://" in line:
                return line.split("push:", 1)[1].strip().split(",")[0]
        time.sleep(0.1)
    raise AssertionError(f"no push endpoint in {log}")


def refused(rec: UsageRecorder) -> dict[str, int]:
    return {reason: n for reason, n in rec.refused.counts().items() if n}


def fresh_users(prefix: str, n: int) -> dict[str, int]:
    return {f"{prefix}-{i:05d}": 1 for i in range(n)}


def test_one_engine_brings_a_bounded_number_of_new_users_a_minute(client: TestClient) -> None:
    # Before: every user of every report became a row (40 reports of 20,000 fresh users
    # wrote 100,000 rows in 7 s).
    clock = FakeClock(T0 + 1)
    rec = recorder(client, clock)
    users = fresh_users("u", MAX_NEW_USERS_PER_ENGINE_PER_MINUTE + 500)
    rec.add(usage(users))
    rec.add(usage(fresh_users("v", 300)))  # the same engine, the same minute: none
    rec.add(p.Usage("e2", 1.0, fresh_users("w", 300), {}))  # another engine: its own
    rec.flush()
    first = [r for r in rows(client) if r[1] == int(T0)]
    assert len(first) == MAX_NEW_USERS_PER_ENGINE_PER_MINUTE + 300
    assert refused(rec) == {"history_engine_users": 500 + 300}
    # Users with a row the minute before are not new: a steady population larger than
    # the bound keeps its history.
    clock.now = T0 + 61
    rec.add(usage(users))
    rec.flush()
    second = [r for r in rows(client) if r[1] == int(T0) + 60]
    assert len(second) == MAX_NEW_USERS_PER_ENGINE_PER_MINUTE + 500
    # A user with a row this minute always counts, whatever the bounds.
    rec.add(usage({"u-00000": 5}))
    rec.flush()
    assert ("u-00000", int(T0) + 60, 6, 0, None) in rows(client)


def test_the_history_keeps_at_most_the_configured_users_a_minute(client: TestClient) -> None:
    db = client.app.state.control_plane.db  # type: ignore[attr-defined]
    clock = FakeClock(T0 + 1)
    rec = UsageRecorder(db, retention_days=7, max_users_per_minute=250, clock=clock)
    for engine in range(3):
        rec.add(p.Usage(f"e{engine}", 1.0, fresh_users(f"e{engine}", 100), {"x": 1}))
    rec.flush()
    assert len(rows(client)) == 250
    assert refused(rec) == {"history_users": 51}  # 300 users and "x", 250 kept
    clock.now = T0 + 61
    rec.add(p.Usage("e0", 1.0, fresh_users("e0", 100), {}))
    rec.flush()
    assert len([r for r in rows(client) if r[1] == int(T0) + 60]) == 100


def test_a_large_flush_is_written_in_small_transactions(client: TestClient) -> None:
    from sqlalchemy import event

    db = client.app.state.control_plane.db  # type: ignore[attr-defined]
    # What each transaction wrote into usage_minutes (read at the driver seam).
    per_transaction = [0]

    def before_execute(conn, cursor, statement, parameters, context, executemany) -> None:
        if "usage_minutes" in statement and statement.lstrip().upper().startswith("INSERT"):
            per_transaction[-1] += len(parameters) if executemany else 1

    def commit(conn) -> None:
        per_transaction.append(0)

    event.listen(db.engine, "before_cursor_execute", before_execute)
    event.listen(db.engine, "commit", commit)
    clock = FakeClock(T0 + 1)
    rec = UsageRecorder(db, retention_days=7, max_users_per_minute=5000, clock=clock)
    for engine in range(3):
        rec.add(p.Usage(f"e{engine}", 1.0, fresh_users(f"e{engine}", 1000), {}))
    rec.flush()
    event.remove(db.engine, "before_cursor_execute", before_execute)
    event.remove(db.engine, "commit", commit)
    written = [n for n in per_transaction if n]
    assert sum(written) == 3000 == len(rows(client))
    assert max(written) <= FLUSH_CHUNK_ROWS and len(written) == 3000 // FLUSH_CHUNK_ROWS


def test_history_bound_setting_is_validated() -> None:
    assert Settings().usage_history_max_users_per_minute == 5000
    assert Settings(usage_history_max_users_per_minute=20_000).usage_history_max_users_per_minute
    for bad in (0, -5, 100_001, "many", 2.5):
        with pytest.raises(ValidationError, match="usage_history_max_users_per_minute"):
            Settings(usage_history_max_users_per_minute=bad)  # type: ignore[arg-type]
