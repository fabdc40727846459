"""IdentityMiddleware around a real ASGI app, through a real HTTP client (httpx's ASGI
transport), with a real KeyClient fed by a scripted push server (a ZMQ ROUTER this test
drives). No vLLM."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from engine_ext import identity
from engine_ext.identity import IdentityConfig, IdentityMiddleware, rewrite_body
from engine_ext.key_client import KeyClient
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
    assert hello == p.Hello("e1", "tiny", 0, p.API_ROLE)
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


async def test_keys_not_loaded_yet_is_a_503(key_setup: Keys) -> None:
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
        assert not seen.calls
    finally:
        client.close()
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
