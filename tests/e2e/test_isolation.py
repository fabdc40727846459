"""Isolation under pressure on a real vLLM server: the product's own scenario.

One tenant (``hog``, 10 tok/s) opens twice as many streams as the engine has
worker slots (``--max-num-seqs 16``); every slot ends up held by one of its
throttled streams. A user with budget must still be served at once: the
victim's request completes while every hog stream is still running (the hog
needs minutes for its 200-token streams at 10 tok/s shared by 32). Asserted
as an order, not a time, so it holds on a loaded machine.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from harness.client import StreamResult, run, stream_completion
from harness.servers import VllmServer
from tests.e2e.test_engine_limits import wait_until_idle

pytestmark = pytest.mark.e2e

NUM_SLOTS = 16  # --max-num-seqs of the shared limited servers
NUM_HOG_STREAMS = 2 * NUM_SLOTS
HOG_TOKENS = 200
VICTIM_TOKENS = 30
FILL_TIMEOUT_S = 60.0


async def wait_for_full_slots(server: VllmServer) -> None:
    """Every worker slot is held by a (throttled) hog stream, the rest queue."""
    deadline = time.monotonic() + FILL_TIMEOUT_S
    while time.monotonic() < deadline:
        running = await asyncio.to_thread(server.metric, "vllm:num_requests_running")
        if running >= NUM_SLOTS:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"hog streams did not fill {NUM_SLOTS} slots in {FILL_TIMEOUT_S}s")


@pytest.mark.parametrize("order", ["hog-first", "hog-around"])
def test_victim_completes_while_every_hog_stream_still_runs(
    limited_server: VllmServer, order: str
) -> None:

    async def main() -> tuple[StreamResult, list[asyncio.Task]]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as c:
            url = limited_server.url

            def hog_streams(n: int) -> list[asyncio.Task]:
                return [
                    asyncio.create_task(
                        stream_completion(c, url, user="hog", max_tokens=HOG_TOKENS)
                    )
                    for _ in range(n)
                ]

            if order == "hog-first":
                hog = hog_streams(NUM_HOG_STREAMS)
                await wait_for_full_slots(limited_server)
                victim = await stream_completion(c, url, user="victim", max_tokens=VICTIM_TOKENS)
            else:
                # Half before the victim, half right after it.
                hog = hog_streams(NUM_HOG_STREAMS // 2)
                await wait_for_full_slots(limited_server)
                victim_task = asyncio.create_task(
                    stream_completion(c, url, user="victim", max_tokens=VICTIM_TOKENS)
                )
                hog += hog_streams(NUM_HOG_STREAMS - NUM_HOG_STREAMS // 2)
                victim = await victim_task
            still_running = [not t.done() for t in hog]
            for task in hog:
                task.cancel()
            await asyncio.gather(*hog, return_exceptions=True)
            assert all(still_running), still_running
            return victim, hog

    victim, _ = run(main())
    assert victim.completion_tokens == VICTIM_TOKENS
    assert victim.finish_reason == "length"
    wait_until_idle(limited_server)
