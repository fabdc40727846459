"""?dry_run=true on every limit write, on both databases (real app, real SQLite and
PostgreSQL): per-user before -> after, counts by held rate, last-hour figures exact against
seeded usage_minutes, the write's own validation and errors, and nothing written (version,
audit, change log, the commit hook that feeds the push). CSV bulk bodies: quotes, header,
blank lines, every bad line named by its line number."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine

from control_plane.config import service as config
from control_plane.db import Commit
from control_plane.limits.schemas import ChangePreview
from control_plane.usage.repository import UsageRow, add_usage
from tests.control_plane.factories import make_client

CSV = {"Content-Type": "text/csv"}


@pytest.fixture
def client(db_url: str) -> Iterator[TestClient]:
    with make_client(db_url) as c:
        yield c
        c.app.state.control_plane.db.dispose()  # type: ignore[attr-defined]


def seed_usage(db_url: str, tokens: dict[str, list[int]], *, minutes_ago: int = 1) -> None:
    """Each user's minutes, the first `minutes_ago` minutes back, then one earlier each."""
    now_minute = int(time.time()) // 60 * 60
    rows = [
        UsageRow(user, now_minute - 60 * (minutes_ago + i), t, 0, None)
        for user, per_minute in tokens.items()
        for i, t in enumerate(per_minute)
    ]
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            add_usage(conn, rows)
    finally:
        engine.dispose()


def version(client: TestClient) -> int:
    return int(client.get("/default-limit").json()["version"])


def by_user(preview: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["user"]: item for item in preview["items"]}


def counts(preview: dict[str, Any]) -> tuple[int, ...]:
    keys = ("num_users", "num_down", "num_up", "num_same", "num_created")
    return tuple(preview[k] for k in (*keys, "num_overrides_dropped", "num_over_new_limit"))


def setup_tiers(client: TestClient) -> None:
    assert client.put("/tiers/free", json={"output_tokens_per_second": 20}).status_code == 200
    assert client.put("/tiers/pro", json={"output_tokens_per_second": 100}).status_code == 200


def test_bulk_preview_lists_each_user_before_and_after_with_exact_counts(
    client: TestClient, db_url: str
) -> None:
    setup_tiers(client)
    client.put("/limits/a", json={"tier": "pro", "output_tokens_per_second": 1000})
    client.put("/limits/b", json={"tier": "pro"})
    client.put("/limits/c", json={"tier": "free"})
    seed_usage(db_url, {"a": [3000, 600, 1200], "b": [9000], "e": [1500]})
    # c's only minute is two hours old: outside the last hour.
    seed_usage(db_url, {"c": [99_999]}, minutes_ago=120)
    at = version(client)
    items = [
        {"user": "a", "tier": "free"},  # its override of 1000 is dropped: 1000 -> 20
        {"user": "b", "tier": "pro"},  # unchanged
        {"user": "c", "tier": "pro"},  # 20 -> 100
        {"user": "e", "tier": "free"},  # new: unlimited (default) -> 20
    ]
    response = client.post("/limits:bulk?dry_run=true", json={"items": items})
    assert response.status_code == 200
    preview = response.json()
    # The shape OpenAPI documents (the route encodes the preview without a second pass).
    assert ChangePreview.model_validate(preview).model_dump(mode="json") == preview
    assert preview["dry_run"] is True and preview["version"] == at
    assert counts(preview) == (4, 2, 1, 1, 1, 1, 2)
    assert preview["num_records_unchanged"] == 1  # b's line is its record
    # Cuts first, the largest relative one first (unlimited -> 20 before 1000 -> 20).
    assert [i["user"] for i in preview["items"]] == ["e", "a", "c", "b"]
    assert [i["change"] for i in preview["items"]] == ["down", "down", "up", "same"]
    item = by_user(preview)
    assert item["a"]["override_dropped"] and not item["a"]["created"]
    assert item["a"]["before"] == {
        "tier": "pro",
        "output_tokens_per_second": 1000,
        "effective_output_tokens_per_second": 1000,
        "effective_scope": "fleet",
        "effective_enforcement": "enforce",
        "effective_ceiling_output_tokens_per_second": None,
    }
    assert item["a"]["after"]["effective_output_tokens_per_second"] == 20
    assert item["a"]["after"]["output_tokens_per_second"] is None
    # 50, 10 and 20 tok/s against 20: one minute over (20 itself is not over), by 30.
    assert item["a"]["last_hour"] == {
        "peak_output_tokens_per_second": 50.0,
        "num_minutes_over_new_limit": 1,
        "max_over_new_limit_output_tokens_per_second": 30.0,
    }
    assert item["e"]["created"] and item["e"]["before"] is None
    assert item["e"]["last_hour"]["max_over_new_limit_output_tokens_per_second"] == 5.0
    assert item["b"]["last_hour"] == {
        "peak_output_tokens_per_second": 150.0,
        "num_minutes_over_new_limit": 1,
        "max_over_new_limit_output_tokens_per_second": 50.0,
    }
    assert item["c"]["last_hour"] is None
    # Cut to the first two items: the counts stay those of all four.
    cut = client.post("/limits:bulk?dry_run=true&items_limit=2", json={"items": items}).json()
    assert [i["user"] for i in cut["items"]] == ["e", "a"] and cut["items_truncated"]
    assert counts(cut) == counts(preview) and not preview["items_truncated"]
    # The preview matches what the write then does.
    assert client.post("/limits:bulk", json={"items": items}).json()["num_changed"] == 3
    assert client.get("/limits/a").json()["effective_output_tokens_per_second"] == 20


