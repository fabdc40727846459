"""IdentityMiddleware around a real ASGI app, through a real HTTP client (httpx's ASGI
transport), with a real KeyClient fed by a scripted push server (a ZMQ ROUTER this test
drives). No vLLM."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_ext import identity, vllm_compat
from engine_ext.identity import IdentityConfig, IdentityMiddleware, rewrite_body
from engine_ext.key_client import KeyClient
from engine_ext.saved_state import StateFile
from harness.scripted_server import WAIT_S, ScriptedServer
from output_rate_core import keys
from output_rate_core import protocol as p

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Seen:
    """What the app behind the middleware received, one entry per call."""

    calls: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)

    def body_json(self) -> Any:
        return json.loads(self.calls[-1][2])


def recording_app(seen: Seen) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        seen.calls.append((scope["path"], headers, body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def client_of(middleware: IdentityMiddleware) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=middleware), base_url="http://e")


@dataclass
class Keys:
    server: ScriptedServer
    client: KeyClient
    identity: bytes
    # user -> (key id, key)
    alice: tuple[str, str]
    alice2: tuple[str, str]
    bob: tuple[str, str]


def make_key() -> tuple[str, str]:
    return keys.new_key()


@pytest.fixture
def key_setup() -> Iterator[Keys]:
    server = ScriptedServer()
    client = KeyClient(
        endpoints=[server.endpoint],
        engine_id="e1",
        model="tiny",
        server_public_key=None,
        key_use_interval_s=0.1,
    )
    client.start()
    alice, alice2, bob = make_key(), make_key(), make_key()
    identity_, hello = server.recv(p.Hello)
    assert hello == p.Hello("e1", "tiny", 0, p.API_ROLE, vllm_compat.installed_vllm_version() or "")
    snapshot = p.Snapshot(
        version=3,
        default_rate=None,
        tiers={},
        users={},
        keys={
            kid: (user, keys.hash_key(key))
            for user, (kid, key) in (("alice", alice), ("alice", alice2), ("bob", bob))
        },
    )
    server.send(identity_, snapshot)
    _, ack = server.recv(p.Ack)
    assert ack == p.Ack("e1", 3)
    yield Keys(server, client, identity_, alice, alice2, bob)
    client.close()
    server.close()


def api_key_middleware(setup: Keys, seen: Seen) -> IdentityMiddleware:
    return IdentityMiddleware(
        recording_app(seen), IdentityConfig(mode="api-key"), key_client=setup.client
    )


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


BODY = {"model": "tiny", "prompt": "hi", "vllm_xargs": {"output_rate_user": "bob", "x": 1}}


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    return dict(error)


async def test_a_valid_key_decides_the_user_whatever_the_body_says(key_setup: Keys) -> None:
    seen = Seen()
    async with client_of(api_key_middleware(key_setup, seen)) as http:
        response = await http.post("/v1/completions", json=BODY, headers=bearer(key_setup.alice[1]))
    assert response.status_code == 200
    path, headers, body = seen.calls[0]
    assert path == "/v1/completions"
    data = json.loads(body)
    assert data["vllm_xargs"] == {"output_rate_user": "alice", "x": 1}
    assert data["prompt"] == "hi"
    assert int(headers["content-length"]) == len(body)
    # The key goes no further than the middleware.
    assert "authorization" not in headers


async def test_no_key_a_wrong_key_and_a_revoked_key_get_401_and_never_reach_the_app(
    key_setup: Keys,
) -> None:
    seen = Seen()
    kid, key = key_setup.alice
    other_id, _ = make_key()
    wrong_secret = f"ork_{kid}_{'A' * 43}"
    async with client_of(api_key_middleware(key_setup, seen)) as http:
        cases: list[dict[str, str]] = [
            {},
            bearer(wrong_secret),
            bearer(f"ork_{other_id}_{key.split('_', 2)[2]}"),
            bearer("not-a-key"),
            {"Authorization": f"Basic {key}"},
            {"Authorization": "Bearer "},
        ]
        for headers in cases:
            response = await http.post("/v1/completions", json=BODY, headers=headers)
            error = assert_openai_error(response, 401, "invalid_api_key")
            assert error["type"] == "invalid_request_error" and error["param"] is None
            assert response.headers["www-authenticate"] == "Bearer"
            assert key not in response.text
        # Revoked: the op arrives as a delta.
        assert (await http.post("/v1/completions", json=BODY, headers=bearer(key))).is_success
        key_setup.server.send(key_setup.identity, p.Delta(4, [p.DeleteKey(kid)]))
        _, ack = key_setup.server.recv(p.Ack)
        assert ack == p.Ack("e1", 4)
        response = await http.post("/v1/completions", json=BODY, headers=bearer(key))
        assert_openai_error(response, 401, "invalid_api_key")
        # The user's other key still works.
        response = await http.post(
            "/v1/completions", json=BODY, headers=bearer(key_setup.alice2[1])
        )
        assert response.is_success
    assert len(seen.calls) == 2


async def test_a_refused_request_is_answered_before_any_body_byte_is_read(
    key_setup: Keys,
) -> None:
    called = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        called.append(scope)

    middleware = IdentityMiddleware(app, IdentityConfig(mode="api-key"), key_setup.client)
    received = []
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        received.append(1)
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"authorization", b"Bearer ork_aaaaaaaaaaaa_x")],
    }
    await middleware(scope, receive, send)
    assert not received and not called
    assert sent[0]["status"] == 401

    # A websocket without a key is closed before it is accepted (the server answers 403).
    ws_scope = {"type": "websocket", "path": "/v1/realtime", "headers": []}
    sent.clear()
    await middleware(ws_scope, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": "invalid_api_key"}]
    assert not received and not called


def streaming_app(ended: list[str], *, step_s: float = 0.02) -> Any:
    """Streams an SSE event every ``step_s`` until cancelled, as vLLM's generator waits for
    each engine step; records how it ended."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            for i in range(1000):
                await asyncio.sleep(step_s)
                chunk = f"data: {i}\n\n".encode()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except asyncio.CancelledError:
            ended.append("cancelled")  # vLLM aborts the request here
            raise
        ended.append("finished")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def test_a_revoked_keys_running_stream_ends_at_once(key_setup: Keys) -> None:
    ended: list[str] = []
    kid, key = key_setup.alice
    middleware = IdentityMiddleware(
        streaming_app(ended), IdentityConfig(mode="api-key"), key_client=key_setup.client
    )
    async with client_of(middleware) as http:
        other = asyncio.create_task(
            http.post("/v1/completions", json=BODY, headers=bearer(key_setup.alice2[1]))
        )
        stream = asyncio.create_task(http.post("/v1/completions", json=BODY, headers=bearer(key)))
        await asyncio.sleep(0.3)
        revoked_at = time.monotonic()
        key_setup.server.send(key_setup.identity, p.Delta(4, [p.DeleteKey(kid)]))
        response = await stream
        ended_after_s = time.monotonic() - revoked_at
        # The user's other key is no revoked one: its stream goes on to its end.
        assert not other.done()
        other.cancel()
    assert response.status_code == 200  # the stream had begun
    events = response.text.split("\n\n")
    assert events[-3:] == [
        'data: {"error": {"message": "The API key was revoked while the request ran", '
        '"type": "invalid_request_error", "param": null, "code": "api_key_revoked"}}',
        "data: [DONE]",
        "",
    ]
    assert 10 <= len(events) < 100 and ended[0] == "cancelled"
    # Before, the stream ran to its end (1000 events, 20 s); now within a step or two.
    assert ended_after_s < 0.5, ended_after_s


