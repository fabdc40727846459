"""The limit in force per part of a history bucket: real Usage reports through the
recorder's public `add`, with a fake clock (the one seam: it stands for the control
plane's clock so reports can be placed within a minute), real limit changes through the
API, the real endpoint, on SQLite and PostgreSQL; and migration 0010 up and down."""

from __future__ import annotations

import importlib.util
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from control_plane.cli import downgrade, upgrade
from control_plane.usage.history import LIMITS_REFRESH_S, UsageRecorder
from output_rate_core import protocol as p
from tests.control_plane.factories import FakeClock

MIGRATION = Path(__file__).parents[3] / "migrations/versions/0010_usage_limit_weight.py"


def recorder(client: TestClient, clock: FakeClock) -> UsageRecorder:
    db = client.app.state.control_plane.db  # type: ignore[attr-defined]
    return UsageRecorder(db, retention_days=7, clock=clock)


def past_minute(minutes_ago: int) -> int:
    """A minute start that far before the real current minute (the endpoint's window
    ends at the real now); waits out a minute boundary that is too close."""
    if 60 - time.time() % 60 < 10:
        time.sleep(60 - time.time() % 60 + 0.1)
    return int(time.time()) // 60 * 60 - minutes_ago * 60


def history(client: TestClient, since: int, **params: Any) -> dict[str, Any]:
    iso = datetime.fromtimestamp(since, UTC).isoformat()
    response = client.get("/usage/history", params={"since": iso, **params})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def series(body: dict[str, Any], user: str) -> dict[str, Any]:
    (item,) = [i for i in body["items"] if i["user"] == user]
    return item


def test_a_limit_change_mid_minute_gives_the_time_weighted_limit(client: TestClient) -> None:
    client.put("/limits/held", json={"output_tokens_per_second": 100})
    minute = past_minute(5)
    clock = FakeClock(minute)
    rec = recorder(client, clock)
    rec.refresh_limits()
    # Held at 100 tok/s for 30 s, the limit drops to 45 at +30.5 s (the engine applies
    # it at its next step), then held at 45: the report at +31 s straddles the change.
    for second in range(1, 31):
        clock.now = minute + second
        rec.add(p.Usage("e1", 1.0, {"held": 100}, {"held": 3}))
    clock.now = minute + 30.5
    client.put("/limits/held", json={"output_tokens_per_second": 45})
    rec.refresh_limits()
    clock.now = minute + 31
    rec.add(p.Usage("e1", 1.0, {"held": 72}, {"held": 5}))  # 50 + 22.5 tokens
    for second in range(32, 60):
        clock.now = minute + second
        rec.add(p.Usage("e1", 1.0, {"held": 45}, {"held": 5}))
    rec.flush()
    held = series(history(client, minute, user="held"), "held")
    assert held["limit"][0] == round((100 * 30.5 + 45 * 28.5) / 59, 3)
    # At the limit throughout: 100 %, not 4,332 tokens over a new 45 tok/s (163 %).
    assert held["share_of_limit"][0] == round((3000 + 72 + 45 * 28) / (100 * 30.5 + 45 * 28.5), 4)
    assert held["share_of_limit"][0] <= 1.0
    assert held["limited_fraction"][0] == 1.0
    assert held["output_tokens_per_second"][0] == round((3000 + 72 + 45 * 28) / 59, 3)


def test_two_engines_do_not_double_a_fleet_limit(client: TestClient) -> None:
    client.put("/limits/fleet-user", json={"output_tokens_per_second": 100})
    minute = past_minute(4)
    clock = FakeClock(minute)
    rec = recorder(client, clock)
    # Two engines share the fleet rate, reporting the same seconds half a second apart.
    for second in range(1, 60):
        clock.now = minute + second
        rec.add(p.Usage("e1", 1.0, {"fleet-user": 50}, {}))
        clock.now = minute + second + 0.5
        rec.add(p.Usage("e2", 1.0, {"fleet-user": 50}, {}))
    rec.flush()
    user = series(history(client, minute, user="fleet-user"), "fleet-user")
    assert user["limit"][0] == 100.0  # not 200
    # 5,900 tokens in the 59.5 s the two engines' reports covered together.
    assert user["share_of_limit"][0] == round(5900 / (100 * 59.5), 4)
    assert user["output_tokens_per_second"][0] == round(5900 / 59.5, 3)


def test_an_engine_limit_applies_per_engine(client: TestClient) -> None:
    client.put("/limits/per-engine", json={"output_tokens_per_second": 100, "scope": "engine"})
    minute = past_minute(3)
    clock = FakeClock(minute)
    rec = recorder(client, clock)
    # Each engine enforces the whole rate; the second serves the user half the minute.
    for second in range(1, 60):
        clock.now = minute + second
        rec.add(p.Usage("e1", 1.0, {"per-engine": 100}, {}))
        if second > 30:
            rec.add(p.Usage("e2", 1.0, {"per-engine": 100}, {}))
    rec.flush()
    user = series(history(client, minute, user="per-engine"), "per-engine")
    # 100 x 59 s + 100 x 29 s over the 59 s covered: the sum of both engines' limits.
    assert user["limit"][0] == round(100 * (59 + 29) / 59, 3)
    assert user["share_of_limit"][0] == 1.0
    assert user["output_tokens_per_second"][0] == user["limit"][0]


