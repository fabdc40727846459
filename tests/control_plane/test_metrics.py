"""The control plane's fleet view on /metrics: engines by state, per-tier tokens/s, report age."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from control_plane.engines.service import EngineSeen, record_engines
from control_plane.usage.book import UsageBook
from output_rate_core import protocol as p
from tests.control_plane.factories import FakeClock, make_client


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def book(clock: FakeClock) -> UsageBook:
    return UsageBook(clock)


@pytest.fixture
def client(db_url: str, book: UsageBook) -> Iterator[TestClient]:
    """An app whose live usage is `book` (the push server's book in `output-rate serve`)."""
    with make_client(db_url, usage_source=book) as c:
        yield c
        c.app.state.control_plane.db.dispose()  # type: ignore[attr-defined]


def scrape(client: TestClient) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_fleet_view(client: TestClient, clock: FakeClock, book: UsageBook) -> None:
    client.put("/tiers/pro", json={"output_tokens_per_second": 100})
    client.put("/limits/a", json={"tier": "pro"})
    version = client.put("/limits/b", json={"output_tokens_per_second": 5}).json()["version"]
    db = client.app.state.control_plane.db  # type: ignore[attr-defined]
    now = datetime.now(UTC)
    seen = [
        EngineSeen("e-new", "tiny", version, now),
        EngineSeen("e-old", "tiny", version - 2, now),
    ]
    with db.engine.begin() as conn:
        record_engines(conn, seen=seen)
    book.add(p.Usage("e-new", 1.0, {"a": 30, "b": 5, "c": 7}, {"b": 9}))
    clock.now += 4.0
    got = scrape(client)
    engines = {dict(k)["state"]: v for k, v in got["output_rate_fleet_engines"].items()}
    assert engines == {"in_sync": 1, "lagging": 1, "disconnected": 0}
    assert got["output_rate_fleet_max_version_lag"] == {(): 2}
    per_tier = got["output_rate_tier_output_tokens_per_second"]
    tiers = {dict(k)["tier"]: v for k, v in per_tier.items()}
    # 10 s window: one 1-s report of a (pro) and of b, c (no tier).
    assert tiers == {"pro": 30.0, "": 12.0}
    ages = got["output_rate_usage_report_age_seconds"]
    assert ages == {(("engine_id", "e-new"),): 4.0}
    assert got["output_rate_config_version"] == {(): version}
