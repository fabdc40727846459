"""Audit targets are typed: a user named like a tier, the default, a token or a bulk
change gets only its own entries; a bulk change is in the history of every user it
changed, paged with the user's own entries (SQLite and PostgreSQL)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, select

from control_plane.audit.service import MAX_AUDIT_INLINE_BYTES
from control_plane.models import AuditUser, table

# Users whose ids are another kind's target: before kinds, each got that kind's entries.
LOOKALIKES = ["default", "pro", "token:1", "1", "2 users"]


def entries(client: TestClient, **params: Any) -> list[dict[str, Any]]:
    """Every entry of the listing, page by page (`limit` per page)."""
    params.setdefault("limit", 1000)
    found: list[dict[str, Any]] = []
    while True:
        page = client.get("/audit", params=params)
        assert page.status_code == 200, page.text
        found += page.json()["items"]
        if page.json()["next_before_id"] is None:
            return found
        params["before_id"] = page.json()["next_before_id"]


def kinds_and_targets(items: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [(e["target_kind"], e["target"], e["action"]) for e in items]


def test_users_named_like_other_targets_get_only_their_own_entries(client: TestClient) -> None:
    assert client.put("/tiers/pro", json={"output_tokens_per_second": 100}).status_code == 200
    assert client.put("/default-limit", json={"output_tokens_per_second": 5}).status_code == 200
    token_id = client.post("/tokens", json={"name": "wall"}).json()["id"]
    assert token_id == 1
    bulk = [{"user": "b1", "output_tokens_per_second": 1}, {"user": "b2", "tier": "pro"}]
    assert client.post("/limits:bulk", json={"items": bulk}).status_code == 200
    for user in LOOKALIKES:
        assert (
            client.put(f"/limits/{user}", json={"output_tokens_per_second": 7}).status_code == 200
        )
    assert client.patch("/limits/pro", json={"tier": "pro"}).status_code == 200
    assert client.delete("/limits/default").status_code == 204

    for user in LOOKALIKES:
        own = kinds_and_targets(entries(client, target=user))
        expected = [("user", user, "put_limit")]
        if user == "pro":
            expected.insert(0, ("user", "pro", "patch_limit"))
        if user == "default":
            expected.insert(0, ("user", "default", "delete_limit"))
        assert own == expected, user
        assert kinds_and_targets(entries(client, target=user, target_kind="user")) == expected
        assert entries(client, target=user, target_kind="bulk") == []

    assert kinds_and_targets(entries(client, target="pro", target_kind="tier")) == [
        ("tier", "pro", "put_tier")
    ]
    for params in ({"target_kind": "default"}, {"target_kind": "default", "target": "default"}):
        assert kinds_and_targets(entries(client, **params)) == [
            ("default", "default", "put_default")
        ]
    assert kinds_and_targets(entries(client, target="1", target_kind="token")) == [
        ("token", "1", "create_token")
    ]
    assert kinds_and_targets(entries(client, target_kind="bulk")) == [
        ("bulk", "2 users", "bulk_put_limits")
    ]
    # Every entry has exactly one kind: the kinds' listings partition the log.
    everything = entries(client)
    by_kind = [
        e
        for k in ("user", "tier", "default", "token", "bulk")
        for e in entries(client, target_kind=k)
    ]
    assert sorted(e["id"] for e in by_kind) == sorted(e["id"] for e in everything)
    # A token's own entry reads the same from /changes.
    token_entry = entries(client, target_kind="token")[0]
    changes = client.get(f"/audit/{token_entry['id']}/changes").json()
    assert (changes["target_kind"], [c["target"] for c in changes["items"]]) == ("token", ["1"])


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"target_kind": "users"}, "target_kind"),
        ({"target_kind": "key"}, "target_kind"),
        ({"target_kind": "token", "target": "token:1"}, "target"),
        ({"target_kind": "token", "target": "0"}, "target"),
        ({"target_kind": "tier", "target": "no such tier!"}, "target"),
        ({"target_kind": "default", "target": "pro"}, "target"),
        ({"target": "a/b"}, "target"),
        ({"target": "x" * 257}, "target"),
    ],
)
def test_bad_targets_are_refused_naming_the_field(
    client: TestClient, params: dict[str, str], field: str
) -> None:
    response = client.get("/audit", params=params)
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field


def test_a_bulk_change_is_in_the_history_of_each_user_it_changed(
    client: TestClient, db_url: str
) -> None:
    # The case: an override, then an import that moves the user to a tier.
    assert client.put("/tiers/gold", json={"output_tokens_per_second": 50}).status_code == 200
    client.put("/limits/acme-00100", json={"output_tokens_per_second": 9})
    items = [{"user": f"acme-{i:05d}", "tier": "gold"} for i in range(200)]
    assert client.post("/limits:bulk", json={"items": items}).json()["num_changed"] == 200
    history = entries(client, target="acme-00100", limit=50)
    assert [(e["target_kind"], e["action"]) for e in history] == [
        ("bulk", "bulk_put_limits"),
        ("user", "put_limit"),
    ]
    gold = {
        "tier": "gold",
        "output_tokens_per_second": None,
        "scope": None,
        "enforcement": None,
        "ceiling_output_tokens_per_second": None,
    }
    assert history[0]["change"] == {
        "target": "acme-00100",
        "before": {
            "tier": None,
            "output_tokens_per_second": 9,
            "scope": None,
            "enforcement": None,
            "ceiling_output_tokens_per_second": None,
        },
        "after": gold,
    }
    assert history[1]["change"] is None
    # A new user's bulk change: nothing before.
    assert entries(client, target="acme-00007")[0]["change"] == {
        "target": "acme-00007",
        "before": None,
        "after": gold,
    }
    # The same import again changes nothing: no entry, no index rows.
    assert client.post("/limits:bulk", json={"items": items}).json()["num_changed"] == 0
    # One index row per changed user, only changed users: a second import where 3 of 5
    # users change.
    again = [{"user": f"acme-{i:05d}", "tier": "gold" if i < 2 else None} for i in range(5)]
    assert client.post("/limits:bulk", json={"items": again}).json()["num_changed"] == 3
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(func.count()).select_from(table(AuditUser))).scalar()
    finally:
        engine.dispose()
    assert rows == 200 + 3
    assert len(entries(client, target="acme-00000")) == 1
    assert len(entries(client, target="acme-00004")) == 2
    assert entries(client, target="acme-00100", target_kind="user")[0]["action"] == "put_limit"
    assert len(entries(client, target="acme-00004", target_kind="bulk")) == 2


def test_a_users_history_pages_through_its_own_and_bulk_entries(client: TestClient) -> None:
    """Own entries, bulk entries that touched the user and entries about others,
    interleaved: every page size walks exactly the user's entries, newest first."""
    expected: list[int] = []

    def last_id() -> int:
        return int(client.get("/audit?limit=1").json()["items"][0]["id"])

    big = [{"user": f"big-{i:05d}", "output_tokens_per_second": 3} for i in range(2000)]
    for step in range(24):
        rate = step + 1
        if step % 3 == 0:
            client.put("/limits/u", json={"output_tokens_per_second": rate})
            expected.append(last_id())
        elif step % 3 == 1:
            # Every fourth bulk is large (its before/after are not inlined).
            others = big if step % 4 == 1 else [{"user": "v", "output_tokens_per_second": rate}]
            items = [{"user": "u", "tier": None, "output_tokens_per_second": rate}, *others]
            assert client.post("/limits:bulk", json={"items": items}).status_code == 200
            expected.append(last_id())
            big = [{**i, "output_tokens_per_second": rate} for i in big]
        else:
            # About others: a bulk without u, a tier, a user named like u's bulk label.
            client.post(
                "/limits:bulk", json={"items": [{"user": "w", "output_tokens_per_second": rate}]}
            )
            client.put(f"/limits/{rate} users", json={"output_tokens_per_second": rate})
    expected.reverse()
    for limit in (1, 2, 3, 5, 16, 1000):
        found = entries(client, target="u", limit=limit)
        assert [e["id"] for e in found] == expected, limit
    # A page that ends at the first entry says so (no empty page after it).
    assert len(expected) == 16
    last = client.get("/audit", params={"target": "u", "limit": 8, "before_id": expected[7]})
    assert len(last.json()["items"]) == 8 and last.json()["next_before_id"] is None
    found = entries(client, target="u")
    bulks = [e for e in found if e["target_kind"] == "bulk"]
    assert len(bulks) == 8
    truncated = [e for e in bulks if e["truncated"]]
    assert truncated and all(e["before"] is None and e["after"] is None for e in truncated)
    assert all(e["change"]["target"] == "u" and e["change"]["after"] is not None for e in bulks)
    assert all(len(str(e["after"])) < MAX_AUDIT_INLINE_BYTES for e in bulks if not e["truncated"])
    # Kind bulk with the user: only the bulk entries, in the same order.
    only_bulks = entries(client, target="u", target_kind="bulk", limit=3)
    assert [e["id"] for e in only_bulks] == [e["id"] for e in bulks]