def test_a_bucket_partly_unlimited_says_so(client: TestClient) -> None:
    minute = past_minute(2)
    clock = FakeClock(minute)
    rec = recorder(client, clock)
    for second in range(1, 21):  # unlimited (the default) for 20 s, at 500 tok/s
        clock.now = minute + second
        rec.add(p.Usage("e1", 1.0, {"later": 500}, {}))
    client.put("/limits/later", json={"output_tokens_per_second": 40})
    rec.refresh_limits()
    for second in range(21, 60):  # then held at 40 tok/s
        clock.now = minute + second
        rec.add(p.Usage("e1", 1.0, {"later": 40}, {}))
    rec.flush()
    later = series(history(client, minute, user="later"), "later")
    assert later["limited_fraction"][0] == round(39 / 59, 4)
    assert later["limit"][0] == 40.0
    # The share is of the limited part only: at the limit, not 10,000 + 1,600 tokens
    # over 40 tok/s.
    assert later["share_of_limit"][0] == 1.0
    unlimited = series(history(client, minute - 60, user="nobody"), "nobody")
    assert set(unlimited["limit"]) == {None}  # nothing reported: no limit either


def test_the_current_minute_is_not_a_dip_and_the_fleet_total_sums_users(
    client: TestClient,
) -> None:
    client.put("/limits/steady", json={"output_tokens_per_second": 100})
    minute = past_minute(0)
    clock = FakeClock(minute - 60)
    rec = recorder(client, clock)
    # Steady at 96 tok/s through the last minute and the first 8 s of this one.
    for second in range(1, 69):
        clock.now = minute - 60 + second
        rec.add(p.Usage("e1", 1.0, {"steady": 96, "other": 10}, {}))
    rec.flush()
    body = history(client, minute - 60, order="tokens")
    steady = series(body, "steady")
    assert steady["output_tokens_per_second"][-2:] == [96.0, 96.0]
    assert steady["share_of_limit"][-2:] == [0.96, 0.96]
    assert body["fleet"]["output_tokens_per_second"][-2:] == [106.0, 106.0]
    assert body["fleet"]["tokens"] == 68 * 106


def test_a_change_of_the_default_reaches_every_user_reported_lately(client: TestClient) -> None:
    client.put("/default-limit", json={"output_tokens_per_second": 10})
    minute = past_minute(6)
    clock = FakeClock(minute)
    rec = recorder(client, clock)
    for second in range(1, 31):
        clock.now = minute + second
        rec.add(p.Usage("e1", 1.0, {"a": 10, "b": 10}, {}))
    client.put("/default-limit", json={"output_tokens_per_second": 20})
    rec.refresh_limits()
    for second in range(31, 60):
        clock.now = minute + second
        rec.add(p.Usage("e1", 1.0, {"a": 20, "b": 20}, {}))
    rec.flush()
    body = history(client, minute, order="tokens")
    for name in ("a", "b"):
        assert series(body, name)["limit"][0] == round((10 * 30 + 20 * 29) / 59, 3)
        assert series(body, name)["share_of_limit"][0] == 1.0


def test_the_seven_day_range_is_bounded(client: TestClient) -> None:
    since = int(time.time()) - 7 * 86_400
    body = history(client, since, step=600)
    assert len(body["times"]) <= 1441
    assert len(body["fleet"]["output_tokens_per_second"]) == len(body["times"])


def _before_0010() -> str:
    spec = importlib.util.spec_from_file_location("m0010", MIGRATION)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.down_revision)


def test_0010_weighs_existing_rows_as_whole_minutes_and_downgrades(db_url: str) -> None:
    downgrade(db_url, _before_0010())
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    'INSERT INTO usage_minutes ("user", minute, tokens, throttled, limit_rate, '
                    "would_throttle) VALUES ('held', 600, 3000, 2, 50, 0), "
                    "('free', 600, 90, 0, NULL, 0)"
                )
            )
        upgrade(db_url)
        with engine.connect() as conn:
            got = conn.execute(
                text(
                    'SELECT "user", reported_seconds, limited_seconds, limit_weight, '
                    'limited_tokens FROM usage_minutes ORDER BY "user"'
                )
            ).all()
        assert [tuple(r) for r in got] == [
            ("free", 60.0, 0.0, 0.0, 0.0),
            ("held", 60.0, 60.0, 3000.0, 3000.0),
        ]
        downgrade(db_url, _before_0010())
        with engine.connect() as conn:
            columns = conn.execute(text("SELECT * FROM usage_minutes")).keys()
            assert "limit_weight" not in columns
            assert conn.execute(text("SELECT count(*) FROM usage_minutes")).scalar() == 2
        upgrade(db_url)
    finally:
        engine.dispose()


def test_the_running_recorder_follows_a_committed_change(client: TestClient) -> None:
    client.put("/limits/live", json={"output_tokens_per_second": 100})
    minute = past_minute(7)
    clock = FakeClock(minute + 10)
    rec = recorder(client, clock)
    rec.add(p.Usage("e1", 10.0, {"live": 1000}, {}))  # held at 100 for 10 s
    rec.start()
    try:
        clock.now = minute + 20
        client.put("/limits/live", json={"output_tokens_per_second": 50})
        # Its thread refreshes the limit model on the commit (and every second anyway).
        time.sleep(3 * LIMITS_REFRESH_S)
        clock.now = minute + 30
        rec.add(p.Usage("e1", 10.0, {"live": 500}, {}))  # held at 50 from the change
    finally:
        rec.close()  # flushes
    live = series(history(client, minute, user="live"), "live")
    assert live["limit"][0] == 75.0
    assert live["share_of_limit"][0] == 1.0