def test_shadow_flips_are_counted_by_the_held_rate(client: TestClient, db_url: str) -> None:
    client.put("/tiers/sh", json={"output_tokens_per_second": 20, "enforcement": "shadow"})
    for user in ("x", "y"):
        client.put(f"/limits/{user}", json={"tier": "sh"})
    client.put("/limits/z", json={"tier": "sh", "output_tokens_per_second": 5})
    seed_usage(db_url, {"x": [1800, 600]})
    # shadow -> enforce: unlimited -> 20 for x and y, unlimited -> 5 for z (its override).
    flip = client.patch("/tiers/sh?dry_run=true", json={"enforcement": "enforce"}).json()
    assert counts(flip) == (3, 3, 0, 0, 0, 0, 1)
    assert [i["user"] for i in flip["items"]] == ["x", "y", "z"]
    assert by_user(flip)["x"]["last_hour"]["num_minutes_over_new_limit"] == 1
    assert by_user(flip)["x"]["after"]["effective_enforcement"] == "enforce"
    # A rate change under shadow holds nobody: every user's values change, none is held.
    rate = client.patch("/tiers/sh?dry_run=true", json={"output_tokens_per_second": 50}).json()
    assert counts(rate) == (2, 0, 0, 2, 0, 0, 0)  # z keeps its override
    client.patch("/tiers/sh", json={"enforcement": "enforce"})
    back = client.put("/limits/x?dry_run=true", json={"tier": "sh", "enforcement": "shadow"})
    assert back.json()["items"][0]["change"] == "up"


def test_default_change_lists_users_that_follow_it_and_users_seen_without_a_record(
    client: TestClient, db_url: str
) -> None:
    setup_tiers(client)
    client.put("/limits/plain", json={"scope": "engine"})  # a record that follows the default
    client.put("/limits/tiered", json={"tier": "pro"})
    client.put("/limits/own", json={"output_tokens_per_second": 7})
    seed_usage(db_url, {"walk-in": [3000], "plain": [600]})
    preview = client.put("/default-limit?dry_run=true", json={"output_tokens_per_second": 30})
    body = preview.json()
    assert [i["user"] for i in body["items"]] == ["plain", "walk-in"]
    assert counts(body) == (2, 2, 0, 0, 0, 0, 1)
    walk_in = by_user(body)["walk-in"]
    assert walk_in["before"] is None and walk_in["after"] is None and not walk_in["created"]
    assert walk_in["last_hour"]["max_over_new_limit_output_tokens_per_second"] == 20.0
    assert by_user(body)["plain"]["after"]["effective_scope"] == "engine"
    # A scope change moves every user whose scope comes from the default, tiered users
    # too, each still resolved with its tier's rate.
    scope = client.put("/default-limit?dry_run=true", json={"scope": "engine"}).json()
    assert [i["user"] for i in scope["items"]] == ["own", "tiered", "walk-in"]
    tiered = by_user(scope)["tiered"]
    assert tiered["before"]["effective_output_tokens_per_second"] == 100
    assert tiered["after"]["effective_output_tokens_per_second"] == 100
    assert (tiered["before"]["effective_scope"], tiered["after"]["effective_scope"]) == (
        "fleet",
        "engine",
    )