async def test_until_the_keys_load_requests_and_readiness_probes_get_a_503(key_setup: Keys) -> None:
    server = ScriptedServer()  # never answers
    client = KeyClient(
        endpoints=[server.endpoint], engine_id="e2", model="", server_public_key=None
    )
    client.start()
    try:
        seen = Seen()
        middleware = IdentityMiddleware(recording_app(seen), IdentityConfig(mode="api-key"), client)
        async with client_of(middleware) as http:
            response = await http.post(
                "/v1/completions", json=BODY, headers=bearer(key_setup.alice[1])
            )
            error = assert_openai_error(response, 503, "keys_not_loaded")
            assert "not loaded" in error["message"]
            assert response.headers["retry-after"] == "1"
            # The readiness probes say so too (before, /health answered 200 meanwhile);
            # the others are served.
            for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
                response = await http.request(method, path)
                assert_openai_error(response, 503, "keys_not_loaded")
            assert (await http.get("/version")).is_success
            assert (await http.get("/metrics")).is_success
        assert [call[0] for call in seen.calls] == ["/version", "/metrics"]
    finally:
        client.close()
        server.close()


async def test_saved_keys_are_in_force_while_the_control_plane_is_silent(
    key_setup: Keys, tmp_path: Path
) -> None:
    # What the connected API server applied (a key revoked before it stopped included)...
    state = StateFile(tmp_path, "e2", p.API_ROLE)
    saved = key_setup.client.table.keys
    revoked = key_setup.alice2[0]
    state.save(p.Snapshot(4, None, {}, {}, keys={k: v for k, v in saved.items() if k != revoked}))
    # ...is what the restarted one answers with, the control plane silent.
    server = ScriptedServer()
    config = IdentityConfig(
        mode="api-key",
        control_plane_endpoints=(server.endpoint,),
        engine_id="e2",
        state_dir=str(tmp_path),
    )
    seen = Seen()
    middleware = IdentityMiddleware(recording_app(seen), config)
    try:
        async with client_of(middleware) as http:
            # Saved keys are loaded keys: the readiness probes say ready.
            for path in ("/health", "/ping"):
                assert (await http.get(path)).status_code == 200
            response = await http.post(
                "/v1/completions", json=BODY, headers=bearer(key_setup.alice[1])
            )
            assert response.status_code == 200
            assert seen.body_json()["vllm_xargs"]["output_rate_user"] == "alice"
            response = await http.post(
                "/v1/completions", json=BODY, headers=bearer(key_setup.alice2[1])
            )
            assert_openai_error(response, 401, "invalid_api_key")
        _, hello = server.recv(p.Hello)
        assert (hello.engine_id, hello.version, hello.role) == ("e2", 4, p.API_ROLE)
    finally:
        assert middleware.key_client is not None
        middleware.key_client.close()
        server.close()


