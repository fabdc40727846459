"""GET /engines forgets engines gone longer than the retention; DELETE /engines/{id}; the
flags of implausible demand on each row."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient
from sqlalchemy import insert

from control_plane.db import Database
from control_plane.engines import repository as repo
from control_plane.engines import service as engines
from control_plane.push.flagged import MAX_FLAGGED_IDS, FlaggedDemands
from output_rate_core import protocol as p


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


def test_each_engine_shows_the_vllm_version_its_core_said(client: TestClient) -> None:
    db: Database = client.app.state.control_plane.db  # type: ignore[attr-defined]
    now = datetime.now(UTC)

    def seen(engine_id: str, vllm_version: str | None, role: p.Role = p.ENGINE_ROLE) -> None:
        row = engines.EngineSeen(engine_id, "tiny", 1, now, role, vllm_version)
        db.write_now(engines.record_engines, seen=[row])

    def versions() -> dict[str, str | None]:
        items = client.get("/engines").json()["items"]
        return {e["engine_id"]: e["vllm_version"] for e in items}

    seen("on-32", "0.32.0")
    seen("on-34", "0.34.0")
    seen("old-build", "")  # a HELLO from before engines said it
    seen("api-only", "0.33.0", p.API_ROLE)  # the row is the core's: its API server's is not kept
    assert versions() == {
        "api-only": None,
        "old-build": None,
        "on-32": "0.32.0",
        "on-34": "0.34.0",
    }
    # Bound by a heartbeat after a restart (it said nothing of its vLLM): the row keeps
    # what it had; a new HELLO says the version it runs now, or that it is not known.
    seen("on-32", None)
    seen("on-34", "0.34.0+cu129")
    seen("old-build", "0.33.0")
    assert versions() == {
        "api-only": None,
        "old-build": "0.33.0",
        "on-32": "0.32.0",
        "on-34": "0.34.0+cu129",
    }
    seen("on-34", "")
    seen("api-only", "0.34.0")
    seen("api-only", "0.33.0", p.API_ROLE)
    assert versions() == {
        "api-only": "0.34.0",
        "old-build": "0.33.0",
        "on-32": "0.32.0",
        "on-34": None,
    }


def test_each_engine_shows_the_implausible_demand_flagged_here(client: TestClient) -> None:
    """The replica's flags (control_plane/push/flagged.py, written by its push dispatcher)
    on the engine's row: how many frames, the last one's time and claim."""
    state = client.app.state.control_plane  # type: ignore[attr-defined]
    _seen(state.db, "honest", 1)
    _seen(state.db, "rogue", 1)
    before = datetime.now(UTC)
    state.flagged.note("rogue", "9007199254740992 streams of one user (capacity 256)")
    state.flagged.note("rogue", "demand for over 20000 users")
    rows = {e["engine_id"]: e for e in client.get("/engines").json()["items"]}
    assert rows["rogue"]["implausible_demands"] == 2
    assert rows["rogue"]["last_implausible_demand"] == "demand for over 20000 users"
    assert datetime.fromisoformat(rows["rogue"]["last_implausible_demand_at"]) >= before
    assert rows["honest"]["implausible_demands"] == 0
    assert rows["honest"]["last_implausible_demand_at"] is None
    assert rows["honest"]["last_implausible_demand"] is None


def test_flags_are_kept_for_the_most_recently_flagged_ids() -> None:
    flagged = FlaggedDemands()
    for i in range(MAX_FLAGGED_IDS + 1):
        flagged.note(f"e{i}", "claim")
    flagged.note("e1", "again")  # flagged again: the most recent now
    flagged.note("new", "claim")
    assert flagged.of("e0") is None and flagged.of("e2") is None
    again = flagged.of("e1")
    assert again is not None and again.num_flagged == 2 and again.last_reason == "again"
    assert flagged.of("new") is not None
