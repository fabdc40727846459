"""The REST contract on the real app and a real database (SQLite and PostgreSQL)."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient


def version(client: TestClient) -> int:
    return client.get("/engines").json()["version"]


def audit_count(client: TestClient) -> int:
    return len(client.get("/audit?limit=1000").json()["items"])


def test_unknown_user_gets_the_default(client: TestClient) -> None:
    view = client.get("/limits/nobody").json()
    assert view == {
        "user": "nobody",
        "tier": None,
        "output_tokens_per_second": None,
        "effective_output_tokens_per_second": None,
        "source": "default",
        "scope": None,
        "effective_scope": "fleet",
        "enforcement": None,
        "ceiling_output_tokens_per_second": None,
        "effective_enforcement": "enforce",
        "effective_ceiling_output_tokens_per_second": None,
        "shares": [],
        "version": 0,
        "received_output_tokens_per_second": None,
    }
    assert client.put("/default-limit", json={"output_tokens_per_second": 30}).status_code == 200
    assert client.get("/limits/nobody").json()["effective_output_tokens_per_second"] == 30
    assert client.get("/default-limit").json()["output_tokens_per_second"] == 30


def test_effective_rate_override_then_tier_then_default(client: TestClient) -> None:
    client.put("/default-limit", json={"output_tokens_per_second": 10})
    assert client.put("/tiers/gold", json={"output_tokens_per_second": 500}).status_code == 200
    view = client.put("/limits/u1", json={"tier": "gold"}).json()
    assert (view["effective_output_tokens_per_second"], view["source"]) == (500, "tier")
    view = client.put("/limits/u1", json={"tier": "gold", "output_tokens_per_second": 7}).json()
    assert (view["effective_output_tokens_per_second"], view["source"]) == (7, "override")
    assert client.delete("/limits/u1").status_code == 204
    view = client.get("/limits/u1").json()
    assert (view["effective_output_tokens_per_second"], view["source"]) == (10, "default")


def test_every_write_bumps_one_version_and_same_put_twice_writes_once(client: TestClient) -> None:
    assert version(client) == 0
    client.put("/limits/a", json={"output_tokens_per_second": 20})
    assert version(client) == 1
    assert audit_count(client) == 1
    again = client.put("/limits/a", json={"output_tokens_per_second": 20})
    assert again.status_code == 200
    assert version(client) == 1
    assert audit_count(client) == 1
    entry = client.get("/audit").json()["items"][0]
    assert entry["actor"] == "admin"
    assert entry["action"] == "put_limit"
    assert entry["target"] == "a"
    assert entry["before"] is None
    assert entry["after"] == {
        "tier": None,
        "output_tokens_per_second": 20,
        "scope": None,
        "enforcement": None,
        "ceiling_output_tokens_per_second": None,
    }


def test_tier_rate_change_is_one_version_for_all_its_users(client: TestClient) -> None:
    client.put("/tiers/free", json={"output_tokens_per_second": 20, "description": "free"})
    for i in range(5):
        client.put(f"/limits/u{i}", json={"tier": "free"})
    before = version(client)
    client.put("/tiers/free", json={"output_tokens_per_second": 40})
    assert version(client) == before + 1
    items = client.get("/limits?tier=free").json()["items"]
    assert [i["effective_output_tokens_per_second"] for i in items] == [40] * 5
    tier = client.get("/tiers/free").json()
    assert tier == {
        "name": "free",
        "output_tokens_per_second": 40,
        "scope": None,
        "enforcement": None,
        "ceiling_output_tokens_per_second": None,
        "description": "free",
        "num_users": 5,
        "version": before + 1,
    }


def test_tier_delete_conflicts_while_users_are_assigned(client: TestClient) -> None:
    client.put("/tiers/t", json={"output_tokens_per_second": 5})
    client.put("/limits/x", json={"tier": "t"})
    response = client.delete("/tiers/t")
    assert response.status_code == 409
    assert client.get("/tiers/t").status_code == 200
    client.delete("/limits/x")
    assert client.delete("/tiers/t").status_code == 204
    assert client.get("/tiers/t").status_code == 404
    assert client.get("/tiers").json() == {"items": []}


def test_pagination_and_filters(client: TestClient) -> None:
    client.put("/tiers/pro", json={"output_tokens_per_second": 100})
    users = {"alice-1": "pro", "alice-2": None, "bob": "pro", "carol_%": None}
    for user, tier in users.items():
        client.put(f"/limits/{user}", json={"tier": tier, "output_tokens_per_second": 3})
    page = client.get("/limits?offset=1&limit=2").json()
    assert page["total"] == 4
    assert [i["user"] for i in page["items"]] == ["alice-2", "bob"]
    assert [i["user"] for i in client.get("/limits?q=alice").json()["items"]] == [
        "alice-1",
        "alice-2",
    ]
    assert client.get("/limits?q=carol_").json()["total"] == 1
    assert client.get("/limits?q=%25").json()["total"] == 0
    assert [i["user"] for i in client.get("/limits?tier=pro").json()["items"]] == ["alice-1", "bob"]


def test_cursor_pages_cover_every_user_once_in_order(client: TestClient) -> None:
    client.put("/tiers/pro", json={"output_tokens_per_second": 100})
    users = sorted(f"u-{i:02d}" for i in range(23))
    body = {"items": [{"user": u, "tier": "pro" if i % 2 else None} for i, u in enumerate(users)]}
    assert client.post("/limits:bulk", json=body).status_code == 200

    def walk(query: str) -> tuple[list[str], set[int]]:
        seen: list[str] = []
        totals: set[int] = set()
        after = ""
        while True:
            page = client.get(f"/limits?limit=5{query}{after}").json()
            totals.add(page["total"])
            seen += [item["user"] for item in page["items"]]
            if len(page["items"]) < 5:
                return seen, totals
            after = f"&after={seen[-1]}"

    assert walk("") == (users, {23})
    assert walk("&tier=pro") == (users[1::2], {11})
    assert walk("&q=u-1") == ([u for u in users if u.startswith("u-1")], {10})
    # An id that is not configured is still a valid position.
    page = client.get("/limits?after=u-10a&limit=2").json()
    assert [i["user"] for i in page["items"]] == ["u-11", "u-12"]
    response = client.get("/limits?after=a%00b")
    assert response.status_code == 422 and response.json()["field"] == "after"


def test_bulk_is_atomic_and_one_version(client: TestClient) -> None:
    client.put("/tiers/pro", json={"output_tokens_per_second": 100})
    items = [{"user": f"bulk-{i}", "output_tokens_per_second": i + 1} for i in range(500)]
    response = client.post("/limits:bulk", json={"items": items})
    assert response.status_code == 200
    assert response.json() == {"version": 2, "num_changed": 500}
    assert client.get("/limits?q=bulk-").json()["total"] == 500
    bad = [*items[:10], {"user": "new", "tier": "missing"}]
    response = client.post("/limits:bulk", json={"items": bad})
    assert response.status_code == 422
    assert "tier" in response.text
    assert client.get("/limits/new").json()["source"] == "default"
    assert version(client) == 2
    too_many = [{"user": f"x{i}"} for i in range(10_001)]
    assert client.post("/limits:bulk", json={"items": too_many}).status_code == 422


BAD_BODIES = [
    ({"output_tokens_per_second": 0}, "output_tokens_per_second"),
    ({"output_tokens_per_second": -5}, "output_tokens_per_second"),
    ({"output_tokens_per_second": 2.5}, "output_tokens_per_second"),
    ({"output_tokens_per_second": 1_000_001}, "output_tokens_per_second"),
    ({"output_tokens_per_second": "10"}, "output_tokens_per_second"),
    ({"output_tokens_per_second": True}, "output_tokens_per_second"),
    ({"tier": "no-such-tier"}, "tier"),
    ({"tier": 5}, "tier"),
    ({"unknown_field": 1}, "unknown_field"),
    ([1, 2], "body"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES)
def test_bad_input_names_the_field_and_writes_nothing(
    client: TestClient, body: object, field: str
) -> None:
    response = client.put("/limits/u", json=body)
    assert 400 <= response.status_code < 500
    assert field in response.text
    assert version(client) == 0
    assert client.get("/limits/u").json()["source"] == "default"


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b'{"output_tokens_per_second": NaN}', b'{"output_tokens_per_second": 1e400}'],
)
def test_malformed_json_is_a_4xx(client: TestClient, raw: bytes) -> None:
    response = client.put("/limits/u", content=raw, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500
    assert version(client) == 0


@pytest.mark.parametrize("user", ["a" * 257, "bad\x01id", "tab\tid"])
def test_bad_user_ids_are_rejected(client: TestClient, user: str) -> None:
    response = client.put(f"/limits/{quote(user)}", json={"output_tokens_per_second": 5})
    assert 400 <= response.status_code < 500
    assert "user" in response.text
    assert version(client) == 0


def test_auth(client: TestClient) -> None:
    anonymous = {"Authorization": ""}
    assert client.get("/limits", headers=anonymous).status_code == 401
    assert client.get("/limits", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/healthz", headers=anonymous).status_code == 200
    created = client.post("/tokens", json={"name": "dashboard"})
    assert created.status_code == 201
    viewer = {"Authorization": f"Bearer {created.json()['token']}"}
    assert client.get("/limits", headers=viewer).status_code == 200
    assert client.get("/tokens", headers=viewer).status_code == 403
    response = client.put("/limits/x", json={"output_tokens_per_second": 5}, headers=viewer)
    assert response.status_code == 403
    assert version(client) == 0
    tokens = client.get("/tokens").json()["items"]
    assert tokens[0]["name"] == "dashboard"
    assert "token" not in tokens[0]
    assert client.delete(f"/tokens/{tokens[0]['id']}").status_code == 204
    assert client.get("/limits", headers=viewer).status_code == 401


def test_metrics(client: TestClient) -> None:
    client.put("/tiers/pro", json={"output_tokens_per_second": 100})
    client.put("/limits/a", json={"tier": "pro"})
    body = client.get("/metrics").text
    assert "output_rate_config_version 2.0" in body
    assert 'output_rate_users{tier="pro"} 1.0' in body
    assert (
        'output_rate_http_requests_total{method="PUT",route="/limits/{user}",status="200"}' in body
    )


@pytest.mark.parametrize("dots", [".", ".."])
def test_dot_segment_user_ids_are_refused_in_paths_and_bulk(client: TestClient, dots: str) -> None:
    # No browser can address /limits/. or /limits/.. (dot segments are removed), so such
    # a user could never be opened, edited or deleted: it is never created.
    encoded = dots.replace(".", "%2E")
    response = client.put(f"/limits/{encoded}", json={"output_tokens_per_second": 5})
    assert response.status_code == 422
    assert response.json()["field"] == "user"
    response = client.post(
        "/limits:bulk", json={"items": [{"user": dots, "output_tokens_per_second": 5}]}
    )
    assert response.status_code == 422
    assert "items.0.user" in response.text
    assert version(client) == 0