async def test_probes_pass_and_every_other_path_is_guarded(key_setup: Keys) -> None:
    seen = Seen()
    async with client_of(api_key_middleware(key_setup, seen)) as http:
        for path in ("/health", "/ping", "/metrics", "/metrics/", "/version"):
            assert (await http.get(path)).status_code == 200, path
        assert (await http.options("/v1/completions")).status_code == 200
        # vLLM generates outside /v1 too.
        for path in ("/invocations", "/inference/v1/generate", "/cohere/v2/chat", "/tokenize"):
            response = await http.post(path, json=BODY)
            assert response.status_code == 401, path
        # Paths whose requests cannot carry the user are refused once authenticated.
        for path in ("/cohere/v2/chat", "/v1/systemone", "/generative_scoring"):
            response = await http.post(path, json=BODY, headers=bearer(key_setup.bob[1]))
            error = assert_openai_error(response, 403, "identity_not_carried")
            assert path in error["message"]
    assert [call[0] for call in seen.calls] == [
        "/health",
        "/ping",
        "/metrics",
        "/metrics/",
        "/version",
        "/v1/completions",
    ]
    # The probes' bodies are not touched.
    assert all(call[2] == b"" for call in seen.calls)


OPERATOR_KEY = "operator-" + "k" * 40
# Routes no user's key opens (the last one is on no release: unknown routes are the
# operator's too).
OPERATOR_ROUTES = (
    "/scale_elastic_ep",
    "/inference/v1/abort_requests",
    "/abort_requests",
    "/v1/load_lora_adapter",
    "/pause",
    "/no-such-route",
)


