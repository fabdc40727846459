"""PATCH /limits/{user} and PATCH /tiers/{name}: JSON merge patch, only the fields sent
change (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}


def version(client: TestClient) -> int:
    return int(client.get("/engines").json()["version"])


def audit(client: TestClient) -> list[dict[str, Any]]:
    return list(client.get("/audit?limit=1000").json()["items"])


def merge_patch(client: TestClient, path: str, body: Any) -> Any:
    return client.patch(path, content=json.dumps(body), headers=MERGE_PATCH)


def test_tier_description_alone_keeps_the_rate(client: TestClient) -> None:
    client.put("/tiers/pro", json={"output_tokens_per_second": 100, "description": "paid"})
    response = merge_patch(client, "/tiers/pro", {"description": "Paid plan"})
    assert response.status_code == 200
    assert response.json()["output_tokens_per_second"] == 100
    assert client.get("/tiers/pro").json()["output_tokens_per_second"] == 100
    assert client.get("/tiers/pro").json()["description"] == "Paid plan"
    assert audit(client)[0]["action"] == "patch_tier"
    assert audit(client)[0]["before"] == {
        "output_tokens_per_second": 100,
        "scope": None,
        "enforcement": None,
        "ceiling_output_tokens_per_second": None,
        "description": "paid",
    }


def test_tier_rate_alone_keeps_the_description_and_null_is_unlimited(client: TestClient) -> None:
    client.put("/tiers/pro", json={"output_tokens_per_second": 100, "description": "paid"})
    view = client.patch("/tiers/pro", json={"output_tokens_per_second": 150}).json()
    assert (view["output_tokens_per_second"], view["description"]) == (150, "paid")
    view = client.patch("/tiers/pro", json={"output_tokens_per_second": None}).json()
    assert (view["output_tokens_per_second"], view["description"]) == (None, "paid")
    view = client.patch("/tiers/pro", json={"description": None}).json()
    assert (view["output_tokens_per_second"], view["description"]) == (None, "")


def test_user_tier_move_keeps_override_and_override_keeps_tier(client: TestClient) -> None:
    client.put("/tiers/free", json={"output_tokens_per_second": 10})
    client.put("/tiers/pro", json={"output_tokens_per_second": 100})
    client.put("/limits/alice", json={"tier": "free", "output_tokens_per_second": 7})
    view = merge_patch(client, "/limits/alice", {"tier": "pro"}).json()
    assert (view["tier"], view["output_tokens_per_second"]) == ("pro", 7)
    view = client.patch("/limits/alice", json={"output_tokens_per_second": 20}).json()
    assert (view["tier"], view["output_tokens_per_second"]) == ("pro", 20)
    # null clears only the field sent: the tier's rate applies again.
    view = client.patch("/limits/alice", json={"output_tokens_per_second": None}).json()
    assert (view["tier"], view["source"], view["effective_output_tokens_per_second"]) == (
        "pro",
        "tier",
        100,
    )
    tiers = {t["name"]: t["num_users"] for t in client.get("/tiers").json()["items"]}
    assert tiers == {"free": 0, "pro": 1}


def test_patch_creates_an_unknown_user_but_an_empty_patch_writes_nothing(
    client: TestClient,
) -> None:
    before = version(client)
    view = client.patch("/limits/nobody", json={}).json()
    assert view["source"] == "default"
    assert version(client) == before
    assert client.get("/limits").json()["total"] == 0
    view = client.patch("/limits/newbie", json={"output_tokens_per_second": 3}).json()
    assert (view["tier"], view["output_tokens_per_second"]) == (None, 3)
    assert version(client) == before + 1
    # The same patch again changes nothing.
    client.patch("/limits/newbie", json={"output_tokens_per_second": 3})
    assert version(client) == before + 1


def test_patching_an_unknown_tier_is_404_and_creates_nothing(client: TestClient) -> None:
    response = client.patch("/tiers/ghost", json={"description": "x"})
    assert response.status_code == 404
    assert response.json()["field"] == "name"
    assert client.get("/tiers").json()["items"] == []


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/limits/u", {"output_tokens_per_second": 0}, "output_tokens_per_second"),
        ("/limits/u", {"output_tokens_per_second": 1.5}, "output_tokens_per_second"),
        ("/limits/u", {"output_tokens_per_second": "5"}, "output_tokens_per_second"),
        ("/limits/u", {"output_tokens_per_second": 10**9}, "output_tokens_per_second"),
        ("/limits/u", {"tier": "missing"}, "tier"),
        ("/limits/u", {"tier": "bad name!"}, "tier"),
        ("/limits/u", {"rate": 5}, "rate"),
        ("/limits/u", [1], "body"),
        ("/tiers/pro", {"output_tokens_per_second": -1}, "output_tokens_per_second"),
        ("/tiers/pro", {"description": "a\x00b"}, "description"),
        ("/tiers/pro", {"description": 5}, "description"),
    ],
)
def test_bad_patches_name_the_field_and_write_nothing(
    client: TestClient, path: str, body: Any, field: str
) -> None:
    client.put("/tiers/pro", json={"output_tokens_per_second": 100, "description": "paid"})
    client.put("/limits/u", json={"tier": "pro", "output_tokens_per_second": 5})
    before = (version(client), client.get("/limits/u").json(), client.get("/tiers/pro").json())
    response = merge_patch(client, path, body)
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field
    assert field in response.json()["detail"]
    after = (version(client), client.get("/limits/u").json(), client.get("/tiers/pro").json())
    assert after == before


def test_malformed_json_is_refused(client: TestClient) -> None:
    response = client.patch("/limits/u", content="{", headers=MERGE_PATCH)
    assert response.status_code == 422
    assert client.get("/limits").json()["total"] == 0


def test_viewer_cannot_patch(client: TestClient) -> None:
    token = client.post("/tokens", json={"name": "ro"}).json()["token"]
    viewer = {"Authorization": f"Bearer {token}"}
    assert client.patch("/limits/u", json={"tier": None}, headers=viewer).status_code == 403
    assert client.patch("/tiers/x", json={}, headers=viewer).status_code == 403
    assert client.get("/limits").json()["total"] == 0


def test_both_are_in_the_openapi_schema_with_both_media_types(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/limits/{user}", "/tiers/{name}"):
        content = paths[path]["patch"]["requestBody"]["content"]
        assert set(content) == {"application/json", "application/merge-patch+json"}


def test_users_by_substring_and_sorted(client: TestClient) -> None:
    client.put("/tiers/a", json={"output_tokens_per_second": 1})
    client.put("/tiers/b", json={"output_tokens_per_second": 2})
    client.put("/limits/x-team_1", json={"tier": "b", "output_tokens_per_second": 5})
    client.put("/limits/y-team%1", json={"tier": "a"})
    client.put("/limits/z-solo", json={"output_tokens_per_second": 9})

    def users(**params: object) -> list[str]:
        body = client.get("/limits", params=params).json()
        return [i["user"] for i in body["items"]]

    assert users(contains="team") == ["x-team_1", "y-team%1"]
    # % and _ are plain characters, not wildcards.
    assert users(contains="m%") == ["y-team%1"]
    assert users(contains="_") == ["x-team_1"]
    assert client.get("/limits", params={"contains": "team", "tier": "a"}).json()["total"] == 1
    assert users(sort="-user") == ["z-solo", "y-team%1", "x-team_1"]
    assert users(sort="tier") == ["y-team%1", "x-team_1", "z-solo"]
    assert users(sort="-tier") == ["x-team_1", "y-team%1", "z-solo"]
    assert users(sort="-override") == ["z-solo", "x-team_1", "y-team%1"]
    assert users(sort="override", offset=1, limit=1) == ["z-solo"]
    response = client.get("/limits", params={"sort": "tier", "after": "a"})
    assert response.status_code == 422 and response.json()["field"] == "after"
    assert client.get("/limits", params={"sort": "rate"}).json()["field"] == "sort"
    assert users(contains="TEAM") == ["x-team_1", "y-team%1"]


def test_a_substring_is_found_in_any_case_of_any_letter(client: TestClient) -> None:
    """Both databases fold every letter, not only ASCII ones (SQLite's own lower() and
    LIKE fold ASCII only)."""
    for user in ("müller", "Ærø-ÉTÉ", "ascii-Mixed", "muller"):
        client.put(f"/limits/{user}", json={"output_tokens_per_second": 5})

    def users(contains: str) -> list[str]:
        return [
            i["user"] for i in client.get("/limits", params={"contains": contains}).json()["items"]
        ]

    assert users("MÜLLER") == ["müller"]
    assert users("ü") == ["müller"]
    assert users("ærø-été") == ["Ærø-ÉTÉ"]
    assert users("ÆRØ") == ["Ærø-ÉTÉ"]
    assert users("MIXED") == ["ascii-Mixed"]
    assert users("uller") == ["muller"]  # ü is not u


def test_audit_filtered_by_target(client: TestClient) -> None:
    client.put("/tiers/pro", json={"output_tokens_per_second": 100})
    client.put("/limits/alice", json={"tier": "pro"})
    client.patch("/tiers/pro", json={"description": "paid"})
    params = {"target": "pro", "target_kind": "tier"}
    entries = client.get("/audit", params=params).json()["items"]
    assert [e["action"] for e in entries] == ["patch_tier", "put_tier"]
    # Without a kind the target is a user: no user "pro" was changed.
    assert client.get("/audit", params={"target": "pro"}).json()["items"] == []
    assert client.get("/audit", params={"target": "nobody"}).json()["items"] == []


def test_session_says_who_the_token_is(client: TestClient) -> None:
    assert client.get("/session").json() == {"name": "admin", "can_write": True}
    token = client.post("/tokens", json={"name": "dash"}).json()["token"]
    viewer = client.get("/session", headers={"Authorization": f"Bearer {token}"}).json()
    assert viewer == {"name": "viewer:dash", "can_write": False}
    assert client.get("/session", headers={"Authorization": "Bearer wrong"}).status_code == 401
