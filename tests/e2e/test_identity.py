"""Identity modes on real servers (docs/identity.md): a tiny-model vLLM server whose
users come from a gateway's header, started once for the module."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from harness.client import StreamResult, run, stream_completion, user_rate
from harness.servers import VllmServer

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
    body = {
        "model": "tiny",
        "prompt": "Once",
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