def operator_middleware(setup: Keys, seen: Seen, operator_key: str | None) -> IdentityMiddleware:
    digest = None if operator_key is None else hashlib.sha256(operator_key.encode()).hexdigest()
    config = IdentityConfig(mode="api-key", operator_key_sha256=digest)
    return IdentityMiddleware(recording_app(seen), config, key_client=setup.client)


async def test_operator_routes_take_the_operator_key_and_no_users(key_setup: Keys) -> None:
    seen = Seen()
    body = {"new_data_parallel_size": 2, "request_ids": ["cmpl-of-someone-else"]}
    async with client_of(operator_middleware(key_setup, seen, OPERATOR_KEY)) as http:
        for path in OPERATOR_ROUTES:
            # A user's key: before, /scale_elastic_ep answered it with a 500 and the
            # aborts aborted any user's requests.
            response = await http.post(path, json=body, headers=bearer(key_setup.alice[1]))
            error = assert_openai_error(response, 403, "operator_only")
            assert path in error["message"]
            response = await http.post(path, json=body)
            assert_openai_error(response, 401, "invalid_api_key")
            response = await http.post(path, json=body, headers=bearer(OPERATOR_KEY + "x"))
            assert_openai_error(response, 403, "operator_only")
        for path in OPERATOR_ROUTES:
            response = await http.post(path, json=body, headers=bearer(OPERATOR_KEY))
            assert response.is_success, (path, response.text)
        # The operator key is no user's: it generates nothing.
        response = await http.post("/v1/completions", json=BODY, headers=bearer(OPERATOR_KEY))
        assert_openai_error(response, 401, "invalid_api_key")
    # The operator's requests go on as they came, without the key.
    assert [call[0] for call in seen.calls] == list(OPERATOR_ROUTES)
    for _, headers, sent in seen.calls:
        assert json.loads(sent) == body and "authorization" not in headers


async def test_without_an_operator_key_no_one_reaches_the_operator_routes(
    key_setup: Keys,
) -> None:
    seen = Seen()
    async with client_of(operator_middleware(key_setup, seen, None)) as http:
        for key in (key_setup.bob[1], OPERATOR_KEY):
            response = await http.post("/scale_elastic_ep", json={}, headers=bearer(key))
            assert_openai_error(response, 403, "operator_only")
        # The users' routes are as they were.
        response = await http.post("/v1/completions", json=BODY, headers=bearer(key_setup.bob[1]))
        assert response.is_success
    assert [call[0] for call in seen.calls] == ["/v1/completions"]


async def test_a_user_reaches_only_its_own_stored_responses(key_setup: Keys) -> None:
    seen = Seen()
    alice, bob = bearer(key_setup.alice[1]), bearer(key_setup.bob[1])
    request = {"model": "tiny", "input": "hi", "store": True}
    async with client_of(api_key_middleware(key_setup, seen)) as http:
        # vLLM stores a response under its request_id: the middleware writes it.
        await http.post("/v1/responses", json={**request, "request_id": "mine"}, headers=alice)
        own = seen.body_json()["request_id"]
        assert own == identity.response_id_prefix("alice") + "mine"
        await http.post("/v1/responses", json={**request, "request_id": own}, headers=bob)
        bobs = seen.body_json()["request_id"]
        assert bobs.startswith(identity.response_id_prefix("bob")) and bobs.endswith(own)
        await http.post("/v1/responses", json=request, headers=alice)
        assert seen.body_json()["request_id"].startswith(identity.response_id_prefix("alice"))
        # Another user's stored response is not found, whichever way it is asked for.
        num_calls = len(seen.calls)
        for method, path, body in (
            ("GET", f"/v1/responses/{own}", None),
            ("GET", f"/v1/responses/{own}?stream=true", None),
            ("POST", f"/v1/responses/{own}/cancel", None),
            ("POST", "/v1/responses", {**request, "previous_response_id": own}),
        ):
            response = await http.request(method, path, json=body, headers=bob)
            error = assert_openai_error(response, 404, "response_not_found")
            assert own in error["message"]
        assert len(seen.calls) == num_calls
        # The user's own are.
        assert (await http.get(f"/v1/responses/{own}", headers=alice)).is_success
        assert (await http.post(f"/v1/responses/{own}/cancel", headers=alice)).is_success
        response = await http.post(
            "/v1/responses", json={**request, "previous_response_id": own}, headers=alice
        )
        assert response.is_success
        # Rendering is no stored response.
        assert (await http.post("/v1/responses/render", json=request, headers=bob)).is_success


