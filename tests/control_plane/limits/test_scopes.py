"""Scopes ("fleet": a limit summed over every engine, "engine": enforced by each) through
the REST API: own values round-trip, the effective scope follows core's precedence, bad
values are refused whole, writes reach the change log and the snapshot, and GET shows the
shares the fleet holds and the rate engines report."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient

from control_plane.config import service as config
from control_plane.engines import service as engines
from control_plane.usage.book import UsageBook
from output_rate_core import protocol as p
from output_rate_core.limits import LimitModel
from tests.control_plane.factories import make_client

CEILING = "ceiling_output_tokens_per_second"


def version(client: TestClient) -> int:
    return int(client.get("/default-limit").json()["version"])


def scopes(client: TestClient, user: str) -> tuple[str | None, str]:
    view = client.get(f"/limits/{user}").json()
    return view["scope"], view["effective_scope"]


def test_scopes_round_trip_through_put_patch_and_get(client: TestClient) -> None:
    view = client.put("/limits/a", json={"output_tokens_per_second": 5, "scope": "engine"}).json()
    assert (view["scope"], view["effective_scope"]) == ("engine", "engine")
    assert scopes(client, "a") == ("engine", "engine")
    patched = client.patch("/limits/a", json={"output_tokens_per_second": 6}).json()
    assert (patched["scope"], patched["output_tokens_per_second"]) == ("engine", 6)
    patched = client.patch("/limits/a", json={"scope": "fleet"}).json()
    assert (patched["scope"], patched["output_tokens_per_second"]) == ("fleet", 6)
    assert client.patch("/limits/a", json={"scope": None}).json()["scope"] is None
    # A PUT replaces: no scope sent is null (inherit).
    client.patch("/limits/a", json={"scope": "engine"})
    assert client.put("/limits/a", json={"output_tokens_per_second": 6}).json()["scope"] is None

    tier = client.put("/tiers/gold", json={"output_tokens_per_second": 50, "scope": "engine"})
    assert tier.json()["scope"] == "engine"
    assert client.get("/tiers/gold").json()["scope"] == "engine"
    assert client.get("/tiers").json()["items"][0]["scope"] == "engine"
    patched = client.patch("/tiers/gold", json={"description": "paid"}).json()
    assert (patched["scope"], patched["output_tokens_per_second"]) == ("engine", 50)
    assert client.patch("/tiers/gold", json={"scope": "fleet"}).json()["scope"] == "fleet"
    assert client.put("/tiers/gold", json={"output_tokens_per_second": 50}).json()["scope"] is None

    assert client.get("/default-limit").json()["scope"] is None
    default = client.put("/default-limit", json={"output_tokens_per_second": 9, "scope": "engine"})
    assert (default.json()["output_tokens_per_second"], default.json()["scope"]) == (9, "engine")
    assert client.get("/default-limit").json()["scope"] == "engine"
    # A PUT replaces the scope too: absent is null ("fleet").
    assert (
        client.put("/default-limit", json={"output_tokens_per_second": 9}).json()["scope"] is None
    )


def test_effective_scope_is_the_users_then_the_tiers_then_the_defaults(
    client: TestClient,
) -> None:
    client.put("/tiers/gold", json={"output_tokens_per_second": 50})
    client.put("/limits/u", json={"tier": "gold"})
    client.put("/limits/solo", json={"output_tokens_per_second": 3})
    # Nothing set anywhere: fleet.
    assert scopes(client, "u") == (None, "fleet")
    assert scopes(client, "nobody") == (None, "fleet")
    client.put("/default-limit", json={"scope": "engine"})
    assert scopes(client, "u") == (None, "engine")
    assert scopes(client, "nobody") == (None, "engine")
    client.patch("/tiers/gold", json={"scope": "fleet"})
    assert scopes(client, "u") == (None, "fleet")
    # A tier's scope is only for its members.
    assert scopes(client, "solo") == (None, "engine")
    client.patch("/limits/u", json={"scope": "engine"})
    assert scopes(client, "u") == ("engine", "engine")
    client.patch("/limits/solo", json={"scope": "fleet"})
    assert scopes(client, "solo") == ("fleet", "fleet")
    listed = {i["user"]: i for i in client.get("/limits").json()["items"]}
    assert {u: (i["scope"], i["effective_scope"]) for u, i in listed.items()} == {
        "solo": ("fleet", "fleet"),
        "u": ("engine", "engine"),
    }
    client.patch("/limits/u", json={"scope": None})
    client.patch("/tiers/gold", json={"scope": None})
    assert scopes(client, "u") == (None, "engine")


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("PUT", "/limits/a", {"output_tokens_per_second": 5, "scope": "global"}, "scope"),
        ("PATCH", "/limits/a", {"scope": "Fleet"}, "scope"),
        ("PUT", "/tiers/gold", {"output_tokens_per_second": 5, "scope": 1}, "scope"),
        ("PATCH", "/tiers/gold", {"scope": ""}, "scope"),
        ("PUT", "/default-limit", {"output_tokens_per_second": 5, "scope": "all"}, "scope"),
        (
            "POST",
            "/limits:bulk",
            {"items": [{"user": "x", "scope": "fleet"}, {"user": "y", "scope": ["engine"]}]},
            "items.1.scope",
        ),
    ],
)
def test_a_bad_scope_is_422_naming_the_field_and_writes_nothing(
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


def test_a_scope_change_is_one_version_and_the_same_write_again_none(client: TestClient) -> None:
    client.put("/limits/a", json={"output_tokens_per_second": 5})
    client.put("/tiers/t", json={"output_tokens_per_second": 5})
    start = version(client)
    writes = [
        ("PUT", "/limits/a", {"output_tokens_per_second": 5, "scope": "engine"}),
        ("PATCH", "/limits/a", {"scope": "fleet"}),
        ("PATCH", "/tiers/t", {"scope": "engine"}),
        ("PUT", "/default-limit", {"scope": "engine"}),
    ]
    for number, (method, path, body) in enumerate(writes, start=1):
        assert client.request(method, path, json=body).status_code == 200
        assert version(client) == start + number
        assert client.request(method, path, json=body).status_code == 200
        assert version(client) == start + number
    entries = client.get("/audit?limit=4").json()["items"]
    assert [(e["action"], e["before"], e["after"]) for e in entries] == [
        (
            "put_default",
            {"output_tokens_per_second": None, "scope": None, "enforcement": None, CEILING: None},
            {
                "output_tokens_per_second": None,
                "scope": "engine",
                "enforcement": None,
                CEILING: None,
            },
        ),
        (
            "patch_tier",
            {
                "output_tokens_per_second": 5,
                "scope": None,
                "enforcement": None,
                CEILING: None,
                "description": "",
            },
            {
                "output_tokens_per_second": 5,
                "scope": "engine",
                "enforcement": None,
                CEILING: None,
                "description": "",
            },
        ),
        (
            "patch_limit",
            {
                "tier": None,
                "output_tokens_per_second": 5,
                "scope": "engine",
                "enforcement": None,
                CEILING: None,
            },
            {
                "tier": None,
                "output_tokens_per_second": 5,
                "scope": "fleet",
                "enforcement": None,
                CEILING: None,
            },
        ),
        (
            "put_limit",
            {
                "tier": None,
                "output_tokens_per_second": 5,
                "scope": None,
                "enforcement": None,
                CEILING: None,
            },
            {
                "tier": None,
                "output_tokens_per_second": 5,
                "scope": "engine",
                "enforcement": None,
                CEILING: None,
            },
        ),
    ]


def test_the_change_log_carries_scopes_and_replays_to_the_snapshot(client: TestClient) -> None:
    client.put("/tiers/gold", json={"output_tokens_per_second": 500, "scope": "engine"})
    client.put("/tiers/free", json={"output_tokens_per_second": 5})
    client.put("/default-limit", json={"output_tokens_per_second": 10, "scope": "engine"})
    client.put("/limits/a", json={"tier": "gold", "scope": "fleet"})
    client.put("/limits/b", json={"tier": "gold"})
    client.post(
        "/limits:bulk",
        json={
            "items": [
                {"user": "c", "output_tokens_per_second": 3, "scope": "engine"},
                {"user": "d", "tier": "free"},
            ]
        },
    )
    client.patch("/limits/d", json={"scope": "fleet"})
    db = client.app.state.control_plane.db  # type: ignore[attr-defined]
    snapshot = db.read_now(config.load_snapshot)
    changes = db.read_now(config.changes_since, 0)
    ops = [op for _, version_ops in changes for op in version_ops]
    unset = {"enforcement": None, "ceiling": None}
    assert ops[0] == {"op": "set_tier", "name": "gold", "rate": 500, "scope": "engine", **unset}
    assert ops[2] == {"op": "set_default", "rate": 10, "scope": "engine", **unset}
    assert ops[3] == {
        "op": "set_user",
        "user": "a",
        "tier": "gold",
        "rate": None,
        "scope": "fleet",
        **unset,
    }
    assert ops[-1]["scope"] == "fleet"
    assert (snapshot.default_scope, snapshot.tier_scopes) == ("engine", {"gold": "engine"})
    assert snapshot.user_scopes == {"a": "fleet", "c": "engine", "d": "fleet"}
    # Core's model, fed the change log op by op, is the model of the snapshot.
    replayed = LimitModel()
    for _, version_ops in changes:
        for op in p.ops_from_rows(version_ops):
            replayed.apply(op)
    assert replayed == LimitModel.from_snapshot(snapshot)
    assert [replayed.effective(u).scope for u in "abcdz"] == [
        "fleet",
        "engine",
        "engine",
        "fleet",
        "engine",
    ]
    assert [scopes(client, u)[1] for u in "abcdz"] == [replayed.effective(u).scope for u in "abcdz"]


class StaticFleet:
    """A FleetView over fixed shares: engine id -> user -> milli-tokens/s."""

    def __init__(self, shares: dict[str, dict[str, int]]) -> None:
        self.shares = shares

    def shares_of(self, user: str) -> dict[str, int]:
        return {e: held[user] for e, held in self.shares.items() if user in held}

    def num_shared_users(self, engine_id: str) -> int:
        return len(self.shares.get(engine_id, {}))


@pytest.fixture
def fleet_client(db_url: str) -> Iterator[tuple[TestClient, UsageBook, list[float]]]:
    now = [1000.0]  # the usage book's clock (a seam: reports age by this, not by sleeps)
    book = UsageBook(clock=lambda: now[0])
    fleet = StaticFleet(
        {
            "engine-b": {"alice": 2_500, "bob": 1_000, "carol": 4_000},
            "engine-a": {"alice": 7_333},
            "engine-c": {},
        }
    )
    with make_client(db_url, usage_source=book, fleet=fleet) as c:
        yield c, book, now
        c.app.state.control_plane.db.dispose()  # type: ignore[attr-defined]


def test_get_shows_fleet_shares_by_engine_and_the_received_rate(
    fleet_client: tuple[TestClient, UsageBook, list[float]],
) -> None:
    client, book, now = fleet_client
    client.put("/limits/alice", json={"output_tokens_per_second": 10})
    client.put("/limits/bob", json={"output_tokens_per_second": 10, "scope": "engine"})
    view = client.get("/limits/alice").json()
    assert view["shares"] == [
        {"engine_id": "engine-a", "output_tokens_per_second": 7.333},
        {"engine_id": "engine-b", "output_tokens_per_second": 2.5},
    ]
    assert view["received_output_tokens_per_second"] is None
    # Engine scope, or unlimited: not split, whatever the allocator still holds.
    assert client.get("/limits/bob").json()["shares"] == []
    assert client.get("/limits/carol").json()["effective_output_tokens_per_second"] is None
    assert client.get("/limits/carol").json()["shares"] == []
    # Lists and write responses leave shares out.
    assert [i["shares"] for i in client.get("/limits").json()["items"]] == [[], []]
    assert client.patch("/limits/alice", json={"tier": None}).json()["shares"] == []

    book.add(p.Usage("engine-a", 1.0, {"alice": 6, "bob": 2}, {}))
    book.add(p.Usage("engine-b", 1.0, {"alice": 3}, {"bob": 1}))
    assert client.get("/limits/alice").json()["received_output_tokens_per_second"] == 9.0
    assert client.get("/limits/bob").json()["received_output_tokens_per_second"] == 2.0
    assert client.get("/limits/dave").json()["received_output_tokens_per_second"] is None
    now[0] += 5  # past the 1 s window: the user is known, its rate now is 0
    assert client.get("/limits/alice").json()["received_output_tokens_per_second"] == 0.0


def test_engines_show_how_many_users_they_hold_a_share_for(
    fleet_client: tuple[TestClient, UsageBook, list[float]],
) -> None:
    client, _, _ = fleet_client
    db = client.app.state.control_plane.db  # type: ignore[attr-defined]
    seen = [
        engines.EngineSeen(e, "m", 0, datetime.now(UTC))
        for e in ("engine-a", "engine-b", "engine-z")
    ]
    db.run_now(engines.record_engines, seen=seen)
    listed = client.get("/engines").json()["items"]
    assert {e["engine_id"]: e["num_shared_users"] for e in listed} == {
        "engine-a": 1,
        "engine-b": 3,
        "engine-z": 0,
    }
