"""The plugin on a real vLLM server (tiny local model, CPU), measured as a client.

Every test runs against two servers: sync scheduling (the plain
``python -m vllm.entrypoints.openai.api_server`` command) and async scheduling
(``--async-scheduling``, through harness/cpu_async_server.py because vLLM's
CPU platform turns it off). Rates are measured per user from the streams, as
a client would: tokens from the usage block of every chunk, first-to-last
token time.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import time

import httpx
import pytest

from engine_ext.worker_spin import BUSY_WINDOW_S
from harness.client import StreamResult, run, stream_completion, user_rate, wall_rate
from harness.servers import VllmServer, free_port, vllm_command, vllm_env
from tests.e2e.conftest import ENGINE_LIMITS

pytestmark = pytest.mark.e2e

# Client-side timestamps carry delivery jitter (HTTP chunking, detokenizing on
# a loaded 2-core machine): the first chunk in particular can arrive late,
# which shortens the measured span. With an ideal GCRA the token count sits
# exactly on the bound, so the client check allows this much span error; the
# exact engine-side bound is asserted on the real scheduler with a fake clock
# in tests/engine_ext/test_scheduler.py.
CLIENT_JITTER_S = 0.2
# Rates are measured from a user's 5th token on (see client.user_rate).
SKIP_FIRST_TOKENS = 4
ABORT_SETTLE_S = 30.0


def assert_limited(results: list[StreamResult], limit: int) -> float:
    """The GCRA upper bound holds for the user's streams; returns its rate.

    No lower bound against the limit: that is a speed floor, which a loaded
    machine can break; tests compare rates measured side by side instead.
    """
    num_tokens, span = user_rate(results, skip=SKIP_FIRST_TOKENS)
    assert num_tokens <= (span + 0.1 + CLIENT_JITTER_S) * limit + 1, (num_tokens, span, limit)
    return (num_tokens - 1) / span


def wait_until_idle(server: VllmServer) -> None:
    """The engine holds no request any more (aborts reached the scheduler)."""
    deadline = time.monotonic() + ABORT_SETTLE_S
    while time.monotonic() < deadline:
        busy = server.metric("vllm:num_requests_running") + server.metric(
            "vllm:num_requests_waiting"
        )
        if busy == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"requests still in the engine after {ABORT_SETTLE_S}s")


def test_server_runs_the_matching_output_rate_scheduler(limited_server: VllmServer) -> None:
    log = limited_server.log()
    expected = (
        "OutputRateAsyncScheduler" if limited_server.async_scheduling else ("OutputRateScheduler")
    )
    assert f"Using custom scheduler class engine_ext.scheduler.{expected}." in log
    assert "output-rate: engine idle wait on" in log  # the EngineCore patch, engine process


def test_worker_process_runs_with_the_short_input_reader_spin(limited_server: VllmServer) -> None:
    # Logged by the spawned worker itself after it changed its reader, with
    # the value read back from vLLM's SpinCondition (engine_ext/worker_spin.py).
    message = f"output-rate: worker input reader spins {BUSY_WINDOW_S * 1000:.1f} ms"
    lines = [line for line in limited_server.log().splitlines() if message in line]
    assert len(lines) == 1 and lines[0].startswith("(Worker"), lines


def test_users_get_their_limits_with_one_and_four_streams(limited_server: VllmServer) -> None:
    # user-a1: one stream at 20 tok/s; user-a4: four streams sharing 20 tok/s
    # (50 tokens each, so both users need ~10 s); user-b: one stream at 100 tok/s.
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
    assert [r.completion_tokens for r in results["user-a1"]] == [200]
    assert [r.completion_tokens for r in results["user-a4"]] == [50] * 4
    assert [r.completion_tokens for r in results["user-b"]] == [200]
    rate_a1 = assert_limited(results["user-a1"], 20)
    rate_a4 = assert_limited(results["user-a4"], 20)
    rate_b = assert_limited(results["user-b"], 100)
    # Measured side by side: one stream or four, a user gets the same budget,
    # and a 5x larger limit gives a clearly faster user.
    assert 0.7 <= rate_a4 / rate_a1 <= 1.4, (rate_a1, rate_a4)
    assert rate_b >= 2.5 * rate_a1, (rate_a1, rate_b)
    # The four streams of one user take turns: none is starved while others finish.
    ends = sorted(r.token_times[-1] for r in results["user-a4"])
    assert ends[-1] - ends[0] < 2.0, ends


def test_unlimited_user_keeps_its_speed_beside_a_throttled_one(
    limited_server: VllmServer,
) -> None:
    # 8 throttled streams of user-a are resident (--max-num-seqs 16) but only
    # 4 slots are active per step (--max-num-active-seqs 4). Alone and beside
    # are measured in alternation, three times, and compared by median, so
    # load from other processes on the machine hits both alike; the rate is
    # tokens per wall second of the whole request.
    async def pair(client: httpx.AsyncClient) -> tuple[float, float]:
        url = limited_server.url
        alone = await stream_completion(client, url, user="user-c", max_tokens=150)
        throttled = [
            asyncio.create_task(stream_completion(client, url, user="user-a", max_tokens=40))
            for _ in range(8)
        ]
        await asyncio.sleep(1.0)  # user-a's streams are resident and throttled
        beside = await stream_completion(client, url, user="user-c", max_tokens=150)
        for task in throttled:
            task.cancel()
        await asyncio.gather(*throttled, return_exceptions=True)
        assert alone.completion_tokens == beside.completion_tokens == 150
        return wall_rate(alone), wall_rate(beside)

    async def main() -> list[tuple[float, float]]:
        async with httpx.AsyncClient(timeout=120) as client:
            return [await pair(client) for _ in range(3)]

    pairs = run(main())
    rate_alone = statistics.median(a for a, _ in pairs)
    rate_beside = statistics.median(b for _, b in pairs)
    assert rate_beside >= 0.5 * rate_alone, pairs
    wait_until_idle(limited_server)


def test_client_cancel_mid_stream_frees_the_request(limited_server: VllmServer) -> None:
    async def main() -> StreamResult:
        async with httpx.AsyncClient(timeout=120) as client:
            return await stream_completion(
                client, limited_server.url, user="user-a", max_tokens=100, stop_after_tokens=3
            )

    cancelled = run(main())
    assert 3 <= cancelled.completion_tokens < 100
    wait_until_idle(limited_server)


def test_a_stop_token_before_the_limit_ends_the_stream_with_exact_counts(
    limited_server: VllmServer,
) -> None:
    # An EOS-like stop (stop_token_ids goes through the same check as EOS) on a
    # throttled user: the stream ends there, counted exactly.
    async def main() -> tuple[int, StreamResult, StreamResult]:
        async with httpx.AsyncClient(timeout=120) as client:
            url = limited_server.url
            common = {"temperature": 0.0, "return_token_ids": True}
            probe = await stream_completion(client, url, user="user-b", max_tokens=30, **common)
            stop_id = next(t for i, t in enumerate(probe.token_ids) if i >= 8)
            early = await stream_completion(
                client,
                url,
                user="user-a",
                max_tokens=200,
                ignore_eos=False,
                stop_token_ids=[stop_id],
                **common,
            )
            text_stop = await stream_completion(
                client, url, user="user-b", max_tokens=200, stop=[probe.text[2:4]], **common
            )
            return stop_id, early, text_stop

    stop_id, early, text_stop = run(main())
    assert len(early.token_ids) == early.completion_tokens
    assert early.finish_reason == "stop"
    assert early.token_ids[-1] == stop_id
    assert stop_id not in early.token_ids[:-1]
    assert early.completion_tokens < 200
    assert text_stop.finish_reason == "stop"
    assert text_stop.completion_tokens < 200


def test_chunked_prefill_and_prefix_hits_are_not_charged(limited_server: VllmServer) -> None:
    # A ~400-token prompt is prefilled in 64-token chunks (--max-num-batched-tokens 64)
    # by a user at 20 tok/s: if chunks that sample nothing were charged, the
    # first token would wait ~0.3 s per chunk. The second request hits the prefix cache.
    long_prompt = "".join(chr(97 + i % 26) for i in range(400))
    hits_before = limited_server.metric("vllm:prefix_cache_hits_total")

    async def main() -> list[StreamResult]:
        async with httpx.AsyncClient(timeout=120) as client:
            return [
                await stream_completion(
                    client, limited_server.url, user="user-a", max_tokens=20, prompt=long_prompt
                )
                for _ in range(2)
            ]

    results = run(main())
    assert [r.completion_tokens for r in results] == [20, 20]
    assert limited_server.metric("vllm:prefix_cache_hits_total") > hits_before
    # Never above the limit. (The lower bound is checked on longer streams
    # above: 20 tokens are too few to average out a stall of the loaded machine.)
    for result in results:
        num_tokens, span = user_rate([result])
        assert num_tokens <= (span + 0.1 + CLIENT_JITTER_S) * 20 + 1, (num_tokens, span)


def test_anonymous_and_unknown_users_are_unlimited_without_a_default(
    limited_server: VllmServer,
) -> None:
    async def main() -> list[StreamResult]:
        async with httpx.AsyncClient(timeout=120) as client:
            return list(
                await asyncio.gather(
                    *(
                        stream_completion(client, limited_server.url, user=u, max_tokens=100)
                        for u in (None, "nobody-configured")
                    )
                )
            )

    for result in run(main()):
        assert result.completion_tokens == 100
        assert wall_rate(result) > 2 * min(ENGINE_LIMITS.values())  # not throttled


def test_chat_requests_carry_the_user_through_vllm_xargs(limited_server: VllmServer) -> None:
    # Non-streaming chat for user-a (20 tok/s): 30 tokens cannot come back
    # sooner than the budget allows (a lower bound on time; load only adds).
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 30,
        "ignore_eos": True,
        "vllm_xargs": {"output_rate_user": "user-a"},
    }
    start = time.monotonic()
    response = httpx.post(f"{limited_server.url}/v1/chat/completions", json=body, timeout=60)
    elapsed = time.monotonic() - start
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 30
    # GCRA: 30 tokens need at least (30 - 1) / 20 - 0.1 s.
    assert elapsed >= (30 - 1) / 20 - 0.1, elapsed


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_beam_search_is_rejected_with_400(limited_server: VllmServer, endpoint: str) -> None:
    body = {"model": "tiny", "max_tokens": 4, "use_beam_search": True, "n": 2}
    if endpoint == "completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    response = httpx.post(f"{limited_server.url}/v1/{endpoint}", json=body, timeout=30)
    assert response.status_code == 400
    assert "use_beam_search is not supported while per-user output-rate limiting" in (response.text)


REJECTED = {
    "--scheduler-cls": ("--scheduler-cls", "some.custom.Scheduler"),
    "--kv-offloading-size": ("--kv-offloading-size", "1"),
    "--user-output-tokens-per-second": ("--user-output-tokens-per-second", '{"user-a": 0}'),
}


def test_rejected_configurations_fail_server_startup() -> None:
    # Started side by side: each fails during startup, before loading the model.
    processes = {
        option: subprocess.Popen(
            vllm_command(free_port(), "--default-user-output-tokens-per-second", "10", *flags),
            env=vllm_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for option, flags in REJECTED.items()
    }
    outputs: dict[str, str] = {}
    try:
        for option, process in processes.items():
            outputs[option] = process.communicate(timeout=300)[0]
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    for option, output in outputs.items():
        assert processes[option].returncode != 0, option
        assert option in output, output[-3000:]
        if option != "--user-output-tokens-per-second":
            assert "per-user output-rate limiting" in output, output[-3000:]
