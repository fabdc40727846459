"""Versioned writes (If-Match / ETag) of a user, a tier and the default limit, on SQLite
and PostgreSQL: a write whose If-Match is stale is refused with 412 naming the current
version and writes nothing (no new config version, no audit entry, the record as it was);
a fresh one is written and answers the new ETag; without If-Match nothing changes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.control_plane.factories import make_client, writers_lock_held


def config_version(client: TestClient) -> int:
    return int(client.get("/engines").json()["version"])


def audit_ids(client: TestClient) -> list[int]:
    return [e["id"] for e in client.get("/audit?limit=1000").json()["items"]]


def etag_of(client: TestClient, path: str) -> str:
    response = client.get(path)
    assert response.status_code == 200, response.text
    return response.headers["etag"]


def assert_refused(
    client: TestClient, response: httpx.Response, *, current: str | None, before: dict[str, Any]
) -> None:
    """`response` is a 412 naming `current` (the ETag now; None: no record), and nothing
    was written since `before` (what `written` read)."""
    assert response.status_code == 412, response.text
    body = response.json()
    assert body["field"] == "If-Match"
    if current is None:
        assert body["current_version"] is None
        assert "etag" not in response.headers
    else:
        assert response.headers["etag"] == current
        assert f'"{body["current_version"]}"' == current
        assert current in body["detail"]
    assert written(client, before["paths"]) == before


def written(client: TestClient, paths: list[str]) -> dict[str, Any]:
    """What a refused write must leave as it was: the config version, the audit log and
    the records at `paths` (their status, body and ETag)."""
    records = []
    for path in paths:
        response = client.get(path)
        records.append((response.status_code, response.json(), response.headers.get("etag")))
    return {
        "paths": paths,
        "version": config_version(client),
        "audit": audit_ids(client),
        "records": records,
    }


def test_a_users_etag_is_its_records_version(client: TestClient) -> None:
    assert etag_of(client, "/limits/ann") == '"0"'  # no record yet
    put = client.put("/limits/ann", json={"output_tokens_per_second": 5})
    assert put.headers["etag"] == f'"{put.json()["version"]}"'
    assert etag_of(client, "/limits/ann") == put.headers["etag"]
    # Another user's change leaves ann's version alone.
    client.put("/limits/ben", json={"output_tokens_per_second": 6})
    assert etag_of(client, "/limits/ann") == put.headers["etag"]
    # A write that changes nothing keeps the version, and answers it.
    again = client.put("/limits/ann", json={"output_tokens_per_second": 5})
    assert again.headers["etag"] == put.headers["etag"]


@pytest.mark.parametrize(
    ("method", "body"),
    [
        ("PUT", {"output_tokens_per_second": 9}),
        ("PATCH", {"output_tokens_per_second": 9}),
        ("DELETE", None),
    ],
)
def test_a_stale_if_match_on_a_user_is_412_and_writes_nothing(
    client: TestClient, method: str, body: dict[str, Any] | None
) -> None:
    client.put("/limits/ann", json={"output_tokens_per_second": 5})
    seen = etag_of(client, "/limits/ann")
    client.patch("/limits/ann", json={"output_tokens_per_second": 7})  # someone else
    current = etag_of(client, "/limits/ann")
    assert current != seen
    before = written(client, ["/limits/ann"])
    stale = client.request(method, "/limits/ann", json=body, headers={"If-Match": seen})
    assert_refused(client, stale, current=current, before=before)
    # Its preview is refused alike.
    preview = client.request(
        method, "/limits/ann?dry_run=true", json=body, headers={"If-Match": seen}
    )
    assert_refused(client, preview, current=current, before=before)
    # Fresh: written, with the new ETag.
    fresh = client.request(method, "/limits/ann", json=body, headers={"If-Match": current})
    assert fresh.status_code == (204 if method == "DELETE" else 200), fresh.text
    assert config_version(client) == before["version"] + 1
    assert len(audit_ids(client)) == len(before["audit"]) + 1
    if method == "DELETE":
        assert etag_of(client, "/limits/ann") == '"0"'
    else:
        assert fresh.headers["etag"] == f'"{before["version"] + 1}"'
        assert etag_of(client, "/limits/ann") == fresh.headers["etag"]
        assert fresh.json()["output_tokens_per_second"] == 9


def test_a_user_nobody_configured_is_written_once_with_if_match_0(client: TestClient) -> None:
    """The ETag of a user without a record is "0": a first write with If-Match: "0"
    succeeds only while the user still has no record."""
    assert etag_of(client, "/limits/new") == '"0"'
    client.put("/limits/new", json={"tier": None, "output_tokens_per_second": 3})  # someone
    before = written(client, ["/limits/new"])
    late = client.put(
        "/limits/new", json={"output_tokens_per_second": 4}, headers={"If-Match": '"0"'}
    )
    assert_refused(client, late, current=before["records"][0][2], before=before)
    # Unconfigured again: a record that is absent now is what "0" named, and is replaced.
    client.delete("/limits/new")
    first = client.put(
        "/limits/new", json={"output_tokens_per_second": 4}, headers={"If-Match": '"0"'}
    )
    assert first.status_code == 200 and first.json()["output_tokens_per_second"] == 4


def test_a_stale_if_match_on_a_tier_is_412_and_writes_nothing(client: TestClient) -> None:
    client.put("/tiers/pro", json={"output_tokens_per_second": 50})
    client.put("/tiers/idle", json={"output_tokens_per_second": 1})
    seen = etag_of(client, "/tiers/pro")
    idle_seen = etag_of(client, "/tiers/idle")
    client.patch("/tiers/pro", json={"output_tokens_per_second": 40})
    client.patch("/tiers/idle", json={"description": "spare"})
    current = etag_of(client, "/tiers/pro")
    before = written(client, ["/tiers/pro", "/tiers/idle"])
    for method, path, body, now in (
        ("PUT", "/tiers/pro", {"output_tokens_per_second": 35}, current),
        ("PATCH", "/tiers/pro", {"output_tokens_per_second": 35}, current),
        ("DELETE", "/tiers/idle", None, etag_of(client, "/tiers/idle")),
    ):
        old = seen if path == "/tiers/pro" else idle_seen
        stale = client.request(method, path, json=body, headers={"If-Match": old})
        assert_refused(client, stale, current=now, before=before)
    fresh = client.patch(
        "/tiers/pro", json={"output_tokens_per_second": 35}, headers={"If-Match": current}
    )
    assert fresh.status_code == 200
    assert fresh.headers["etag"] == f'"{fresh.json()["version"]}"' != current
    assert etag_of(client, "/tiers/pro") == fresh.headers["etag"]
    assert len(audit_ids(client)) == len(before["audit"]) + 1


def test_if_match_star_holds_for_any_existing_record(client: TestClient) -> None:
    """`*` (RFC 9110): the record has a current representation. A tier that does not
    exist has none; a user always has one (GET answers its default view)."""
    before = written(client, ["/tiers/gold"])
    create = client.put(
        "/tiers/gold", json={"output_tokens_per_second": 5}, headers={"If-Match": "*"}
    )
    assert_refused(client, create, current=None, before=before)
    client.put("/tiers/gold", json={"output_tokens_per_second": 5})
    update = client.put(
        "/tiers/gold", json={"output_tokens_per_second": 6}, headers={"If-Match": "*"}
    )
    assert update.status_code == 200 and update.json()["output_tokens_per_second"] == 6
    user = client.put("/limits/x", json={"output_tokens_per_second": 6}, headers={"If-Match": "*"})
    assert user.status_code == 200


def test_a_stale_if_match_on_the_default_is_412_and_writes_nothing(client: TestClient) -> None:
    """The default's version is its last change's: a user's or a tier's change leaves it."""
    never_set = etag_of(client, "/default-limit")
    assert never_set == '"0"'
    client.put("/default-limit", json={"output_tokens_per_second": 30})
    seen = etag_of(client, "/default-limit")
    client.put("/limits/someone", json={"output_tokens_per_second": 3})
    assert etag_of(client, "/default-limit") == seen
    client.put("/default-limit", json={"output_tokens_per_second": 40})
    current = etag_of(client, "/default-limit")
    before = written(client, ["/default-limit"])
    for tag in (seen, never_set, f"W/{current}"):  # a weak tag never matches
        stale = client.put(
            "/default-limit", json={"output_tokens_per_second": 50}, headers={"If-Match": tag}
        )
        assert_refused(client, stale, current=current, before=before)
    fresh = client.put(
        "/default-limit",
        json={"output_tokens_per_second": 50},
        headers={"If-Match": f'"1", {current}'},
    )
    assert fresh.status_code == 200
    assert (
        fresh.headers["etag"] == f'"{fresh.json()["version"]}"' == etag_of(client, "/default-limit")
    )


@pytest.mark.parametrize("header", ["5", '"5', '"5",', "W/5", '"5" "6"'])
def test_a_malformed_if_match_is_422_naming_it(client: TestClient, header: str) -> None:
    before = written(client, ["/default-limit"])
    response = client.put(
        "/default-limit", json={"output_tokens_per_second": 5}, headers={"If-Match": header}
    )
    assert response.status_code == 422
    assert response.json()["field"] == "If-Match"
    assert written(client, ["/default-limit"]) == before


def test_without_if_match_a_write_goes_through_as_before(client: TestClient) -> None:
    client.put("/limits/ann", json={"output_tokens_per_second": 5})
    client.put("/limits/ann", json={"output_tokens_per_second": 6})
    assert client.patch("/limits/ann", json={"output_tokens_per_second": 7}).status_code == 200
    assert client.get("/limits/ann").json()["output_tokens_per_second"] == 7


def test_of_two_writers_racing_on_one_version_exactly_one_wins(db_url: str) -> None:
    """Two replicas (two apps on one database) send a write with the same, current
    If-Match while a third party holds the writers' lock, so both have read that version
    before either writes: the check runs inside each write's transaction, after the lock,
    so the second sees the first's version and is refused."""
    with make_client(db_url) as one, make_client(db_url) as two:
        one.put("/limits/ann", json={"output_tokens_per_second": 5})
        seen = etag_of(one, "/limits/ann")
        before_audit = len(audit_ids(one))
        answers: dict[str, httpx.Response] = {}

        def send(name: str, client: TestClient, rate: int) -> Callable[[], None]:
            def run() -> None:
                answers[name] = client.patch(
                    "/limits/ann",
                    json={"output_tokens_per_second": rate},
                    headers={"If-Match": seen},
                )

            return run

        with writers_lock_held(db_url):
            threads = [
                threading.Thread(target=send("one", one, 10)),
                threading.Thread(target=send("two", two, 20)),
            ]
            for thread in threads:
                thread.start()
            # Both are waiting on the lock (neither answered yet).
            threads[0].join(timeout=1.0)
            assert not answers
        for thread in threads:
            thread.join(timeout=30)
        statuses = sorted(a.status_code for a in answers.values())
        assert statuses == [200, 412], {k: a.text for k, a in answers.items()}
        winner = next(a for a in answers.values() if a.status_code == 200)
        loser = next(a for a in answers.values() if a.status_code == 412)
        assert loser.headers["etag"] == winner.headers["etag"]
        final = one.get("/limits/ann")
        assert final.json()["output_tokens_per_second"] == winner.json()["output_tokens_per_second"]
        assert len(audit_ids(one)) == before_audit + 1
        for client in (one, two):
            client.app.state.control_plane.db.dispose()  # type: ignore[attr-defined]