async def test_bodies_that_are_no_json_object_pass_unchanged_and_bad_xargs_are_400(
    key_setup: Keys,
) -> None:
    seen = Seen()
    headers = bearer(key_setup.bob[1])
    async with client_of(api_key_middleware(key_setup, seen)) as http:
        for content in (b"", b"not json", b"[1, 2]", b"\xff\xfe", b"[" * 100_000):
            response = await http.post("/v1/completions", content=content, headers=headers)
            assert response.status_code == 200
            assert seen.calls[-1][2] == content
        for xargs in ("bob", [1], 3):
            bad = {"prompt": "x", "vllm_xargs": xargs}
            response = await http.post("/v1/completions", json=bad, headers=headers)
            error = assert_openai_error(response, 400, "invalid_type")
            assert error["param"] == "vllm_xargs"
        # null is no vllm_xargs at all; the token-in API's sampling params are rewritten.
        body = {
            "vllm_xargs": None,
            "sampling_params": {"extra_args": {"output_rate_user": "x"}},
        }
        assert (await http.post("/inference/v1/generate", json=body, headers=headers)).is_success
    assert seen.body_json() == {
        "vllm_xargs": {"output_rate_user": "bob"},
        "sampling_params": {"extra_args": {"output_rate_user": "bob"}},
    }
    assert len(seen.calls) == 6


