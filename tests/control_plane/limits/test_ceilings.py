"""Ceilings (ceiling_output_tokens_per_second: what a user may borrow up to) through the
REST API on both databases: own values round-trip through PUT, PATCH, bulk (JSON and
CSV) and GET, the effective ceiling follows core's precedence, a ceiling below the rate
the write leaves is refused whole naming the field, a later rate change above an
existing ceiling borrows nothing, If-Match works as for any field, and writes reach the
audit log, the change log, the snapshot and previews."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from control_plane.config import service as config
from output_rate_core import protocol as p
from output_rate_core.limits import LimitModel

CEILING = "ceiling_output_tokens_per_second"
EFFECTIVE = "effective_ceiling_output_tokens_per_second"


def version(client: TestClient) -> int:
    return int(client.get("/default-limit").json()["version"])


def ceiling(client: TestClient, user: str) -> tuple[int | None, int | None]:
    view = client.get(f"/limits/{user}").json()
    return view[CEILING], view[EFFECTIVE]


def test_a_ceiling_round_trips_through_put_patch_bulk_and_get(client: TestClient) -> None:
    view = client.put("/limits/a", json={"output_tokens_per_second": 5, CEILING: 8}).json()
    assert (view[CEILING], view[EFFECTIVE]) == (8, 8)
    assert ceiling(client, "a") == (8, 8)
    patched = client.patch("/limits/a", json={"output_tokens_per_second": 6}).json()
    assert (patched[CEILING], patched["output_tokens_per_second"]) == (8, 6)
    assert client.patch("/limits/a", json={CEILING: 1_000_000}).json()[CEILING] == 1_000_000
    assert client.patch("/limits/a", json={CEILING: None}).json()[CEILING] is None
    client.patch("/limits/a", json={CEILING: 9})
    # A PUT replaces: no ceiling sent is null (inherit).
    assert client.put("/limits/a", json={"output_tokens_per_second": 6}).json()[CEILING] is None

    tier = client.put("/tiers/gold", json={"output_tokens_per_second": 50, CEILING: 80})
    assert tier.json()[CEILING] == 80
    assert client.get("/tiers/gold").json()[CEILING] == 80
    assert client.get("/tiers").json()["items"][0][CEILING] == 80
    patched = client.patch("/tiers/gold", json={"description": "paid"}).json()
    assert (patched[CEILING], patched["output_tokens_per_second"]) == (80, 50)
    assert client.patch("/tiers/gold", json={CEILING: 50}).json()[CEILING] == 50
    assert client.put("/tiers/gold", json={"output_tokens_per_second": 50}).json()[CEILING] is None

    assert client.get("/default-limit").json()[CEILING] is None
    default = client.put("/default-limit", json={"output_tokens_per_second": 9, CEILING: 30})
    assert (default.json()["output_tokens_per_second"], default.json()[CEILING]) == (9, 30)
    assert client.get("/default-limit").json()[CEILING] == 30
    assert (
        client.put("/default-limit", json={"output_tokens_per_second": 9}).json()[CEILING] is None
    )

    bulk = client.post(
        "/limits:bulk",
        json={
            "items": [
                {"user": "b1", "output_tokens_per_second": 3, CEILING: 4},
                {"user": "b2", "tier": "gold", CEILING: 70},
                {"user": "b3", "tier": "gold"},
            ]
        },
    )
    assert bulk.status_code == 200 and bulk.json()["num_changed"] == 3
    listed = {i["user"]: i for i in client.get("/limits?q=b").json()["items"]}
    assert {u: (i[CEILING], i[EFFECTIVE]) for u, i in listed.items()} == {
        "b1": (4, 4),
        "b2": (70, 70),
        "b3": (None, None),
    }
    # The same bulk again changes nothing; a changed ceiling alone is a change.
    again = client.post("/limits:bulk", json={"items": [{"user": "b3", "tier": "gold"}]})
    assert again.json()["num_changed"] == 0
    raised = {"items": [{"user": "b3", "tier": "gold", CEILING: 60}]}
    assert client.post("/limits:bulk", json=raised).json()["num_changed"] == 1
    csv = f"user,tier,output_tokens_per_second,scope,enforcement,{CEILING}\nc1,,5,,,7\nc2,gold\n"
    posted = client.post("/limits:bulk", content=csv, headers={"content-type": "text/csv"})
    assert posted.status_code == 200, posted.text
    assert ceiling(client, "c1") == (7, 7)
    assert ceiling(client, "c2") == (None, None)


def test_the_effective_ceiling_is_the_users_then_the_tiers_then_the_defaults(
    client: TestClient,
) -> None:
    client.put("/tiers/gold", json={"output_tokens_per_second": 50})
    client.put("/limits/u", json={"tier": "gold"})
    client.put("/limits/solo", json={"output_tokens_per_second": 3})
    # Nothing set anywhere: nobody borrows.
    assert ceiling(client, "u") == (None, None)
    assert ceiling(client, "nobody") == (None, None)
    client.put("/default-limit", json={"output_tokens_per_second": 10, CEILING: 40})
    assert ceiling(client, "nobody") == (None, 40)
    assert ceiling(client, "solo") == (None, 40)
    # The default's ceiling is below gold's rate: its users borrow nothing.
    assert ceiling(client, "u") == (None, None)
    client.patch("/tiers/gold", json={CEILING: 75})
    assert ceiling(client, "u") == (None, 75)
    # A tier's ceiling is only for its members.
    assert ceiling(client, "solo") == (None, 40)
    client.patch("/limits/u", json={CEILING: 90})
    assert ceiling(client, "u") == (90, 90)
    client.patch("/limits/u", json={CEILING: None})
    client.patch("/tiers/gold", json={CEILING: None})
    assert ceiling(client, "u") == (None, None)


def test_a_rate_change_elsewhere_that_passes_a_ceiling_borrows_nothing(
    client: TestClient,
) -> None:
    client.put("/tiers/gold", json={"output_tokens_per_second": 20})
    client.put("/limits/u", json={"tier": "gold", CEILING: 30})
    client.put("/default-limit", json={"output_tokens_per_second": 5, CEILING: 10})
    assert ceiling(client, "u") == (30, 30)
    assert ceiling(client, "nobody") == (None, 10)
    # Neither write sets a ceiling: each is taken, and the ceilings now at or below the
    # rate they meet borrow nothing (they are kept, and count again if the rate falls).
    assert client.patch("/tiers/gold", json={"output_tokens_per_second": 40}).status_code == 200
    assert ceiling(client, "u") == (30, None)
    assert client.patch("/tiers/gold", json={"output_tokens_per_second": 30}).status_code == 200
    assert ceiling(client, "u") == (30, None)  # equal to the rate: nothing to borrow
    client.patch("/tiers/gold", json={"output_tokens_per_second": 20})
    assert ceiling(client, "u") == (30, 30)


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("PUT", "/limits/a", {"output_tokens_per_second": 5, CEILING: 4}, CEILING),
        # Below the rate the user inherits (its tier's 7).
        ("PUT", "/limits/a", {"tier": "gold", CEILING: 6}, CEILING),
        # An own ceiling the patched rate would pass.
        ("PATCH", "/limits/a", {"output_tokens_per_second": 9}, CEILING),
        ("PATCH", "/limits/a", {CEILING: 0}, CEILING),
        ("PATCH", "/limits/a", {CEILING: 2.5}, CEILING),
        ("PATCH", "/limits/a", {CEILING: "9"}, CEILING),
        ("PUT", "/limits/a", {"output_tokens_per_second": 5, CEILING: 1_000_001}, CEILING),
        # An unlimited user has nothing to borrow.
        ("PUT", "/limits/a", {"tier": "open", CEILING: 10}, CEILING),
        ("PUT", "/tiers/gold", {"output_tokens_per_second": 5, CEILING: 3}, CEILING),
        ("PATCH", "/tiers/gold", {CEILING: 6}, CEILING),
        ("PATCH", "/tiers/gold", {"output_tokens_per_second": None, CEILING: 9}, CEILING),
        ("PUT", "/default-limit", {"output_tokens_per_second": 5, CEILING: 4}, CEILING),
        ("PUT", "/default-limit", {CEILING: 4}, CEILING),
        (
            "POST",
            "/limits:bulk",
            {
                "items": [
                    {"user": "x", "output_tokens_per_second": 3, CEILING: 3},
                    {"user": "y", "tier": "gold", CEILING: 5},
                ]
            },
            f"items.1.{CEILING}",
        ),
        (
            "POST",
            "/limits:bulk",
            {"items": [{"user": "x", CEILING: True}]},
            f"items.0.{CEILING}",
        ),
    ],
)
def test_a_bad_ceiling_is_422_naming_the_field_and_writes_nothing(
    client: TestClient, method: str, path: str, body: dict[str, Any], field: str
) -> None:
    client.put("/tiers/gold", json={"output_tokens_per_second": 7, CEILING: 8})
    client.put("/tiers/open", json={"output_tokens_per_second": None})
    client.put("/limits/a", json={"output_tokens_per_second": 7, CEILING: 8})
    before = version(client), client.get("/limits/a").json(), client.get("/tiers/gold").json()
    for dry_run in (True, False):  # the preview refuses alike
        response = client.request(method, path, json=body, params={"dry_run": dry_run})
        assert response.status_code == 422, response.text
        assert response.json()["field"] == field
        if "below" in response.text:
            assert "at least the rate" in response.json()["detail"]
    after = version(client), client.get("/limits/a").json(), client.get("/tiers/gold").json()
    assert after == before
    assert client.get("/default-limit").json()[CEILING] is None
    assert client.get("/limits?q=x").json()["items"] == []


def test_a_csv_bulk_names_every_line_with_a_bad_ceiling(client: TestClient) -> None:
    client.put("/tiers/gold", json={"output_tokens_per_second": 7})
    csv = "user,tier,override,scope,enforcement,ceiling\nok,gold,,,,7\nlow,gold,,,,6\nbad,,5,,,x\n"
    response = client.post("/limits:bulk", content=csv, headers={"content-type": "text/csv"})
    assert response.status_code == 422
    problems = {(e["line"], e["field"]) for e in response.json()["errors"]}
    assert problems == {(3, CEILING), (4, CEILING)}
    assert client.get("/limits?q=ok").json()["items"] == []


def test_if_match_guards_a_ceiling_write_like_any_other(client: TestClient) -> None:
    client.put("/limits/a", json={"output_tokens_per_second": 5})
    read = client.get("/limits/a")
    tag = read.headers["etag"]
    client.patch("/limits/a", json={CEILING: 6})  # someone else's write
    stale = client.patch("/limits/a", json={CEILING: 9}, headers={"if-match": tag})
    assert stale.status_code == 412
    assert ceiling(client, "a") == (6, 6)
    fresh = client.patch(
        "/limits/a",
        json={CEILING: 9},
        headers={"if-match": client.get("/limits/a").headers["etag"]},
    )
    assert fresh.status_code == 200 and fresh.json()[CEILING] == 9
    tier = client.put("/tiers/gold", json={"output_tokens_per_second": 5})
    assert tier.status_code == 200
    tag = client.get("/tiers/gold").headers["etag"]
    ok = client.patch("/tiers/gold", json={CEILING: 10}, headers={"if-match": tag})
    assert ok.status_code == 200
    again = client.patch("/tiers/gold", json={CEILING: 11}, headers={"if-match": tag})
    assert again.status_code == 412
    tag = client.get("/default-limit").headers["etag"]
    body = {"output_tokens_per_second": 5, CEILING: 10}
    assert client.put("/default-limit", json=body, headers={"if-match": tag}).status_code == 200
    body[CEILING] = 12
    assert client.put("/default-limit", json=body, headers={"if-match": tag}).status_code == 412
    assert client.get("/default-limit").json()[CEILING] == 10


def test_a_ceiling_change_is_one_version_audited_previewed_and_in_the_snapshot(
    client: TestClient,
) -> None:
    client.put("/tiers/gold", json={"output_tokens_per_second": 50, CEILING: 60})
    client.put("/limits/a", json={"tier": "gold"})
    client.put("/limits/b", json={"output_tokens_per_second": 5})
    preview = client.patch("/limits/b", json={CEILING: 8}, params={"dry_run": True}).json()
    [item] = preview["items"]
    assert (item["change"], item["before"][EFFECTIVE], item["after"][EFFECTIVE]) == (
        "same",
        None,
        8,
    )
    tier_preview = client.patch("/tiers/gold", json={CEILING: 70}, params={"dry_run": True}).json()
    assert [(i["user"], i["after"][EFFECTIVE]) for i in tier_preview["items"]] == [("a", 70)]
    start = version(client)
    writes: list[tuple[str, str, dict[str, Any]]] = [
        ("PATCH", "/limits/b", {CEILING: 8}),
        ("PATCH", "/tiers/gold", {CEILING: 70}),
        ("PUT", "/default-limit", {"output_tokens_per_second": 10, CEILING: 20}),
    ]
    for number, (method, path, body) in enumerate(writes, start=1):
        assert client.request(method, path, json=body).status_code == 200
        assert version(client) == start + number
        assert client.request(method, path, json=body).status_code == 200
        assert version(client) == start + number  # the same write again: nothing
    entries = client.get("/audit?limit=3").json()["items"]
    assert [(e["action"], e["before"][CEILING], e["after"][CEILING]) for e in entries] == [
        ("put_default", None, 20),
        ("patch_tier", 60, 70),
        ("patch_limit", None, 8),
    ]
    db = client.app.state.control_plane.db  # type: ignore[attr-defined]
    snapshot = db.read_now(config.load_snapshot)
    assert snapshot.default_ceiling == 20
    assert snapshot.tier_ceilings == {"gold": 70}
    assert snapshot.user_ceilings == {"b": 8}
    # Core's model, fed the change log op by op, is the model of the snapshot.
    replayed = LimitModel()
    for _, version_ops in db.read_now(config.changes_since, 0):
        for op in p.ops_from_rows(version_ops):
            replayed.apply(op)
    assert replayed == LimitModel.from_snapshot(snapshot)
    users = ["a", "b", "nobody"]
    assert [replayed.effective(u).ceiling for u in users] == [70, 8, 20]
    assert [ceiling(client, u)[1] for u in users] == [70, 8, 20]