def test_single_user_previews(client: TestClient, db_url: str) -> None:
    setup_tiers(client)
    client.put("/limits/u", json={"tier": "free", "output_tokens_per_second": 50})
    gone = client.delete("/limits/u?dry_run=true")
    assert gone.status_code == 200
    item = gone.json()["items"][0]
    assert (item["change"], item["override_dropped"], item["after"]) == ("up", True, None)
    patched = client.patch("/limits/u?dry_run=true", json={"output_tokens_per_second": None})
    item = patched.json()["items"][0]
    assert (item["change"], item["override_dropped"]) == ("down", True)
    assert item["after"]["tier"] == "free"
    # A patch of nothing on an unknown user creates nothing, as the write.
    nothing = client.patch("/limits/nobody?dry_run=true", json={}).json()
    assert counts(nothing) == (1, 0, 0, 1, 0, 0, 0)
    assert nothing["items"][0]["after"] is None
    new = client.put("/limits/n?dry_run=true", json={"output_tokens_per_second": 9}).json()
    assert (new["num_created"], new["items"][0]["change"]) == (1, "down")
    # A new tier and a tier without users concern nobody; a deletable tier neither.
    assert client.put("/tiers/t?dry_run=true", json={}).json()["num_users"] == 0
    assert client.delete("/tiers/pro?dry_run=true").json()["num_users"] == 0


def test_dry_run_writes_nothing(client: TestClient) -> None:
    setup_tiers(client)
    client.put("/limits/a", json={"tier": "pro"})
    db = client.app.state.control_plane.db  # type: ignore[attr-defined]
    committed: list[Commit] = []
    db.on_commit.append(committed.append)  # what feeds the push to engines
    at = version(client)
    audit_before = client.get("/audit").json()["items"]
    calls = [
        ("PUT", "/limits/a", {"output_tokens_per_second": 1}),
        ("PATCH", "/limits/a", {"tier": "free"}),
        ("DELETE", "/limits/a", None),
        ("POST", "/limits:bulk", {"items": [{"user": "b"}, {"user": "a", "tier": "free"}]}),
        ("PUT", "/tiers/pro", {"output_tokens_per_second": 5}),
        ("PATCH", "/tiers/pro", {"enforcement": "shadow"}),
        ("DELETE", "/tiers/free", None),
        ("PUT", "/default-limit", {"output_tokens_per_second": 3}),
    ]
    for method, path, body in calls:
        response = client.request(method, f"{path}?dry_run=true", json=body)
        assert response.status_code == 200, (method, path, response.text)
        ChangePreview.model_validate(response.json())
    csv = client.post("/limits:bulk?dry_run=true", content="a,free\nc\n", headers=CSV)
    assert csv.status_code == 200
    assert version(client) == at and committed == []
    assert client.get("/audit").json()["items"] == audit_before
    assert db.read_now(config.changes_since, at) == []
    assert client.get("/limits/a").json()["tier"] == "pro"
    assert client.get("/limits").json()["total"] == 1
    # The same write without dry_run does reach the hook.
    client.put("/limits/a", json={"output_tokens_per_second": 1})
    assert [commit.version for commit in committed] == [at + 1]


def test_dry_run_has_the_writes_validation_and_auth(client: TestClient) -> None:
    setup_tiers(client)
    client.put("/limits/a", json={"tier": "pro"})
    bad = client.put("/limits/u?dry_run=true", json={"tier": "nope"})
    assert (bad.status_code, bad.json()["field"]) == (422, "tier")
    bad = client.put("/limits/u?dry_run=true", json={"output_tokens_per_second": 0})
    assert (bad.status_code, bad.json()["field"]) == (422, "output_tokens_per_second")
    assert client.patch("/tiers/gone?dry_run=true", json={}).status_code == 404
    assert client.delete("/tiers/gone?dry_run=true").status_code == 404
    busy = client.delete("/tiers/pro?dry_run=true")
    assert (busy.status_code, busy.json()["field"]) == (409, "name")
    items = [{"user": "x"}, {"user": "y"}, {"user": "x"}]
    dup = client.post("/limits:bulk?dry_run=true", json={"items": items})
    assert (dup.status_code, dup.json()["field"]) == (422, "items.2.user")
    malformed = client.post("/limits:bulk?dry_run=true", content=b"{", headers={})
    assert malformed.status_code == 422
    limit = client.post("/limits:bulk?dry_run=true&items_limit=-1", json={"items": []})
    assert (limit.status_code, limit.json()["field"]) == (422, "items_limit")
    created = client.post("/tokens", json={"name": "v"})
    viewer = {"Authorization": f"Bearer {created.json()['token']}"}
    refused = client.put("/limits/a?dry_run=true", json={}, headers=viewer)
    assert refused.status_code == 403
    refused = client.post("/limits:bulk?dry_run=true", content="a\n", headers={**viewer, **CSV})
    assert refused.status_code == 403
    assert version(client) == 3


