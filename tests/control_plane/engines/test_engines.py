"""GET /engines forgets engines gone longer than the retention; DELETE /engines/{id}."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient
from sqlalchemy import insert

from control_plane.db import Database
from control_plane.engines import repository as repo
from control_plane.engines import service as engines


def _seen(db: Database, engine_id: str, ago_s: float) -> None:
    at = datetime.now(UTC) - timedelta(seconds=ago_s)

    def add(conn, **_: object) -> None:  # type: ignore[no-untyped-def]
        conn.execute(
            insert(repo.engines).values(
                engine_id=engine_id,
                model="m",
                applied_version=0,
                connected=False,
                first_seen=at,
                last_seen=at,
            )
        )

    db.write_now(add)


def test_ghost_engines_expire_and_can_be_deleted(client: TestClient) -> None:
    db: Database = client.app.state.control_plane.db  # type: ignore[attr-defined]
    retention = client.app.state.control_plane.settings.engine_retention_s  # type: ignore[attr-defined]
    for i in range(300):  # 300 ghost HELLOs of long ago
        _seen(db, f"ghost-{i}", retention + 60)
    _seen(db, "recent", 10)
    listed = client.get("/engines").json()["items"]
    assert [e["engine_id"] for e in listed] == ["recent"]
    assert db.write_now(engines.forget_engines, retention_s=retention) == 300
    assert db.write_now(engines.forget_engines, retention_s=retention) == 0
    assert client.delete("/engines/recent").status_code == 204
    assert client.get("/engines").json()["items"] == []
    gone = client.delete("/engines/recent")
    assert gone.status_code == 404 and gone.json()["field"] == "engine_id"
    assert client.delete("/engines/a%2Fb").status_code in (404, 422)
    assert client.delete("/engines/" + "x" * 300).status_code == 422


def test_viewers_cannot_delete_engines(client: TestClient) -> None:
    db: Database = client.app.state.control_plane.db  # type: ignore[attr-defined]
    _seen(db, "e1", 1)
    viewer = client.post("/tokens", json={"name": "v"}).json()["token"]
    refused = client.delete("/engines/e1", headers={"Authorization": f"Bearer {viewer}"})
    assert refused.status_code == 403
    assert [e["engine_id"] for e in client.get("/engines").json()["items"]] == ["e1"]


def test_bulk_refuses_user_ids_no_route_can_address(client: TestClient) -> None:
    for bad in ("a/b", "\ufffd", "nul\x00", "x" * 257):
        r = client.post("/limits:bulk", json={"items": [{"user": "ok"}, {"user": bad}]})
        assert r.status_code == 422 and r.json()["field"] == "items.1.user", bad
    assert client.get("/limits").json()["total"] == 0


def test_home_names_the_replica_holding_the_engine(client: TestClient) -> None:
    db: Database = client.app.state.control_plane.db  # type: ignore[attr-defined]
    now = datetime.now(UTC)
    stale = now - timedelta(seconds=60)

    def add(conn, **_: object) -> None:  # type: ignore[no-untyped-def]
        row = {"model": "m", "applied_version": 1, "connected": True, "first_seen": stale}
        conn.execute(
            insert(repo.engines),
            [
                {
                    **row,
                    "engine_id": "on-a",
                    "last_seen": now,
                    "home_replica": "a",
                    "home_seen_at": now,
                },
                {
                    **row,
                    "engine_id": "silent",
                    "last_seen": stale,
                    "home_replica": "a",
                    "home_seen_at": stale,
                },
                {
                    **row,
                    "engine_id": "single",
                    "last_seen": now,
                    "home_replica": None,
                    "home_seen_at": None,
                },
            ],
        )

    db.write_now(add)

    def homes() -> dict[str, str | None]:
        return {e["engine_id"]: e["home"] for e in client.get("/engines").json()["items"]}

    # A replica that stopped hearing its engine holds it no more; one control plane on
    # its own (no replica id) homes nobody.
    assert homes() == {"on-a": "a", "silent": None, "single": None}
    # The replica lets go of it (its connection timed out, or it shuts down).
    db.write_now(engines.disconnect_engines, engine_ids=["on-a"], replica="a")
    assert homes()["on-a"] is None
