"""Speculative decoding (n-gram, greedy) with per-user limits, on real engines.

Two views. Engine-side (tests/e2e/engine_side_spec.py, an in-process engine): the
tokens each request received, at the time their step was dispatched, keep the
window bound exactly, with drafts really accepted for limited and unlimited users.
Client-side (a real server and control plane): the accepted-token counter grows, a
limit changed live binds mid-stream, an unlimited user beside runs unthrottled;
tokens are counted per token from the usage block (a chunk carries several).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harness.client import StreamResult, run, stream_completion
from harness.servers import ROOT, ControlPlane, VllmServer, free_port, vllm_env
from harness.window import to_ns, worst_window_excess
from tests.e2e.engine_side_spec import NUM_SPEC_TOKENS, PROMPT

pytestmark = pytest.mark.e2e

SPEC_CONFIG = json.dumps(
    {
        "method": "ngram",
        "num_speculative_tokens": NUM_SPEC_TOKENS,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
)
ACCEPTED_METRIC = "vllm:spec_decode_num_accepted_tokens_total"
# Client-side windows see tokens late by a varying delivery delay; this much
# variation is allowed for (a window then spans that much more engine time).
DELIVERY_JITTER_S = 0.25


def test_engine_side_bound_holds_per_token_with_drafts_accepted() -> None:
    rate, num_streams, num_tokens = 40, 2, 80
    done = subprocess.run(
        [sys.executable, "-m", "tests.e2e.engine_side_spec", str(rate), str(num_streams), "80"],
        env=vllm_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    limited = [(to_ns(t), n) for t, n in result["events"]["limited"]]
    free = [(to_ns(t), n) for t, n in result["events"]["free"]]
    assert sum(n for _, n in limited) == num_streams * num_tokens
    assert sum(n for _, n in free) == num_tokens
    # Drafts were accepted: several tokens per step are real here. Whether the limited user
    # gets drafts depends on the engine's pace: a fast engine waits for each token of its
    # budget and spends it on a stream's sampled token, a slow one lets budget for drafts
    # build up (the scheduler tests cover both exactly).
    assert result["accepted"].get("free", 0) > 0, result
    print(f"drafts accepted: {result['accepted']} of {result['drafts']}")
    # Every window of dispatch time, exactly: no slack for the draft length.
    assert worst_window_excess(limited, rate) <= 0


class SpecStack:
    def __init__(self, tmp: Path) -> None:
        port, zmq_port = free_port(), free_port()
        self.control_plane = ControlPlane(
            tmp / "cp.log", f"sqlite:///{tmp / 'cp.db'}", port, zmq_port
        )
        self.engine: VllmServer | None = None
        self.control_plane.wait_ready()
        self.engine = VllmServer(
            tmp / "engine.log",
            "--control-plane-endpoint",
            self.control_plane.zmq_endpoint,
            "--output-rate-engine-id",
            "spec-engine",
            "--speculative-config",
            SPEC_CONFIG,
            "--max-num-seqs",
            "8",
        )
        self.engine.wait_ready()

    def kill(self) -> None:
        if self.engine is not None:
            self.engine.kill()
        self.control_plane.kill()


@pytest.fixture(scope="module")
def spec_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SpecStack]:
    stack = SpecStack(tmp_path_factory.mktemp("spec"))
    try:
        yield stack
    finally:
        stack.kill()


def test_live_limit_binds_mid_stream_with_drafts_and_an_unlimited_user_runs_beside(
    spec_stack: SpecStack,
) -> None:
    cp, engine = spec_stack.control_plane, spec_stack.engine
    assert engine is not None
    slow, fast = 10, 100
    cp.wait_applied(cp.put("limited", slow))
    accepted_before = engine.metric(ACCEPTED_METRIC)
    changed_at: list[float] = []

    async def main() -> tuple[list[StreamResult], StreamResult]:
        async with httpx.AsyncClient(timeout=180) as client:

            def stream(user: str, max_tokens: int) -> asyncio.Task[StreamResult]:
                return asyncio.create_task(
                    stream_completion(
                        client,
                        engine.url,
                        user=user,
                        max_tokens=max_tokens,
                        prompt=PROMPT,
                        temperature=0.0,
                    )
                )

            limited = [stream("limited", 120) for _ in range(2)]
            free = stream("free", 200)
            await asyncio.sleep(4.0)
            response = await client.put(
                f"{cp.url}/limits/limited",
                json={"output_tokens_per_second": fast},
                headers=cp.auth_headers(),
            )
            response.raise_for_status()
            changed_at.append(time.monotonic())
            return list(await asyncio.gather(*limited)), await free

    limited, free = run(main())
    assert [r.completion_tokens for r in limited] == [120, 120]
    assert free.completion_tokens == 200
    # The unlimited user finished while both limited streams were still running.
    assert free.finished < min(r.finished for r in limited)
    assert engine.metric(ACCEPTED_METRIC) > accepted_before
    changed = changed_at[0]
    times = sorted(t for r in limited for t in r.token_times)
    before = [t for t in times if t < changed]
    after = [t for t in times if t > changed + 0.5]  # applied at the next step
    # Per token, every window within the bound of the limit in force.
    jitter = to_ns(DELIVERY_JITTER_S)
    assert worst_window_excess([(to_ns(t), 1) for t in before], slow, slack_ns=jitter) <= 0
    assert worst_window_excess([(to_ns(t), 1) for t in after], fast, slack_ns=jitter) <= 0
    # The raise took effect mid-stream: a ratio, measured in the same run.
    rate_before = len(before) / (changed - limited[0].started)
    rate_after = (len(after) - 1) / (after[-1] - after[0])
    assert rate_after >= 2 * rate_before, (rate_before, rate_after)
