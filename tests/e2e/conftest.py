"""Shared real servers for the e2e tests: one per configuration, started once.

Both limited servers (sync and async scheduling) start together at the first
test that needs one, since startup (~25-45 s each) dominates the run; an idle
engine blocks on its input queue, so the other server does not disturb
measurements. Every server's process group is killed at the end of the session.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from harness.servers import VllmServer

# One engine per mode for the engine e2e tests; every user and limit they need is here.
ENGINE_LIMITS = {
    "user-a": 20,
    "user-a1": 20,
    "user-a4": 20,
    "user-b": 100,
    "hog": 10,
    "borrower": 20,
    "borrower-capped": 20,
}
# Borrowing (docs/scheduler.md): up to these beyond the rate, "borrower" above what the
# engine can give, "borrower-capped" at 5x its rate.
ENGINE_CEILINGS = {"borrower": 2000, "borrower-capped": 100}
MODES = ("sync", "async")
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
LIMITED_FLAGS = (
    "--user-output-tokens-per-second",
    json.dumps(ENGINE_LIMITS),
    "--user-output-tokens-per-second-ceiling",
    json.dumps(ENGINE_CEILINGS),
    "--max-num-seqs",
    "16",
    "--max-num-active-seqs",
    "4",
    "--max-num-batched-tokens",
    "64",
    "--enable-prefix-caching",
    # The tiny model's tokenizer has no chat template; chat tests need one.
    "--chat-template",
    CHAT_TEMPLATE,
)


@pytest.fixture(scope="session")
def limited_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, VllmServer]]:
    log_dir = tmp_path_factory.mktemp("vllm")
    servers: dict[str, VllmServer] = {}
    try:
        for mode in MODES:
            servers[mode] = VllmServer(
                log_dir / f"limited-{mode}.log", *LIMITED_FLAGS, async_scheduling=mode == "async"
            )
        for server in servers.values():
            server.wait_ready()
        yield servers
    finally:
        for server in servers.values():
            server.kill()


@pytest.fixture(scope="session", params=MODES)
def limited_server(
    request: pytest.FixtureRequest, limited_servers: dict[str, VllmServer]
) -> VllmServer:
    return limited_servers[request.param]
