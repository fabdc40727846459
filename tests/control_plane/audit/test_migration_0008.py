"""Migration 0008 types the audit rows written before it (and indexes past bulk changes'
users); its downgrade gives them back as they were (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, inspect, text

from control_plane.cli import downgrade, upgrade
from tests.control_plane.factories import make_client

REC = {"tier": None, "output_tokens_per_second": 3, "scope": None}
# Rows as revision 0005's code wrote them: (action, target, before, after).
OLD_ROWS: list[tuple[str, str, Any, Any]] = [
    ("put_limit", "default", None, REC),  # a user named "default"
    ("put_default", "default", None, {"output_tokens_per_second": 5, "scope": None}),
    ("put_tier", "pro", None, {"output_tokens_per_second": 9, "scope": None, "description": ""}),
    ("patch_limit", "pro", REC, {**REC, "tier": "pro"}),  # a user named "pro"
    ("create_token", "token:1", None, {"name": "wall", "revoked": False}),
    ("put_limit", "token:1", None, REC),  # a user named "token:1"
    ("bulk_put_limits", "2 users", {"a": None, "pro": REC}, {"a": REC, "pro": REC}),
    ("put_limit", "2 users", None, REC),  # a user named "2 users"
    ("create_key", "a", None, {"id": "abcdefghijkl", "prefix": "ork_abcd", "user": "a"}),
    (
        "revoke_token",
        "token:1",
        {"name": "wall", "revoked": False},
        {"name": "wall", "revoked": True},
    ),
]


def insert_old_rows(engine: Engine) -> None:
    with engine.begin() as conn:
        for version, (action, target, before, after) in enumerate(OLD_ROWS, start=1):
            conn.execute(
                text(
                    "INSERT INTO audit_log (at, version, actor, action, target, before, after)"
                    " VALUES (CURRENT_TIMESTAMP, :v, 'admin', :action, :target, :b, :a)"
                ),
                {
                    "v": version,
                    "action": action,
                    "target": target,
                    "b": json.dumps(before),
                    "a": json.dumps(after),
                },
            )


def rows(engine: Engine, columns: str) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [
            tuple(r) for r in conn.execute(text(f"SELECT {columns} FROM audit_log ORDER BY id"))
        ]


def test_0008_types_existing_rows_and_its_downgrade_restores_them(db_url: str) -> None:
    downgrade(db_url, "0007")
    engine = create_engine(db_url)
    try:
        insert_old_rows(engine)
        old = rows(engine, "id, action, target")
        upgrade(db_url)
        assert rows(engine, "target_kind, target") == [
            ("user", "default"),
            ("default", "default"),
            ("tier", "pro"),
            ("user", "pro"),
            ("token", "1"),
            ("user", "token:1"),
            ("bulk", "2 users"),
            ("user", "2 users"),
            ("user", "a"),
            ("token", "1"),
        ]
        with engine.connect() as conn:
            indexed = conn.execute(text('SELECT "user", audit_id, change FROM audit_targets'))
            found = sorted(
                (u, i, json.loads(c) if isinstance(c, str) else c) for u, i, c in indexed
            )
        assert found == [
            ("a", 7, {"before": None, "after": REC}),
            ("pro", 7, {"before": REC, "after": REC}),
        ]
        # Served on the migrated rows, each name means one thing.
        with make_client(db_url) as client:

            def history(**params: str) -> list[tuple[str, int]]:
                items = client.get("/audit", params=params).json()["items"]
                return [(e["action"], e["version"]) for e in items]

            assert history(target="default") == [("put_limit", 1)]
            assert history(target="pro") == [("bulk_put_limits", 7), ("patch_limit", 4)]
            assert history(target="token:1") == [("put_limit", 6)]
            assert history(target="2 users") == [("put_limit", 8)]
            assert history(target="a") == [("create_key", 9), ("bulk_put_limits", 7)]
            assert history(target="1", target_kind="token") == [
                ("revoke_token", 10),
                ("create_token", 5),
            ]
            assert history(target="pro", target_kind="tier") == [("put_tier", 3)]
            assert history(target_kind="default") == [("put_default", 2)]
            pro = client.get("/audit", params={"target": "pro"}).json()["items"][0]
            assert pro["change"] == {"target": "pro", "before": REC, "after": REC}
            client.app.state.control_plane.db.dispose()  # type: ignore[attr-defined]
        downgrade(db_url, "0007")
        assert "audit_targets" not in inspect(engine).get_table_names()
        assert "target_kind" not in {c["name"] for c in inspect(engine).get_columns("audit_log")}
        assert rows(engine, "id, action, target") == old
        upgrade(db_url)
        assert rows(engine, "target_kind, target")[4] == ("token", "1")
    finally:
        engine.dispose()


def test_0008_refuses_an_action_it_does_not_know(db_url: str) -> None:
    downgrade(db_url, "0007")
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO audit_log (at, version, actor, action, target)"
                    " VALUES (CURRENT_TIMESTAMP, 1, 'admin', 'rename_user', 'x')"
                )
            )
        with pytest.raises(RuntimeError, match="rename_user"):
            upgrade(db_url)
    finally:
        engine.dispose()
