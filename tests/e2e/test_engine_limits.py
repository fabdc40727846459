"""The plugin on a real vLLM server (tiny local model, CPU), measured as a client.

vLLM's CPU platform forces async scheduling off, so the server runs the sync
scheduler here; the async variant is covered on the real AsyncScheduler in
tests/engine_ext/test_scheduler.py.
"""

from __future__ import annotations

import asyncio
import subprocess

import httpx
import pytest

from tests.e2e.client import StreamResult, run, stream_completion, user_rate
from tests.e2e.servers import VllmServer, free_port, vllm_command, vllm_env

pytestmark = pytest.mark.e2e


# Client-side timestamps carry delivery jitter (HTTP chunking, detokenizing on
# a loaded 2-core machine): the first chunk in particular can arrive late,
# which shortens the measured span. The exact engine-side bound is asserted
# on the real scheduler in tests/engine_ext/test_scheduler.py.
CLIENT_JITTER_S = 0.2


def assert_limited(results: list[StreamResult], limit: int) -> None:
    num_tokens, span = user_rate(results)
    rate = (num_tokens - 1) / span
    assert rate >= 0.95 * limit, (rate, limit)
    assert num_tokens <= (span + 0.1 + CLIENT_JITTER_S) * limit + 1, (num_tokens, span, limit)


def test_users_get_their_limits_with_one_and_four_streams(limited_server: VllmServer) -> None:
    async def main() -> dict[str, list[StreamResult]]:
        async with httpx.AsyncClient(timeout=120) as client:
            url = limited_server.url
            jobs = {
                "user-a1": [stream_completion(client, url, user="user-a1", max_tokens=200)],
                "user-a4": [
                    stream_completion(client, url, user="user-a4", max_tokens=50) for _ in range(4)
                ],
                "user-b": [stream_completion(client, url, user="user-b", max_tokens=200)],
            }
            done = await asyncio.gather(*(asyncio.gather(*js) for js in jobs.values()))
            return dict(zip(jobs, done, strict=True))

    results = run(main())
    assert_limited(results["user-a1"], 20)
    assert_limited(results["user-a4"], 20)
    assert_limited(results["user-b"], 100)
    assert [r.completion_tokens for r in results["user-a1"]] == [200]
    assert [r.completion_tokens for r in results["user-a4"]] == [50] * 4
    assert [r.completion_tokens for r in results["user-b"]] == [200]


def test_unlimited_user_keeps_its_speed_beside_a_throttled_one(
    limited_server: VllmServer,
) -> None:
    async def main() -> tuple[float, float]:
        async with httpx.AsyncClient(timeout=120) as client:
            url = limited_server.url
            alone = await stream_completion(client, url, user="user-c", max_tokens=200)
            throttled = [
                asyncio.create_task(stream_completion(client, url, user="user-a", max_tokens=40))
                for _ in range(8)
            ]
            await asyncio.sleep(1.0)  # user-a's streams are resident and throttled
            beside = await stream_completion(client, url, user="user-c", max_tokens=200)
            for task in throttled:
                task.cancel()
            await asyncio.gather(*throttled, return_exceptions=True)
        rate_alone = (alone.completion_tokens - 1) / user_rate([alone])[1]
        rate_beside = (beside.completion_tokens - 1) / user_rate([beside])[1]
        return rate_alone, rate_beside

    rate_alone, rate_beside = run(main())
    assert rate_beside >= 0.5 * rate_alone, (rate_alone, rate_beside)


def test_cancel_eos_chunked_prefill_and_prefix_hits(limited_server: VllmServer) -> None:
    url = limited_server.url

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            cancelled = await stream_completion(
                client, url, user="user-a", max_tokens=100, stop_after_tokens=3
            )
            assert cancelled.completion_tokens >= 3
            # A stop string reached early ends the stream before max_tokens.
            probe = await stream_completion(
                client, url, user="user-b", max_tokens=8, temperature=0.0
            )
            stop = probe.text[2:4]
            early = await stream_completion(
                client,
                url,
                user="user-b",
                max_tokens=200,
                temperature=0.0,
                ignore_eos=False,
                stop=[stop],
            )
            assert early.finish_reason == "stop"
            assert early.completion_tokens < 200
            # A 400-token prompt is prefilled in 64-token chunks; twice, so the
            # second one hits the prefix cache.
            long_prompt = "".join(chr(97 + i % 26) for i in range(400))
            for _ in range(2):
                long = await stream_completion(
                    client, url, user="user-b", max_tokens=30, prompt=long_prompt
                )
                assert long.completion_tokens == 30
            # The engine still serves everyone, with exact counts.
            after = await asyncio.gather(
                *(stream_completion(client, url, user=u, max_tokens=20) for u in ("user-a", None))
            )
            assert [r.completion_tokens for r in after] == [20, 20]

    run(main())


def test_beam_search_is_rejected_with_400(limited_server: VllmServer) -> None:
    response = httpx.post(
        f"{limited_server.url}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "use_beam_search": True, "n": 2},
        timeout=30,
    )
    assert response.status_code == 400
    assert "use_beam_search" in response.text


def test_rejected_configuration_fails_server_startup() -> None:
    command = vllm_command(
        free_port(),
        "--default-user-output-tokens-per-second",
        "10",
        "--scheduler-cls",
        "some.custom.Scheduler",
    )
    done = subprocess.run(command, env=vllm_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "--scheduler-cls some.custom.Scheduler" in done.stdout + done.stderr
