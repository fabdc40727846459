from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.e2e.servers import VllmServer

# One engine for the engine e2e tests; every user and limit they need is here.
ENGINE_LIMITS = {"user-a": 20, "user-a1": 20, "user-a4": 20, "user-b": 100}


@pytest.fixture(scope="session")
def limited_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("vllm") / "limited.log"
    server = VllmServer(
        log,
        "--user-output-tokens-per-second",
        json.dumps(ENGINE_LIMITS),
        "--max-num-seqs",
        "16",
        "--max-num-active-seqs",
        "4",
        "--max-num-batched-tokens",
        "64",
        "--enable-prefix-caching",
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill()