async def test_a_body_over_the_bound_is_refused(
    key_setup: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(identity, "MAX_BODY_BYTES", 1000)
    seen = Seen()
    headers = bearer(key_setup.bob[1])
    async with client_of(api_key_middleware(key_setup, seen)) as http:
        fits = {"prompt": "x" * 900}
        assert (await http.post("/v1/completions", json=fits, headers=headers)).is_success
        big = {"prompt": "x" * 1000}
        response = await http.post("/v1/completions", json=big, headers=headers)
    assert_openai_error(response, 413, "body_too_large")
    assert len(seen.calls) == 1


async def test_key_use_is_reported_and_no_secret_is_logged(
    key_setup: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    seen = Seen()
    kid, key = key_setup.alice
    before = time.time()
    async with client_of(api_key_middleware(key_setup, seen)) as http:
        await http.post("/v1/completions", json=BODY, headers=bearer(key))
        await http.post("/v1/completions", json=BODY, headers=bearer(key + "x"))
    _, use = key_setup.server.recv(p.KeyUse)
    assert isinstance(use, p.KeyUse)
    assert use.engine_id == "e1" and set(use.used) == {kid}
    assert before <= use.used[kid] <= time.time()
    secrets = [k.split("_", 2)[2] for _, k in (key_setup.alice, key_setup.alice2, key_setup.bob)]
    assert not any(secret in caplog.text for secret in secrets)


async def test_keys_stay_while_the_control_plane_is_silent(key_setup: Keys) -> None:
    seen = Seen()
    client = key_setup.client
    async with client_of(api_key_middleware(key_setup, seen)) as http:
        key_setup.server.close()
        # Past the silence: the client asks for a snapshot that does not come.
        deadline = time.monotonic() + WAIT_S
        while client.num_silences == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.num_silences >= 1
        response = await http.post("/v1/completions", json=BODY, headers=bearer(key_setup.bob[1]))
    assert response.is_success
    assert seen.body_json()["vllm_xargs"]["output_rate_user"] == "bob"
    key_setup.server = ScriptedServer()  # for the fixture's close


# ---- header mode ------------------------------------------------------------------


def header_middleware(seen: Seen, missing: identity.Missing = "refuse") -> IdentityMiddleware:
    config = IdentityConfig(mode="header", header="X-Gateway-User", missing=missing)
    return IdentityMiddleware(recording_app(seen), config)


async def test_the_header_decides_and_the_body_cannot_override_it() -> None:
    seen = Seen()
    async with client_of(header_middleware(seen)) as http:
        headers = {"x-gateway-user": "carol"}  # names are case-insensitive
        response = await http.post("/v1/chat/completions", json=BODY, headers=headers)
        assert response.is_success
        assert seen.body_json()["vllm_xargs"] == {"output_rate_user": "carol", "x": 1}
        # A gateway sends a non-ASCII user id as UTF-8.
        utf8 = {b"X-Gateway-User": "dé lta".encode()}
        await http.post("/v1/completions", json={"prompt": "x"}, headers=utf8)
        assert seen.body_json()["vllm_xargs"] == {"output_rate_user": "dé lta"}


async def test_a_missing_or_invalid_header_is_refused_naming_it() -> None:
    seen = Seen()
    async with client_of(header_middleware(seen)) as http:
        response = await http.post("/v1/completions", json=BODY)
        error = assert_openai_error(response, 401, "missing_identity")
        assert "X-Gateway-User" in error["message"]
        for value in (b"a/b", b"..", b"x" * 300, "é".encode("latin-1")):
            response = await http.post(
                "/v1/completions", json=BODY, headers={b"X-Gateway-User": value}
            )
            error = assert_openai_error(response, 400, "invalid_identity")
            assert "X-Gateway-User" in error["message"]
        response = await http.post(
            "/v1/completions",
            json=BODY,
            headers=[("X-Gateway-User", "a"), ("x-gateway-user", "b")],
        )
        assert_openai_error(response, 400, "invalid_identity")
        # The same two, folded by a proxy into one line (RFC 9110 5.3).
        for folded in ("alice, victim", "alice,victim", ",alice"):
            response = await http.post(
                "/v1/completions", json=BODY, headers={"X-Gateway-User": folded}
            )
            error = assert_openai_error(response, 400, "invalid_identity")
            assert "X-Gateway-User" in error["message"] and "comma" in error["message"]
        assert (await http.get("/health")).is_success
    assert [call[0] for call in seen.calls] == ["/health"]


async def test_a_missing_header_can_be_the_anonymous_bucket() -> None:
    seen = Seen()
    async with client_of(header_middleware(seen, missing="anonymous")) as http:
        assert (await http.post("/v1/completions", json=BODY)).is_success
    assert seen.body_json()["vllm_xargs"]["output_rate_user"] == "__anonymous__"


def test_rewrite_keeps_everything_else_and_drops_duplicate_keys() -> None:
    body = b'{"vllm_xargs": {"output_rate_user": "a"}, "vllm_xargs": {"k": "v"}, "n": 1.5}'
    assert json.loads(rewrite_body(body, "u") or b"") == {
        "vllm_xargs": {"k": "v", "output_rate_user": "u"},
        "n": 1.5,
    }
    assert rewrite_body(b'"text"', "u") is None


def test_the_config_travels_in_the_environment() -> None:
    config = IdentityConfig(mode="header", header="X-User", missing="anonymous")
    assert IdentityConfig.from_env({identity.IDENTITY_ENV: config.to_env()}) == config
    assert IdentityConfig.from_env({}) == IdentityConfig()
