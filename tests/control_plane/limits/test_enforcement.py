"""Enforcement ("enforce", or "shadow": counted, never refused) through the REST API on
both databases: own values round-trip through PUT, PATCH and bulk, the effective value
follows core's precedence, bad values are refused whole naming the field, writes reach
the audit log, the change log and the snapshot, and GET /usage shows the would-throttle
fraction engines report."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from control_plane.config import service as config
from control_plane.usage.book import UsageBook
from output_rate_core import protocol as p
from output_rate_core.limits import LimitModel
from tests.control_plane.factories import make_client


def version(client: TestClient) -> int:
    return int(client.get("/default-limit").json()["version"])


def enforcement(client: TestClient, user: str) -> tuple[str | None, str]:
    view = client.get(f"/limits/{user}").json()
    return view["enforcement"], view["effective_enforcement"]


def test_enforcement_round_trips_through_put_patch_bulk_and_get(client: TestClient) -> None:
    view = client.put(
        "/limits/a", json={"output_tokens_per_second": 5, "enforcement": "shadow"}
    ).json()
    assert (view["enforcement"], view["effective_enforcement"]) == ("shadow", "shadow")
    assert enforcement(client, "a") == ("shadow", "shadow")
    patched = client.patch("/limits/a", json={"output_tokens_per_second": 6}).json()
    assert (patched["enforcement"], patched["output_tokens_per_second"]) == ("shadow", 6)
    assert client.patch("/limits/a", json={"enforcement": "enforce"}).json()["enforcement"] == (
        "enforce"
    )
    assert client.patch("/limits/a", json={"enforcement": None}).json()["enforcement"] is None
    client.patch("/limits/a", json={"enforcement": "shadow"})
    # A PUT replaces: no enforcement sent is null (inherit).
    assert (
        client.put("/limits/a", json={"output_tokens_per_second": 6}).json()["enforcement"] is None
    )

    tier = client.put("/tiers/gold", json={"output_tokens_per_second": 50, "enforcement": "shadow"})
    assert tier.json()["enforcement"] == "shadow"
    assert client.get("/tiers/gold").json()["enforcement"] == "shadow"
    assert client.get("/tiers").json()["items"][0]["enforcement"] == "shadow"
    patched = client.patch("/tiers/gold", json={"description": "paid"}).json()
    assert (patched["enforcement"], patched["output_tokens_per_second"]) == ("shadow", 50)
    assert client.patch("/tiers/gold", json={"enforcement": "enforce"}).json()["enforcement"] == (
        "enforce"
    )
    put = client.put("/tiers/gold", json={"output_tokens_per_second": 50}).json()
    assert put["enforcement"] is None

    assert client.get("/default-limit").json()["enforcement"] is None
    default = client.put(
        "/default-limit", json={"output_tokens_per_second": 9, "enforcement": "shadow"}
    ).json()
    assert (default["output_tokens_per_second"], default["enforcement"]) == (9, "shadow")
    assert client.get("/default-limit").json()["enforcement"] == "shadow"
    put_default = client.put("/default-limit", json={"output_tokens_per_second": 9}).json()
    assert put_default["enforcement"] is None

    bulk = client.post(
        "/limits:bulk",
        json={
            "items": [
                {"user": "b1", "output_tokens_per_second": 3, "enforcement": "shadow"},
                {"user": "b2", "tier": "gold", "enforcement": "enforce"},
                {"user": "b3", "tier": "gold"},
            ]
        },
    )
    assert bulk.status_code == 200 and bulk.json()["num_changed"] == 3
    listed = {i["user"]: i for i in client.get("/limits?q=b").json()["items"]}
    assert {u: (i["enforcement"], i["effective_enforcement"]) for u, i in listed.items()} == {
        "b1": ("shadow", "shadow"),
        "b2": ("enforce", "enforce"),
        "b3": (None, "enforce"),
    }
    # The same bulk again changes nothing; a changed enforcement alone is a change.
    again = client.post("/limits:bulk", json={"items": [{"user": "b3", "tier": "gold"}]})
    assert again.json()["num_changed"] == 0
    flip = {"items": [{"user": "b3", "tier": "gold", "enforcement": "shadow"}]}
    assert client.post("/limits:bulk", json=flip).json()["num_changed"] == 1


def test_effective_enforcement_is_the_users_then_the_tiers_then_the_defaults(
    client: TestClient,
) -> None:
    client.put("/tiers/gold", json={"output_tokens_per_second": 50})
    client.put("/limits/u", json={"tier": "gold"})
    client.put("/limits/solo", json={"output_tokens_per_second": 3})
    # Nothing set anywhere: enforce.
    assert enforcement(client, "u") == (None, "enforce")
    assert enforcement(client, "nobody") == (None, "enforce")
    client.put("/default-limit", json={"output_tokens_per_second": 10, "enforcement": "shadow"})
    assert enforcement(client, "u") == (None, "shadow")
    assert enforcement(client, "nobody") == (None, "shadow")
    client.patch("/tiers/gold", json={"enforcement": "enforce"})
    assert enforcement(client, "u") == (None, "enforce")
    # A tier's enforcement is only for its members.
    assert enforcement(client, "solo") == (None, "shadow")
    client.patch("/limits/u", json={"enforcement": "shadow"})
    assert enforcement(client, "u") == ("shadow", "shadow")
    client.patch("/limits/solo", json={"enforcement": "enforce"})
    assert enforcement(client, "solo") == ("enforce", "enforce")
    client.patch("/limits/u", json={"enforcement": None})
    client.patch("/tiers/gold", json={"enforcement": None})
    assert enforcement(client, "u") == (None, "shadow")


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        (
            "PUT",
            "/limits/a",
            {"output_tokens_per_second": 5, "enforcement": "dry-run"},
            "enforcement",
        ),
        ("PATCH", "/limits/a", {"enforcement": "Shadow"}, "enforcement"),
        ("PUT", "/tiers/gold", {"output_tokens_per_second": 5, "enforcement": True}, "enforcement"),
        ("PATCH", "/tiers/gold", {"enforcement": ""}, "enforcement"),
        ("PUT", "/default-limit", {"output_tokens_per_second": 5, "enforcement": 1}, "enforcement"),
        (
            "POST",
            "/limits:bulk",
            {
                "items": [
                    {"user": "x", "enforcement": "shadow"},
                    {"user": "y", "enforcement": ["shadow"]},
                ]
            },
            "items.1.enforcement",
        ),
    ],
)
def test_a_bad_enforcement_is_422_naming_the_field_and_writes_nothing(
    client: TestClient, method: str, path: str, body: dict[str, Any], field: str
) -> None:
    client.put("/tiers/gold", json={"output_tokens_per_second": 7})
    client.put("/limits/a", json={"output_tokens_per_second": 7})
    before = version(client), client.get("/limits/a").json(), client.get("/tiers/gold").json()
    response = client.request(method, path, json=body)
    assert response.status_code == 422
    assert response.json()["field"] == field
    after = version(client), client.get("/limits/a").json(), client.get("/tiers/gold").json()
    assert after == before
    assert client.get("/default-limit").json()["output_tokens_per_second"] is None
    assert client.get("/limits?q=x").json()["items"] == []


def test_an_enforcement_change_is_one_version_audited_and_in_the_snapshot(
    client: TestClient,
) -> None:
    client.put("/tiers/gold", json={"output_tokens_per_second": 50, "enforcement": "shadow"})
    client.put("/limits/a", json={"tier": "gold"})
    client.put("/limits/b", json={"output_tokens_per_second": 5})
    start = version(client)
    writes: list[tuple[str, str, dict[str, Any]]] = [
        ("PATCH", "/limits/b", {"enforcement": "shadow"}),
        ("PATCH", "/tiers/gold", {"enforcement": "enforce"}),
        ("PUT", "/default-limit", {"output_tokens_per_second": 10, "enforcement": "shadow"}),
    ]
    for number, (method, path, body) in enumerate(writes, start=1):
        assert client.request(method, path, json=body).status_code == 200
        assert version(client) == start + number
        assert client.request(method, path, json=body).status_code == 200
        assert version(client) == start + number  # the same write again: nothing
    entries = client.get("/audit?limit=3").json()["items"]
    assert [
        (e["action"], e["before"]["enforcement"], e["after"]["enforcement"]) for e in entries
    ] == [
        ("put_default", None, "shadow"),
        ("patch_tier", "shadow", "enforce"),
        ("patch_limit", None, "shadow"),
    ]
    db = client.app.state.control_plane.db  # type: ignore[attr-defined]
    snapshot = db.read_now(config.load_snapshot)
    assert snapshot.default_enforcement == "shadow"
    assert snapshot.tier_enforcements == {"gold": "enforce"}
    assert snapshot.user_enforcements == {"b": "shadow"}
    # Core's model, fed the change log op by op, is the model of the snapshot.
    replayed = LimitModel()
    for _, version_ops in db.read_now(config.changes_since, 0):
        for op in p.ops_from_rows(version_ops):
            replayed.apply(op)
    assert replayed == LimitModel.from_snapshot(snapshot)
    users = ["a", "b", "nobody"]
    assert [replayed.effective(u).enforcement for u in users] == ["enforce", "shadow", "shadow"]
    assert [enforcement(client, u)[1] for u in users] == ["enforce", "shadow", "shadow"]


@pytest.fixture
def usage_client(db_url: str) -> Iterator[tuple[TestClient, UsageBook, list[float]]]:
    now = [1000.0]  # the usage book's clock (a seam: reports age by this, not by sleeps)
    book = UsageBook(clock=lambda: now[0])
    with make_client(db_url, usage_source=book) as c:
        yield c, book, now
        c.app.state.control_plane.db.dispose()  # type: ignore[attr-defined]


def test_usage_shows_the_would_throttle_fraction_beside_the_throttled_one(
    usage_client: tuple[TestClient, UsageBook, list[float]],
) -> None:
    client, book, now = usage_client
    client.put("/limits/shadowed", json={"output_tokens_per_second": 20, "enforcement": "shadow"})
    client.put("/limits/held", json={"output_tokens_per_second": 20})
    for engine in ("e1", "e2"):
        now[0] += 0.5
        book.add(
            p.Usage(
                engine,
                1.0,
                {"shadowed": 50, "held": 20, "free": 7},
                {"held": 30},
                would_throttle={"shadowed": 30},
            )
        )
    items = {i["user"]: i for i in client.get("/usage").json()["items"]}
    assert set(items["shadowed"]) == {
        "user",
        "output_tokens_per_second_1s",
        "output_tokens_per_second_10s",
        "borrowed_output_tokens_per_second_1s",
        "borrowed_output_tokens_per_second_10s",
        "limit",
        "ceiling",
        "throttled_fraction",
        "would_throttle_fraction",
    }
    assert (
        items["shadowed"]["throttled_fraction"],
        items["shadowed"]["would_throttle_fraction"],
    ) == (
        0.0,
        0.6,
    )
    assert (items["held"]["throttled_fraction"], items["held"]["would_throttle_fraction"]) == (
        0.6,
        0.0,
    )
    assert items["free"]["would_throttle_fraction"] == 0.0
    assert items["shadowed"]["limit"] == 20
