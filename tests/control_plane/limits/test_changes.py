"""The change log the push server relies on: one row per version, ops that replay."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from control_plane.config import service as config
from output_rate_core.protocol import Snapshot


def replay(changes: list[tuple[int, list[dict[str, Any]]]]) -> Snapshot:
    state = Snapshot(version=0, default_rate=None, tiers={}, users={})
    tiers, users = dict(state.tiers), dict(state.users)
    default: int | None = None
    version = 0
    for number, ops in changes:
        assert number == version + 1
        version = number
        for op in ops:
            kind = op["op"]
            if kind == "set_user":
                users[op["user"]] = (op["tier"], op["rate"])
            elif kind == "delete_user":
                del users[op["user"]]
            elif kind == "set_tier":
                tiers[op["name"]] = op["rate"]
            elif kind == "delete_tier":
                del tiers[op["name"]]
            else:
                assert kind == "set_default"
                default = op["rate"]
    return Snapshot(version=version, default_rate=default, tiers=tiers, users=users)


def test_replaying_the_change_log_gives_the_snapshot(client: TestClient) -> None:
    client.put("/tiers/gold", json={"output_tokens_per_second": 500})
    client.put("/tiers/old", json={"output_tokens_per_second": 1})
    client.put("/default-limit", json={"output_tokens_per_second": 10})
    client.put("/limits/a", json={"tier": "gold"})
    client.put("/limits/b", json={"output_tokens_per_second": 7})
    client.put("/limits/a", json={"tier": "gold"})  # no-op: no version
    client.post(
        "/limits:bulk", json={"items": [{"user": f"u{i}", "tier": "gold"} for i in range(5)]}
    )
    client.delete("/limits/b")
    client.delete("/tiers/old")
    client.put("/tiers/gold", json={"output_tokens_per_second": None})
    client.put("/default-limit", json={"output_tokens_per_second": None})
    db = client.app.state.control_plane.db  # type: ignore[attr-defined]
    snapshot = db.read_now(config.load_snapshot)
    changes = db.read_now(config.changes_since, 0)
    assert [v for v, _ in changes] == list(range(1, snapshot.version + 1))
    assert snapshot.version == 10
    assert replay(changes) == snapshot
    assert snapshot.tiers == {"gold": None}
    assert snapshot.users["u3"] == ("gold", None)
    bulk = changes[5][1]
    assert len(bulk) == 5 and {op["op"] for op in bulk} == {"set_user"}
    assert db.read_now(config.changes_since, 9) == changes[9:]
