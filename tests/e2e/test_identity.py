"""Identity modes on real servers (docs/identity.md), each started once for the module:
a tiny-model vLLM server whose users come from a gateway's header, and one in api-key
mode with a real control plane (`output-rate serve`) that holds the keys."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.client import StreamResult, run, stream_completion, user_rate
from harness.servers import ControlPlane, VllmServer, free_port

pytestmark = pytest.mark.e2e

HEADER = "X-Gateway-User"
SLOW_RATE = 10
GRANTED = "vllm:output_rate_granted_tokens_total"
GENERATED = "vllm:generation_tokens_total"


def wait_serving(server: VllmServer) -> None:
    """Until the server answers /health (every /v1 path wants an identity here)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if server.popen.poll() is not None:
            raise RuntimeError(f"vLLM exited:\n{server.log()[-4000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"vLLM not ready:\n{server.log()[-4000:]}")


def granted(server: VllmServer) -> dict[str, float]:
    """user -> output tokens granted, from the engine's /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(GRANTED + "{"):
            user = re.search(r'user="([^"]*)"', line)
            assert user is not None
            found[user.group(1)] = found.get(user.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
    return found


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
        # The tiny model's tokenizer has no chat template.
        "--chat-template",
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
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
            body = {"model": "tiny", "prompt": "x", "max_tokens": 5, "ignore_eos": True}
            chat = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
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


# ---- api-key mode -------------------------------------------------------------------

ENGINE_ID = "e2e-keys"
KEY_LIMIT = 10
AUTH = ControlPlane.auth_headers()


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

    def start_engine(self) -> VllmServer:
        engine = VllmServer(
            self.tmp / f"engine-{time.time()}.log",
            "--control-plane-endpoint",
            f"tcp://127.0.0.1:{self.zmq_port}",
            "--output-rate-engine-id",
            ENGINE_ID,
            "--output-rate-identity",
            "api-key",
        )
        wait_serving(engine)
        return engine

    def new_key(self, user: str) -> tuple[str, str]:
        response = httpx.post(f"{self.control_plane.url}/users/{user}/keys", headers=AUTH)
        assert response.status_code == 201, response.text
        created = response.json()
        assert created["user"] == user
        self.secrets.append(created["key"].split("_", 2)[2])
        return created["id"], created["key"]

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
    _, key1 = keys.new_key("dave")
    _, key2 = keys.new_key("dave")
    keys.wait_key(key1)
    keys.wait_key(key2)
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


def test_keys_survive_a_control_plane_kill_and_an_engine_restart(keys: KeyStack) -> None:
    _, key = keys.new_key("frank")
    keys.wait_key(key)
    keys.control_plane.kill()  # SIGKILL
    time.sleep(2.0)
    response = post_completion(keys.engine.url, bearer(key), body_user="x")
    assert response.status_code == 200, response.text
    keys.control_plane = keys.start_control_plane()
    # A key made after the restart reaches the API server: it follows the new server.
    _, later = keys.new_key("frank")
    keys.wait_key(later)
    keys.engine.kill()
    keys.engine = keys.start_engine()
    # The restarted API server loads the keys again (503 until its snapshot lands).
    keys.wait_key(key)
    response = post_completion(keys.engine.url, bearer(later), body_user="x")
    assert response.status_code == 200, response.text
