"""API keys over REST on the real app and a real database (SQLite and PostgreSQL): the key
shows once, only its hash is stored, every write is one audited version, the bounds hold."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from control_plane.app import create_app
from control_plane.config import service as config
from control_plane.db import Database
from control_plane.keys import repository as key_repo
from control_plane.keys.bucket import TokenBucket
from harness.control_plane import ADMIN_TOKEN, fresh_database, serve
from output_rate_core import keys
from output_rate_core import protocol as p
from tests.control_plane.factories import make_settings


def database(client: TestClient) -> Database:
    db: Database = client.app.state.control_plane.db  # type: ignore[attr-defined]
    return db


def version(client: TestClient) -> int:
    return int(client.get("/engines").json()["version"])


def stored_hash(client: TestClient, key_id: str) -> str | None:
    row = database(client).read_now(key_repo.get_key, key_id)
    return None if row is None else row.key_hash


def viewer_headers(client: TestClient) -> dict[str, str]:
    token = client.post("/tokens", json={"name": "viewer"}).json()["token"]
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def bounded(db_url: str) -> Iterator[TestClient]:
    """Three keys per user; a burst of five creations, then one a minute."""
    settings = make_settings(
        db_url, max_keys_per_user=3, key_creation_burst=5, key_creations_per_minute=1
    )
    app = create_app(settings)
    with TestClient(app) as c:
        c.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        yield c
    app.state.control_plane.db.dispose()


def test_create_list_revoke_and_the_key_shows_only_once(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    created = []
    for user, body in (("alice", None), ("alice", {}), ("bob smith", None)):
        response = client.post(f"/users/{user}/keys", json=body)
        assert response.status_code == 201, response.text
        created.append(response.json())
    assert [set(c) for c in created] == [{"id", "key", "user", "created_at"}] * 3
    assert [c["user"] for c in created] == ["alice", "alice", "bob smith"]
    for c in created:
        assert keys.key_id_of(c["key"]) == c["id"]
        # Only the hash is stored, and it is the key's.
        assert stored_hash(client, c["id"]) == keys.hash_key(c["key"])
    assert len({c["key"] for c in created}) == 3

    listed = client.get("/users/alice/keys").json()
    assert listed == {
        "items": [
            {
                "id": c["id"],
                "prefix": f"ork_{c['id']}",
                "created_at": c["created_at"],
                "last_used_at": None,
            }
            for c in created[:2]
        ]
    }
    assert [k["id"] for k in client.get("/users/bob%20smith/keys").json()["items"]] == [
        created[2]["id"]
    ]
    assert client.get("/users/nobody/keys").json() == {"items": []}

    assert client.delete(f"/keys/{created[0]['id']}").status_code == 204
    assert [k["id"] for k in client.get("/users/alice/keys").json()["items"]] == [created[1]["id"]]
    assert stored_hash(client, created[0]["id"]) is None
    again = client.delete(f"/keys/{created[0]['id']}")
    assert (again.status_code, again.json()["field"]) == (404, "id")

    # One version per write, gap-free, each with exactly its key op.
    assert version(client) == 4
    changes = database(client).read_now(config.changes_since, 0)
    assert [v for v, _ in changes] == [1, 2, 3, 4]
    ops = [p.ops_from_rows(rows) for _, rows in changes]
    assert ops == [[p.SetKey(c["id"], c["user"], keys.hash_key(c["key"]))] for c in created] + [
        [p.DeleteKey(created[0]["id"])]
    ]

    # One audit entry per write, naming the user; id, prefix and user only.
    entries = client.get("/audit").json()["items"][::-1]
    assert [(e["version"], e["action"], e["target"]) for e in entries] == [
        (1, "create_key", "alice"),
        (2, "create_key", "alice"),
        (3, "create_key", "bob smith"),
        (4, "revoke_key", "alice"),
    ]
    record = {"id": created[0]["id"], "prefix": f"ork_{created[0]['id']}", "user": "alice"}
    assert (entries[0]["before"], entries[0]["after"]) == (None, record)
    assert (entries[3]["before"], entries[3]["after"]) == (record, None)

    # Neither a key nor its hash in anything a reader or the log sees.
    responses = [
        client.get(path)
        for path in (
            "/users/alice/keys",
            "/users/bob%20smith/keys",
            "/audit",
            f"/audit/{entries[0]['id']}/changes",
            "/engines",
            "/limits",
            "/metrics",
            "/openapi.json",
        )
    ]
    assert all(r.status_code == 200 for r in responses)
    seen = "\n".join(r.text for r in responses) + caplog.text
    for c in created:
        assert c["key"] not in seen
        assert c["key"].split("_", 2)[2] not in seen
        assert keys.hash_key(c["key"]) not in seen


def test_viewers_list_keys_but_cannot_create_or_revoke_them(client: TestClient) -> None:
    key_id = client.post("/users/alice/keys").json()["id"]
    viewer = viewer_headers(client)
    assert [k["id"] for k in client.get("/users/alice/keys", headers=viewer).json()["items"]] == [
        key_id
    ]
    assert client.post("/users/alice/keys", headers=viewer).status_code == 403
    assert client.post("/users/alice/keys", json={}, headers=viewer).status_code == 403
    assert client.delete(f"/keys/{key_id}", headers=viewer).status_code == 403
    assert client.get(
        "/users/alice/keys", headers={"Authorization": "Bearer nope"}
    ).status_code == (401)
    assert client.post("/users/alice/keys", headers={"Authorization": ""}).status_code == 401
    assert len(client.get("/users/alice/keys").json()["items"]) == 1
    assert version(client) == 1


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("POST", "/users/a%00b/keys", None, "user"),
        ("POST", "/users/" + "x" * 257 + "/keys", None, "user"),
        ("POST", "/users/%EF%BF%BD/keys", None, "user"),
        ("GET", "/users/a%1Fb/keys", None, "user"),
        ("POST", "/users/alice/keys", {"name": "ci"}, "name"),
        ("POST", "/users/alice/keys", [], "body"),
        ("POST", "/users/alice/keys", "key", "body"),
        ("DELETE", "/keys/ABCDEFGHIJKL", None, "id"),
        ("DELETE", "/keys/abc", None, "id"),
        ("DELETE", "/keys/" + "a" * 13, None, "id"),
        ("DELETE", "/keys/aaaaaaaaaaaa", None, "id"),
    ],
)
def test_bad_user_ids_bodies_and_key_ids_name_the_field(
    client: TestClient, method: str, path: str, body: object, field: str
) -> None:
    response = client.request(method, path, json=body)
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["field"] == field, response.text
    assert version(client) == 0


def test_a_user_holds_at_most_n_keys(bounded: TestClient) -> None:
    ids = [bounded.post("/users/alice/keys").json()["id"] for _ in range(3)]
    refused = bounded.post("/users/alice/keys")
    assert (refused.status_code, refused.json()["field"]) == (409, "user")
    assert "OUTPUT_RATE_MAX_KEYS_PER_USER" in refused.json()["detail"]
    assert len(bounded.get("/users/alice/keys").json()["items"]) == 3
    # Another user is not bound by alice's keys; a revoked key frees its place.
    assert bounded.post("/users/bob/keys").status_code == 201
    assert bounded.delete(f"/keys/{ids[0]}").status_code == 204
    assert bounded.post("/users/alice/keys").status_code == 201
    assert version(bounded) == 6  # 5 creations and a revocation; the 409 wrote nothing


def test_creations_past_the_burst_get_429_with_retry_after(bounded: TestClient) -> None:
    statuses = [bounded.post(f"/users/u{i}/keys").status_code for i in range(8)]
    assert statuses == [201] * 5 + [429] * 3
    refused = bounded.post("/users/z/keys")
    assert refused.status_code == 429
    assert "OUTPUT_RATE_KEY_CREATIONS_PER_MINUTE" in refused.json()["detail"]
    # One a minute: the next token is about a minute away.
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert version(bounded) == 5
    assert bounded.get("/users/z/keys").json() == {"items": []}


def test_the_409_takes_no_token(bounded: TestClient) -> None:
    for _ in range(3):
        assert bounded.post("/users/a/keys").status_code == 201
    for _ in range(5):
        assert bounded.post("/users/a/keys").status_code == 409
    assert bounded.post("/users/b/keys").status_code == 201
    assert bounded.post("/users/c/keys").status_code == 201
    assert bounded.post("/users/d/keys").status_code == 429


def test_the_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    # A fake clock: the one seam, so that a minute passes at once.
    now = [100.0]
    bucket = TokenBucket(per_minute=6, burst=2, clock=lambda: now[0])
    assert [bucket.take(), bucket.take()] == [0.0, 0.0]
    assert bucket.take() == pytest.approx(10.0)  # 6 a minute: one every 10 s
    now[0] += 4.0
    assert bucket.take() == pytest.approx(6.0)
    now[0] += 6.0
    assert bucket.take() == 0.0
    now[0] += 3600.0  # an idle hour refills the burst, no more
    assert [bucket.take(), bucket.take()] == [0.0, 0.0]
    assert bucket.take() > 0


def test_the_routes_are_in_the_openapi_schema(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    create = paths["/users/{user}/keys"]["post"]
    assert set(create["responses"]) >= {"201", "401", "403", "409", "422", "429"}
    assert create["responses"]["201"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/KeyCreated"
    }
    assert create.get("requestBody", {}).get("required") is not True
    listed = paths["/users/{user}/keys"]["get"]["responses"]["200"]
    assert listed["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/KeyList"
    }
    assert set(paths["/keys/{id}"]["delete"]["responses"]) >= {"204", "404", "422"}
    components = schema["components"]["schemas"]
    assert set(components["KeyOut"]["properties"]) == {"id", "prefix", "created_at", "last_used_at"}
    assert set(components["KeyCreated"]["properties"]) == {"id", "key", "user", "created_at"}
    assert "api_applied_version" in components["EngineOut"]["properties"]


def test_a_served_process_never_logs_a_key_or_its_hash(tmp_path: Path) -> None:
    with (
        fresh_database("sqlite", tmp_path) as url,
        serve(url, tmp_path, extra_args=("--access-log",)) as served,
        served.client() as api,
    ):
        made = [api.post("/users/alice/keys").json() for _ in range(2)]
        assert api.get("/users/alice/keys").status_code == 200
        assert api.delete(f"/keys/{made[0]['id']}").status_code == 204
        assert api.get("/audit").status_code == 200
        metrics = api.get("/metrics").text
    log = served.log.read_text()
    assert "POST /users/alice/keys" in log  # the access log is on
    for made_key in made:
        for secret in (made_key["key"], keys.hash_key(made_key["key"])):
            assert secret not in log and secret not in metrics