def test_csv_quotes_header_blank_lines_and_errors_by_line(client: TestClient) -> None:
    setup_tiers(client)
    text = (
        "User,Tier,Output_Tokens_Per_Second,Scope,Enforcement\n"
        "\n"
        '"acme, inc",pro,,,\n'
        '  "say ""hi""" , free , 50 , engine , shadow\n'
        "\r\n"
        "plain\n"
    )
    preview = client.post("/limits:bulk?dry_run=true", content=text, headers=CSV).json()
    assert sorted(by_user(preview)) == ["acme, inc", "plain", 'say "hi"']
    after = by_user(preview)['say "hi"']["after"]
    assert (after["tier"], after["output_tokens_per_second"]) == ("free", 50)
    assert (after["effective_scope"], after["effective_enforcement"]) == ("engine", "shadow")
    applied = client.post("/limits:bulk", content=text, headers=CSV).json()
    assert applied["num_changed"] == 3
    assert client.get("/limits/acme, inc").json()["tier"] == "pro"
    # A header of the first columns only; without a header the first line is a user.
    short = client.post(
        "/limits:bulk?dry_run=true", content="user,tier\nq,pro\n", headers=CSV
    ).json()
    assert [i["user"] for i in short["items"]] == ["q"]
    bad = (
        "user,tier\n"  # 1
        "ok1,pro\n"  # 2
        "ok2,nope\n"  # 3: unknown tier
        "\n"  # 4
        "ok3,,1.5\n"  # 5: not a whole number
        "ok4,,0,moon\n"  # 6: rate and scope both bad
        "ok5,pro,,,,,extra\n"  # 7: a seventh field
        "ok1,free\n"  # 8: ok1 again
        '"multi\nline",pro\n'  # 9-10: a quoted line break (a control character)
        "ok6,pro,,,enforced\n"  # 11
    )
    response = client.post("/limits:bulk?dry_run=true", content=bad, headers=CSV)
    assert response.status_code == 422
    body = response.json()
    lines = [(e["line"], e["field"]) for e in body["errors"]]
    assert lines == [
        (3, "tier"),
        (5, "output_tokens_per_second"),
        (6, "output_tokens_per_second"),
        (6, "scope"),
        (7, "items"),
        (8, "user"),
        (9, "user"),
        (11, "enforcement"),
    ]
    assert body["field"] == "items"
    assert body["errors"][4]["msg"].startswith("line 7: items: 7 fields")
    assert "already appears at line 2" in body["errors"][5]["msg"]
    assert body["detail"].startswith("line 3: tier: unknown tier 'nope'; line 5: ")
    # The write refuses the same lines and writes nothing.
    write = client.post("/limits:bulk", content=bad, headers=CSV)
    assert write.status_code == 422 and write.json()["errors"] == body["errors"]
    assert client.get("/limits?q=ok").json()["total"] == 0


def test_csv_reports_at_most_fifty_lines_and_refuses_what_is_not_csv(client: TestClient) -> None:
    many = "".join(f"u{i},nope\n" for i in range(80))
    body = client.post("/limits:bulk?dry_run=true", content=many, headers=CSV).json()
    assert len(body["errors"]) == 50 and body["errors"][-1]["line"] == 50
    assert body["detail"].endswith("; and 30 more errors")
    over = "".join(f"u{i}\n" for i in range(10_001))
    response = client.post("/limits:bulk?dry_run=true", content=over, headers=CSV)
    assert (response.status_code, response.json()["field"]) == (422, "items")
    # A quote left open swallows the rest: its field is refused on the line it opened.
    broken = client.post("/limits:bulk", content=b'a\n"b\nc\n', headers=CSV)
    assert broken.status_code == 422
    assert [(e["line"], e["field"]) for e in broken.json()["errors"]] == [(2, "user")]
    latin = client.post("/limits:bulk", content="é\n".encode("latin-1"), headers=CSV)
    assert (latin.status_code, latin.json()["field"]) == (400, "body")


def test_openapi_documents_dry_run_and_both_responses(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    for path, method in [
        ("/limits/{user}", "put"),
        ("/limits/{user}", "patch"),
        ("/limits/{user}", "delete"),
        ("/limits:bulk", "post"),
        ("/tiers/{name}", "put"),
        ("/tiers/{name}", "patch"),
        ("/tiers/{name}", "delete"),
        ("/default-limit", "put"),
    ]:
        op = spec["paths"][path][method]
        assert "dry_run" in [p["name"] for p in op["parameters"]], (path, method)
        assert "ChangePreview" in str(op["responses"]["200"]), (path, method)
    bulk = spec["paths"]["/limits:bulk"]["post"]["requestBody"]["content"]
    assert set(bulk) == {"application/json", "text/csv"}
    assert "items" in bulk["application/json"]["schema"]["properties"]
    # Every reference resolves (the bulk body's schema is given whole, not by a $ref).
    refs = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(spec))
    assert refs and set(refs) <= set(spec["components"]["schemas"])
