"""App wiring: start-up refusal, on_commit hooks, counters, error bodies, timestamps."""

from __future__ import annotations

from datetime import datetime

import pytest
from fastapi.testclient import TestClient

from control_plane.app import create_app
from control_plane.db import Commit
from control_plane.errors import ConfigurationError
from control_plane.settings import Settings
from harness.control_plane import ADMIN_TOKEN
from tests.control_plane.factories import make_settings


def test_refuses_to_start_without_an_admin_token(db_url: str) -> None:
    with pytest.raises(ConfigurationError, match="OUTPUT_RATE_ADMIN_TOKEN"):
        create_app(Settings(database_url=db_url))


def test_insecure_no_auth_lets_anyone_write(db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(Settings(database_url=db_url), insecure_no_auth=True)
    assert "AUTHENTICATION IS DISABLED" in caplog.text
    with TestClient(app) as client:
        assert client.put("/limits/a", json={"output_tokens_per_second": 3}).status_code == 200
        assert client.get("/audit").json()["items"][0]["actor"] == "anonymous-admin"
    app.state.control_plane.db.dispose()


def test_on_commit_hooks_get_each_new_version_once(db_url: str) -> None:
    app = create_app(make_settings(db_url))
    seen: list[Commit] = []

    def broken(_commit: Commit) -> None:
        raise RuntimeError("a failing hook must not fail the write")

    app.state.control_plane.db.on_commit.extend([seen.append, broken])
    with TestClient(app) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
        assert client.put("/limits/a", json={"output_tokens_per_second": 3}).status_code == 200
        assert client.put("/limits/a", json={"output_tokens_per_second": 3}).status_code == 200
        assert client.put("/default-limit", json={"output_tokens_per_second": 9}).status_code == 200
        assert client.put("/limits/b", json={"tier": "missing"}).status_code == 422
        assert client.delete("/limits/nobody").status_code == 204
        assert [commit.version for commit in seen] == [1, 2]
    app.state.control_plane.db.dispose()


def test_totals_and_tier_counts_follow_every_kind_of_write(client: TestClient) -> None:
    def totals() -> tuple[int, int, int]:
        return (
            client.get("/limits").json()["total"],
            client.get("/limits?tier=a").json()["total"],
            client.get("/tiers/b").json()["num_users"],
        )

    client.put("/tiers/a", json={"output_tokens_per_second": 10})
    client.put("/tiers/b", json={"output_tokens_per_second": 20})
    client.put("/limits/u1", json={"tier": "a"})
    client.put("/limits/u2", json={"tier": "a"})
    client.put("/limits/u3", json={"output_tokens_per_second": 5})
    assert totals() == (3, 2, 0)
    client.put("/limits/u1", json={"tier": "b"})
    assert totals() == (3, 1, 1)
    items = [{"user": "u2", "tier": "b"}, {"user": "u4", "tier": "a"}, {"user": "u5"}]
    assert client.post("/limits:bulk", json={"items": items}).json()["num_changed"] == 3
    assert totals() == (5, 1, 2)
    client.delete("/limits/u1")
    assert totals() == (4, 1, 1)
    # The counters agree with the rows they summarize.
    rows = client.get("/limits?limit=1000").json()["items"]
    assert len(rows) == 4
    assert sum(r["tier"] == "b" for r in rows) == 1
    assert client.get("/limits?q=u&tier=a").json()["total"] == 1


def test_errors_name_the_field_in_one_shape(client: TestClient) -> None:
    response = client.put("/limits/u", json={"output_tokens_per_second": 0})
    body = response.json()
    assert response.status_code == 422
    assert body["field"] == "output_tokens_per_second"
    assert body["detail"].startswith("output_tokens_per_second: ")
    response = client.put("/limits/u", json={"tier": "missing"})
    assert (response.status_code, response.json()["field"]) == (422, "tier")
    items = [{"user": "x"}, {"user": "y"}, {"user": "x"}]
    response = client.post("/limits:bulk", json={"items": items})
    assert (response.status_code, response.json()["field"]) == (422, "items.2.user")
    items = [{"user": "x"}, {"user": "y", "tier": "nope"}]
    response = client.post("/limits:bulk", json={"items": items})
    assert (response.status_code, response.json()["field"]) == (422, "items.1.tier")
    response = client.post(
        "/limits:bulk", json={"items": [{"user": "z", "output_tokens_per_second": 1.5}]}
    )
    assert response.json()["field"] == "items.0.output_tokens_per_second"
    assert client.get("/engines").json()["version"] == 0


def test_anonymous_requests_get_401_with_a_challenge(client: TestClient) -> None:
    response = client.put(
        "/limits/u", json={"output_tokens_per_second": 1}, headers={"Authorization": ""}
    )
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert client.get("/metrics", headers={"Authorization": "Basic abc"}).status_code == 401
    assert client.get("/engines").json()["version"] == 0


def test_timestamps_are_timezone_aware(client: TestClient) -> None:
    client.put("/limits/u", json={"output_tokens_per_second": 1})
    at = datetime.fromisoformat(client.get("/audit").json()["items"][0]["at"])
    assert at.utcoffset() is not None and at.utcoffset().total_seconds() == 0  # type: ignore[union-attr]


def test_tier_description_is_kept_unless_given(client: TestClient) -> None:
    client.put("/tiers/t", json={"output_tokens_per_second": 5, "description": "trial"})
    client.put("/tiers/t", json={"output_tokens_per_second": 6})
    assert client.get("/tiers/t").json()["description"] == "trial"
    assert client.delete("/tiers/missing").status_code == 404


def test_control_characters_are_refused_everywhere(client: TestClient) -> None:
    # PostgreSQL cannot store NUL: it must be a 422, never a 500.
    response = client.put("/tiers/x", json={"description": "a\u0000b"})
    assert (response.status_code, response.json()["field"]) == (422, "description")
    response = client.post("/tokens", json={"name": "a\u0000b"})
    assert (response.status_code, response.json()["field"]) == (422, "name")
    assert client.put("/limits/a%00b", json={}).status_code == 422
    assert client.get("/limits?q=a%00").status_code == 422
    assert client.put("/tiers/y", json={"description": "two\nlines\tok"}).status_code == 200
    assert client.get("/engines").json()["version"] == 1
