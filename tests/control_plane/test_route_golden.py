"""Golden answers of every REST route, on SQLite and on PostgreSQL: one fixed script of
requests (every route, the interesting answers and each route's bad input) runs against
the real app on a fresh database, and every answer (status, headers, body) must equal
the one recorded in golden/routes.json, byte for byte once the few values that vary run
to run are replaced by placeholders (`normalised`). Both databases answer against the same
file: a difference between them is a bug too.

This protects refactors of the control plane: a change to these files is a change of the
API and must be deliberate. Regenerate them with OUTPUT_RATE_REGENERATE_GOLDEN=1
(docs/control-plane.md, "Golden answers of the REST API") and review the diff.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from control_plane.app import create_app
from control_plane.db import Database
from control_plane.engines import repository as engines_repo
from control_plane.usage.book import UsageBook
from control_plane.usage.repository import UsageRow, add_usage
from harness.control_plane import ADMIN_TOKEN
from output_rate_core import protocol as p
from output_rate_core.keys import KEY_ID_LEN
from tests.control_plane.factories import FakeClock, make_settings

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
REGENERATE = "OUTPUT_RATE_REGENERATE_GOLDEN"
# Small key bounds, so that the script reaches both the per-user 409 and the 429 in a few
# requests; one creation a minute, so the bucket cannot refill while the script runs.
KEY_BOUNDS = {"max_keys_per_user": 2, "key_creations_per_minute": 1, "key_creation_burst": 4}
# A request body longer than this is recorded by its size (bulk bodies of many users).
MAX_RECORDED_REQUEST_CHARS = 2000
# The bulk change large enough for its audit entry to be truncated (over 64 KiB inline).
BIG_BULK_USERS = 1000
MERGE_PATCH = "application/merge-patch+json"
CSV = "text/csv"
NO_BODY = object()

ISO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?")
UNIX_TIME = re.compile(r"(?<![\w.])1\d{9}(?![\w.])")
RETRY_AFTER = re.compile(r"^(retry-after: )\d+$", re.MULTILINE)
# A sample line: name, labels (whose values may hold braces: route="/limits/{user}"), value.
METRIC_CREATED = re.compile(r"^(\w+_created(?:\{.*\})?) \S+$", re.MULTILINE)
METRIC_DURATION = re.compile(r"^(\w+_seconds_(?:bucket|sum)(?:\{.*\})?) \S+$", re.MULTILINE)


def normalised(text: str, *, placeholders: Mapping[str, str], minute: int) -> str:
    """`text` (a path, a header line or a body) with what varies run to run replaced by
    stable placeholders; everything else is left exactly as it was:

    - values the server draws at random (API key ids and keys, viewer tokens): the
      placeholder the script gave each when the response that created it came
      (longest first: a key holds its id);
    - ISO 8601 date-times (created_at, the audit's at, engines' last_seen): the digits
      become <time>, a zone suffix ("Z", "+00:00") stays, so its presence is compared;
    - Unix times in seconds (the usage history's buckets): "<minute+N>", N seconds from
      the start of the minute the request was sent in;
    - Retry-After of the key bucket: the seconds until it refills depend on how long the
      script took;
    - /metrics samples that are durations (histogram buckets and sums of *_seconds) or
      creation times (*_created): the counts and every other sample stay.
    """
    for value in sorted(placeholders, key=len, reverse=True):
        text = text.replace(value, placeholders[value])
    text = ISO_TIME.sub("<time>", text)
    text = UNIX_TIME.sub(lambda m: f'"<minute{int(m[0]) - minute:+d}>"', text)
    text = RETRY_AFTER.sub(r"\1<seconds>", text)
    text = METRIC_CREATED.sub(r"\1 <time>", text)
    return METRIC_DURATION.sub(r"\1 <duration>", text)


def _body_record(text: str) -> dict[str, Any]:
    """A body as JSON when re-encoding it gives back the very same text (so the golden
    file stays readable and nothing is lost: key order, spacing, escapes), else as lines."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return {"text": text.split("\n")}
    compact = json.dumps(parsed, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return {"json": parsed} if compact == text else {"text": text.split("\n")}


class Answer(Protocol):
    """What the script reads of a response (the test client's, whichever HTTP library)."""

    @property
    def status_code(self) -> int: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    @property
    def content(self) -> bytes: ...
    def json(self) -> Any: ...


class Script:
    """Sends requests as a client would and records each answer, normalised."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.records: list[dict[str, Any]] = []
        self._placeholders: dict[str, str] = {}

    def send(
        self,
        method: str,
        path: str,
        body: object = NO_BODY,
        *,
        raw: bytes | None = None,
        content_type: str = "application/json",
        token: str | None = ADMIN_TOKEN,
        headers: Mapping[str, str] | None = None,
        drawn: Mapping[str, str] | None = None,
    ) -> Answer:
        """`body` is sent as JSON (encoded here, so the bytes never depend on the HTTP
        client's encoder), `raw` as is; `token`: the bearer token, None for none;
        `drawn`: fields of the JSON answer the server drew at random -> the placeholder
        each is recorded as, here and in every later request and answer."""
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        content = raw if body is NO_BODY else json.dumps(body).encode()
        if content is not None:
            sent["Content-Type"] = content_type
        minute = int(time.time()) // 60 * 60
        response = self.client.request(method, path, content=content, headers=sent)
        for field, placeholder in (drawn or {}).items():
            self._placeholders[response.json()[field]] = f"<{placeholder}>"
        self.records.append(self._record(method, path, content, response, minute))
        return response

    def get(self, path: str, **kw: Any) -> Answer:
        return self.send("GET", path, **kw)

    def put(self, path: str, body: object = NO_BODY, **kw: Any) -> Answer:
        return self.send("PUT", path, body, **kw)

    def patch(self, path: str, body: object = NO_BODY, **kw: Any) -> Answer:
        return self.send("PATCH", path, body, **kw)

    def post(self, path: str, body: object = NO_BODY, **kw: Any) -> Answer:
        return self.send("POST", path, body, **kw)

    def delete(self, path: str, **kw: Any) -> Answer:
        return self.send("DELETE", path, **kw)

    def _record(
        self, method: str, path: str, content: bytes | None, response: Answer, minute: int
    ) -> dict[str, Any]:
        def norm(text: str) -> str:
            return normalised(text, placeholders=self._placeholders, minute=minute)

        record: dict[str, Any] = {"request": norm(f"{method} {path}")}
        if content is not None:
            text = content.decode("utf-8", "backslashreplace")
            record["request_body"] = (
                norm(text) if len(text) <= MAX_RECORDED_REQUEST_CHARS else f"<{len(text)} chars>"
            )
        record["status"] = response.status_code
        # All but Content-Length (the body's, which normalising changes; the body itself
        # is compared); sorted: the order of different header names means nothing in HTTP.
        record["headers"] = [
            norm(f"{name}: {value}")
            for name, value in sorted(response.headers.items())
            if name != "content-length"
        ]
        record.update(_body_record(norm(response.content.decode("utf-8", "backslashreplace"))))
        return record


# ---- the script: one section per domain, in this order (each sees what the last left) ----


def service_routes(s: Script) -> None:
    s.get("/healthz", token=None)
    s.get("/readyz", token=None)
    s.get("/openapi.json", token=None)  # any drift of the schema shows here


def authentication(s: Script) -> None:
    s.get("/session", token=None)
    s.get("/session", token="not-the-admin-token")
    s.get("/session", token=None, headers={"Authorization": "Basic YWRtaW46YWRtaW4="})
    s.get("/session")
    # A request with a body is refused by the edge, before the body is read.
    s.put("/limits/alice", {"output_tokens_per_second": 5}, token=None)
    s.put("/limits/alice", {"output_tokens_per_second": 5}, token="not-the-admin-token")
    s.get("/metrics", token=None)


def viewer_tokens(s: Script) -> str:
    """The viewer token the later sections read with."""
    dashboard = s.post("/tokens", {"name": "dashboard"}, drawn={"token": "dashboard-token"})
    viewer = str(dashboard.json()["token"])
    revoked = s.post("/tokens", {"name": "ops team ✓"}, drawn={"token": "ops-token"}).json()
    for bad in ({"name": ""}, {"name": "bell\u0007"}, {"name": "x" * 129}, {"name": 5}, {}):
        s.post("/tokens", bad)
    s.post("/tokens", {"name": "ok", "role": "admin"})
    s.get("/tokens")
    s.get("/session", token=viewer)
    s.get("/tokens", token=viewer)
    s.post("/tokens", {"name": "mine"}, token=viewer)
    s.delete(f"/tokens/{revoked['id']}")
    s.delete(f"/tokens/{revoked['id']}")  # idempotent
    s.get("/session", token=revoked["token"])
    s.delete("/tokens/999999")
    s.delete("/tokens/0")
    s.delete("/tokens/abc")
    s.get("/tokens")
    return viewer


def default_limit(s: Script, viewer: str) -> None:
    s.get("/default-limit")
    s.put("/default-limit", {"output_tokens_per_second": 50})
    s.put("/default-limit", {"output_tokens_per_second": 50})  # unchanged: no new version
    s.put("/default-limit", {"output_tokens_per_second": 50, "scope": "engine"})
    s.put("/default-limit", {"output_tokens_per_second": 50, "enforcement": "shadow"})
    s.put("/default-limit", {"output_tokens_per_second": None})
    s.put("/default-limit", {"output_tokens_per_second": 50})
    bad_bodies: tuple[object, ...] = (
        {"output_tokens_per_second": 0},
        {"output_tokens_per_second": 50.5},
        {"scope": "galaxy"},
        {"enforcement": "maybe"},
        {"tier": "free"},
        [],
    )
    for bad in bad_bodies:
        s.put("/default-limit", bad)
    s.put("/default-limit", {"output_tokens_per_second": 9}, token=viewer)
    s.get("/default-limit", token=viewer)


def tiers(s: Script) -> None:
    s.get("/tiers")
    s.put("/tiers/free", {"output_tokens_per_second": 20, "description": "Free plan"})
    s.put(
        "/tiers/pro",
        {
            "output_tokens_per_second": 200,
            "scope": "engine",
            "enforcement": "shadow",
            "description": "Pro\tplan, per engine",
        },
    )
    s.put("/tiers/unlimited", {})
    s.put("/tiers/spare.tier_2", {"output_tokens_per_second": 5})
    s.put("/tiers/idle", {"output_tokens_per_second": 1})  # never assigned: deletable
    s.get("/tiers")
    s.get("/tiers/pro")
    s.get("/tiers/missing")
    s.patch("/tiers/pro", {"enforcement": None}, content_type=MERGE_PATCH)
    s.patch("/tiers/pro", {"description": None})
    s.patch("/tiers/pro", {})
    s.patch("/tiers/missing", {"output_tokens_per_second": 1}, content_type=MERGE_PATCH)
    s.put("/tiers/-bad", {"output_tokens_per_second": 1})
    s.put("/tiers/" + "t" * 65, {"output_tokens_per_second": 1})
    for bad in (
        {"description": "nul\u0000"},
        {"description": "x" * 1001},
        {"output_tokens_per_second": 2.5},
        {"output_tokens_per_second": 1_000_001},
        {"name": "free"},
    ):
        s.put("/tiers/free", bad)
    s.patch("/tiers/free", {"output_tokens_per_second": "fast"}, content_type=MERGE_PATCH)
    s.patch("/tiers/free", raw=b"[1]", content_type=MERGE_PATCH)
    s.delete("/tiers/spare.tier_2")
    s.delete("/tiers/spare.tier_2")
    s.delete("/tiers/-bad")


def limits(s: Script, viewer: str) -> None:
    s.get("/limits/nobody")
    s.put("/limits/alice", {"tier": "pro"})
    s.put("/limits/bob", {"tier": "free", "output_tokens_per_second": 7})
    s.put(
        "/limits/carol",
        {"output_tokens_per_second": 300, "scope": "engine", "enforcement": "shadow"},
    )
    s.put("/limits/dave", {"tier": "unlimited"})
    s.put("/limits/bob", {"tier": "free", "output_tokens_per_second": 7})  # unchanged
    s.put("/limits/zo%C3%AB%20smith", {"output_tokens_per_second": 1_000_000})
    s.put("/limits/erin@example.com", {"scope": "fleet", "enforcement": "enforce"})
    s.get("/limits/alice")
    s.get("/limits/carol", token=viewer)
    s.get("/limits/zo%C3%AB%20smith")
    s.patch("/limits/bob", {"output_tokens_per_second": None}, content_type=MERGE_PATCH)
    s.patch("/limits/bob", {"scope": "engine"})
    s.patch("/limits/bob", {})
    s.patch("/limits/frank", {"tier": "free"}, content_type=f"{MERGE_PATCH}; charset=utf-8")
    s.patch("/limits/bob", {"tier": "nope"}, content_type=MERGE_PATCH)
    s.patch("/limits/bob", {"enforcement": 1}, content_type=MERGE_PATCH)
    s.delete("/limits/dave")
    s.delete("/limits/dave")
    s.delete("/tiers/pro")  # alice holds it: 409
    s.delete("/tiers/unlimited")  # dave was its only user
    s.put("/limits/alice", {"tier": "free"}, token=viewer)
    s.delete("/limits/alice", token=viewer)
    list_pages(s)
    bad_limit_writes(s)


def list_pages(s: Script) -> None:
    for query in (
        "",
        "?offset=1&limit=2",
        "?tier=free",
        "?q=b",
        "?after=bob&limit=2",
        "?contains=AR",
        "?sort=-override",
        "?sort=tier",
        "?sort=-tier&limit=3",
        "?tier=missing",
    ):
        s.get(f"/limits{query}")
    for bad in ("?limit=0", "?limit=1001", "?offset=-1", "?tier=-x", "?sort=bogus", "?q=a%00"):
        s.get(f"/limits{bad}")


def bad_limit_writes(s: Script) -> None:
    for bad in (
        {"output_tokens_per_second": 0},
        {"output_tokens_per_second": -5},
        {"output_tokens_per_second": 2.5},
        {"output_tokens_per_second": 1_000_001},
        {"output_tokens_per_second": 10**30},
        {"output_tokens_per_second": "10"},
        {"output_tokens_per_second": True},
        {"tier": "no-such-tier"},
        {"tier": "-bad"},
        {"tier": 5},
        {"scope": "galaxy"},
        {"enforcement": None, "unknown_field": 1},
        [1, 2],
        "text",
        None,
    ):
        s.put("/limits/u", bad)
    for raw in (
        b"{not json",
        b'{"output_tokens_per_second": NaN}',
        b'{"output_tokens_per_second": 1e400}',
        b"",
        b"\xff\xfe",
    ):
        s.put("/limits/u", raw=raw)
    s.put("/limits/u", {"output_tokens_per_second": 5}, content_type="text/plain")
    s.put("/limits/u", raw=b" " * (64 * 1024 + 1))  # over the edge's body cap: 413
    for user in ("x" * 257, "a%00b", "a%2Fb", "%EF%BF%BD", "%ff", ".", "%2E%2E"):
        s.put(f"/limits/{user}", {"output_tokens_per_second": 5})
    s.get("/limits/" + "x" * 257)
    s.get("/limits/")


def bulk(s: Script, viewer: str) -> None:
    items = [
        {"user": "fay", "tier": "free"},
        {"user": "gus", "output_tokens_per_second": 12, "scope": "engine"},
        {"user": "bob", "tier": "free"},
    ]
    s.post("/limits:bulk", {"items": items})
    s.post("/limits:bulk", {"items": items})  # unchanged: num_changed 0
    s.post(
        "/limits:bulk",
        raw=b'user,tier,override,scope,enforcement\nhal,pro,,,\n\n"ivy",,40,engine,shadow\n',
        content_type=f"{CSV}; charset=utf-8",
    )
    s.post("/limits:bulk", raw=b"\xef\xbb\xbfjay,free\n", content_type=CSV)  # BOM, no header
    for bad in (
        {"items": [{"user": "ok"}, {"user": "kim", "tier": "missing"}]},
        {"items": [{"user": "ok"}, {"user": "a/b"}]},
        {"items": [{"user": ""}]},
        {"items": [{"tier": "free"}]},
        {"items": "fay"},
        {"items": [{"user": f"x{i}"} for i in range(10_001)]},
        {},
    ):
        s.post("/limits:bulk", bad)
    s.post("/limits:bulk", raw=b'{"items": [', content_type="application/json")
    s.post(
        "/limits:bulk",
        raw=b'jay,nope\nkim,,2.5\n\nlee,,,galaxy,\nmo,,,,maybe\n"nul\x00",,\n"open\nquote\n',
        content_type=CSV,
    )
    s.post("/limits:bulk", raw="é\n".encode("latin-1"), content_type=CSV)
    s.post("/limits:bulk", {"items": items}, token=viewer)


def previews(s: Script) -> None:
    """?dry_run=true of all eight writes; their last-hour figures come from the minutes
    usage_history seeded (well inside the hour: a minute passing cannot move them out)."""
    s.put("/limits/alice?dry_run=true", {"tier": "free"})
    s.put("/limits/newbie?dry_run=true", {"output_tokens_per_second": 3})
    s.patch("/limits/bob?dry_run=true", {"output_tokens_per_second": 1}, content_type=MERGE_PATCH)
    s.delete("/limits/carol?dry_run=true")
    s.delete("/limits/nobody?dry_run=true")
    s.post(
        "/limits:bulk?dry_run=true",
        {"items": [{"user": "alice", "output_tokens_per_second": 1}, {"user": "new"}]},
    )
    s.post("/limits:bulk?dry_run=true", raw=b"bob,pro\nfay\n", content_type=CSV)
    s.put("/tiers/free?dry_run=true", {"output_tokens_per_second": 10})
    s.put("/tiers/brand-new?dry_run=true", {"output_tokens_per_second": 10})
    s.patch("/tiers/free?dry_run=true", {"enforcement": "shadow"}, content_type=MERGE_PATCH)
    s.delete("/tiers/free?dry_run=true")  # users hold it: the write's own 409
    s.delete("/tiers/idle?dry_run=true")
    s.put("/default-limit?dry_run=true", {"output_tokens_per_second": 5})
    s.put("/default-limit?dry_run=true&items_limit=1", {"output_tokens_per_second": 5})
    s.put("/default-limit?dry_run=true&items_limit=0", {"output_tokens_per_second": 5})
    s.put("/default-limit?dry_run=true&items_limit=-1", {"output_tokens_per_second": 5})
    s.put("/default-limit?dry_run=true&items_limit=10001", {"output_tokens_per_second": 5})
    s.put("/limits/alice?dry_run=maybe", {"tier": "free"})
    s.put("/limits/alice?dry_run=true", {"tier": "missing"})
    s.put("/limits/alice?dry_run=false", {"tier": "pro"})  # unchanged: a plain write
    s.get("/default-limit")  # the version the previews left as it was


def versioned_writes(s: Script) -> None:
    """If-Match on the writes of a user, a tier and the default: the ETag each GET
    answers, stale (412, nothing written), fresh (written, the new ETag), `*`, a user
    nobody configured ("0"), weak and malformed tags, and a preview's check."""
    bob = s.get("/limits/bob").headers["etag"]
    s.patch("/limits/bob", {"output_tokens_per_second": 2}, headers={"If-Match": '"1"'})
    s.put("/limits/bob?dry_run=true", {"tier": "free"}, headers={"If-Match": '"1"'})
    s.delete("/limits/bob", headers={"If-Match": '"1", W/' + bob})
    s.patch("/limits/bob", {"output_tokens_per_second": 2}, headers={"If-Match": f'"1", {bob}'})
    s.put("/limits/bob", {"tier": "free"}, headers={"If-Match": bob})  # bob changed since
    s.get("/limits/never-seen")
    s.put("/limits/never-seen", {"tier": "free"}, headers={"If-Match": '"0"'})
    s.put("/limits/never-seen", {"tier": "free"}, headers={"If-Match": '"0"'})
    s.patch("/limits/unseen-2", {"tier": "free"}, headers={"If-Match": "*"})
    tier = s.get("/tiers/free").headers["etag"]
    s.patch("/tiers/free", {"description": "Free"}, headers={"If-Match": '"999"'})
    s.patch("/tiers/free", {"description": "Free"}, headers={"If-Match": tier})
    s.put("/tiers/not-yet", {"output_tokens_per_second": 3}, headers={"If-Match": "*"})
    s.delete("/tiers/idle", headers={"If-Match": '"1"'})
    s.patch("/tiers/missing", {"description": "x"}, headers={"If-Match": '"1"'})  # 404 first
    default = s.get("/default-limit").headers["etag"]
    s.put("/default-limit", {"output_tokens_per_second": 60}, headers={"If-Match": '"2"'})
    s.put("/default-limit", {"output_tokens_per_second": 60}, headers={"If-Match": default})
    s.put("/default-limit", {"output_tokens_per_second": 50}, headers={"If-Match": default})
    for malformed in ("5", '"5', '"5",', 'W/"5" x'):
        s.put("/default-limit", {"output_tokens_per_second": 50}, headers={"If-Match": malformed})


def api_keys(s: Script, viewer: str) -> None:
    s.get("/users/alice/keys")
    for number, body in enumerate((NO_BODY, {}), start=1):
        drawn = {"key": f"alice-key-{number}", "id": f"alice-key-{number}-id"}
        created = s.post("/users/alice/keys", body, drawn=drawn).json()
    s.post("/users/alice/keys")  # two is the most one user may hold: 409
    s.post("/users/alice/keys", {"name": "laptop"})
    s.get("/users/alice/keys")
    s.get("/users/alice/keys", token=viewer)
    s.post("/users/bob/keys", {}, token=viewer)
    s.delete(f"/keys/{created['id']}")
    s.delete(f"/keys/{created['id']}")
    s.delete(f"/keys/{created['id']}", token=viewer)
    s.delete("/keys/not-a-key-id")
    s.delete("/keys/" + "a" * KEY_ID_LEN)
    for user in ("bob", "carol"):
        s.post(f"/users/{user}/keys", drawn={"key": f"{user}-key", "id": f"{user}-key-id"})
    s.post("/users/dave/keys")  # the bucket's burst is spent: 429 with Retry-After
    s.post("/users/" + "x" * 257 + "/keys")
    s.get("/users/alice/keys")
    s.get("/users/nobody/keys")


def engines(s: Script, db: Database, viewer: str) -> None:
    s.get("/engines")
    seen = datetime.now(UTC) - timedelta(minutes=1)
    row = {
        "engine_id": "engine-a:8000",
        "model": "tiny",
        "vllm_version": "0.34.0",
        "applied_version": 3,
        "connected": False,
        "first_seen": seen - timedelta(minutes=1),
        "last_seen": seen,
    }
    db.write_now(engines_repo.insert_engines, [row])
    s.get("/engines")
    s.get("/engines", token=viewer)
    s.delete("/engines/engine-a:8000", token=viewer)
    s.delete("/engines/missing")
    s.delete("/engines/" + "x" * 300)
    s.delete("/engines/bad%20id")
    s.delete("/engines/engine-a:8000")
    s.get("/engines")


def live_usage(s: Script, book: UsageBook, viewer: str) -> None:
    s.get("/usage")
    for engine in ("engine-a", "engine-b"):
        book.add(
            p.Usage(
                engine,
                1.0,
                {"alice": 40, "carol": 500, "unknown": 7},
                {"alice": 12},
                would_throttle={"carol": 3},
                # Only one engine lends: GET /usage shows the sum over engines.
                borrowed={"carol": 100} if engine == "engine-a" else {},
            )
        )
    s.get("/usage")
    s.get("/usage", token=viewer)
    s.get("/limits/alice")  # received_output_tokens_per_second


def _wait_for_minute_headroom(seconds: float) -> None:
    """Wait for the next minute when fewer than `seconds` of this one are left."""
    left = 60 - time.time() % 60
    if left < seconds:
        time.sleep(left + 0.05)


def usage_history(s: Script, db: Database) -> None:
    """Minutes of history seeded and read within one wall-clock minute: its buckets are
    whole minutes of the wall clock. Only steps of one minute succeed here: a longer
    step's buckets start at multiples of the step, so which minutes share a bucket would
    depend on the minute the test runs in."""
    _wait_for_minute_headroom(seconds=10)
    minute = int(time.time()) // 60 * 60
    tokens_per_minute = {"alice": [12_000, 30_000, 600], "bob": [420, 900], "fay": [60]}
    rows = [
        UsageRow(user, minute - 60 * (5 + i), tokens, 0, None, reported_seconds=60.0)
        for user, per_minute in tokens_per_minute.items()
        for i, tokens in enumerate(per_minute)
    ] + [
        UsageRow("alice", minute - 600, 3000, 40, 20, 0, 60.0, 60.0, 1200.0, 3000.0),
        UsageRow("alice", minute - 540, 1200, 0, 20, 0, 30.0, 30.0, 600.0, 1200.0),
        UsageRow("carol", minute - 120, 9000, 0, 300, 25, 60.0, 60.0, 18000.0, 9000.0, 3000),
        UsageRow("gus", minute - 60, 120, 0, None, 0, 60.0, 0.0, 0.0, 0.0),
    ]
    db.write_now(add_usage, rows)
    s.get("/usage/history")
    s.get("/usage/history?user=alice")
    s.get("/usage/history?order=tokens&top=1")
    s.get("/usage/history?user=nobody")
    since = datetime.fromtimestamp(minute - 30 * 60, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    s.get(f"/usage/history?since={since}")
    for bad in (
        "step=90",
        "step=59",
        "step=86460",
        "top=0",
        "top=101",
        "order=bogus",
        "user=a%00",
        "since=yesterday",
    ):
        s.get(f"/usage/history?{bad}")
    future = datetime.fromtimestamp(minute + 3600, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    s.get(f"/usage/history?since={future}")
    long_ago = datetime.fromtimestamp(minute - 30 * 86_400, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    s.get(f"/usage/history?since={long_ago}")  # too many points


def metrics(s: Script, viewer: str) -> None:
    s.get("/metrics", token=viewer)


def audit(s: Script, viewer: str) -> None:
    big = [{"user": f"big-{i:04d}", "output_tokens_per_second": 5} for i in range(BIG_BULK_USERS)]
    s.post("/limits:bulk", {"items": big})
    everything = s.get("/audit?limit=1000").json()["items"]
    first = s.get("/audit?limit=3").json()
    s.get(f"/audit?limit=3&before_id={first['next_before_id']}")
    s.get("/audit?target=bob")
    s.get("/audit?target=bob&target_kind=user")
    s.get("/audit?target=bob&target_kind=bulk")
    s.get("/audit?target_kind=tier&limit=2")
    s.get("/audit?target_kind=default&limit=2")
    s.get("/audit?target_kind=token")
    s.get("/audit?target=big-0999", token=viewer)
    by_action = {entry["action"]: entry["id"] for entry in reversed(everything)}
    big_id = everything[0]["id"]
    page = s.get(f"/audit/{big_id}/changes?limit=2").json()
    s.get(f"/audit/{big_id}/changes?limit=2&after={page['next_after']}")
    s.get(f"/audit/{by_action['put_limit']}/changes")
    s.get("/audit/999999/changes")
    for bad in ("limit=0", "limit=1001", "before_id=0", "target_kind=bogus", "target=a%00"):
        s.get(f"/audit?{bad}")
    s.get("/audit/0/changes")
    s.get(f"/audit/{big_id}/changes?limit=0")


def run_script(client: TestClient, book: UsageBook) -> list[dict[str, Any]]:
    s = Script(client)
    db: Database = client.app.state.control_plane.db  # type: ignore[attr-defined]
    service_routes(s)
    authentication(s)
    viewer = viewer_tokens(s)
    default_limit(s, viewer)
    tiers(s)
    limits(s, viewer)
    bulk(s, viewer)
    usage_history(s, db)
    previews(s)
    api_keys(s, viewer)
    engines(s, db, viewer)
    live_usage(s, book, viewer)
    versioned_writes(s)
    audit(s, viewer)
    metrics(s, viewer)  # last: its request counts cover the whole script
    return s.records


# ---- comparison -------------------------------------------------------------------------


def _render(value: object) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)


def _first_difference(expected: list[Any], actual: list[dict[str, Any]], name: str) -> str:
    """Where the answers part from the golden file: the first differing request and a
    unified diff of its record; or the count, when one list is a prefix of the other."""
    for index, (want, got) in enumerate(zip(expected, actual, strict=False)):
        want_text, got_text = _render(want), _render(got)
        if want_text != got_text:
            diff = difflib.unified_diff(
                want_text.splitlines(), got_text.splitlines(), name, "this run", lineterm=""
            )
            sent = f"{got['request']} {got.get('request_body', '')}".rstrip()
            return (
                f"request {index + 1} of {len(actual)} answers otherwise than in {name}:\n"
                f"{sent}\n" + "\n".join(diff)
            )
    if len(actual) != len(expected):
        return f"{len(actual)} requests recorded, {name} holds {len(expected)}"
    return f"the same records, but {name} is not as this test writes it (edited by hand?)"


def unrequested_routes(app: FastAPI, records: list[dict[str, Any]]) -> list[str]:
    """The routes of the API (its OpenAPI schema) that no request of the script reached."""
    sent = [record["request"].split(" ", 1) for record in records]
    paths = [(method, unquote(target.split("?", 1)[0])) for method, target in sent]
    return [
        f"{method} {route.path}"
        for route in app.routes
        if isinstance(route, APIRoute) and route.include_in_schema
        for method in sorted(route.methods)
        if not any(m == method and route.path_regex.match(path) for m, path in paths)
    ]


def check_golden(records: list[dict[str, Any]], path: Path) -> None:
    text = _render(records) + "\n"
    if os.environ.get(REGENERATE) == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"{path.name} is missing: run with {REGENERATE}=1 to write it"
    golden = path.read_text(encoding="utf-8")
    if golden != text:
        pytest.fail(
            _first_difference(json.loads(golden), records, path.name)
            + f"\n(a deliberate API change: rerun with {REGENERATE}=1 and review the diff)",
            pytrace=False,
        )


@pytest.fixture
def golden_client(db_url: str) -> Iterator[tuple[TestClient, UsageBook]]:
    """The app on a fresh database, its live usage a book on a clock that stands still, and
    no default Authorization header: each request says which token it sends."""
    book = UsageBook(clock=FakeClock())
    app = create_app(make_settings(db_url, **KEY_BOUNDS), usage_source=book)
    with TestClient(app) as client:
        yield client, book
        app.state.control_plane.db.dispose()


def test_every_route_answers_as_recorded(golden_client: tuple[TestClient, UsageBook]) -> None:
    client, book = golden_client
    records = run_script(client, book)
    missing = unrequested_routes(client.app, records)  # type: ignore[arg-type]
    assert not missing, f"routes the script never requests (add them to it): {missing}"
    check_golden(records, GOLDEN_DIR / "routes.json")
