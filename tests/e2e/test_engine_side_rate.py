"""The GCRA bound on engine time, with a real in-process engine and many streams.

Client-side measurements on a loaded machine cannot separate late delivery
from over-granting (bench/results/e2e.md); here the token times are taken in
the engine, when each sampled token returns to the scheduler.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.servers import ROOT, vllm_env

pytestmark = pytest.mark.e2e

RATE = 300
NUM_STREAMS = 16
TOKENS_PER_STREAM = 100


def worst_window_excess(times: list[float], rate: int) -> float:
    """max over windows of tokens - ((W + 0.1) * rate + 1)."""
    return max(
        (j - i + 1) - ((times[j] - times[i] + 0.1) * rate + 1)
        for i in range(len(times))
        for j in range(i, len(times))
    )


def test_sixteen_streams_of_one_user_keep_the_bound_on_engine_time() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.e2e.engine_side_rate",
            str(RATE),
            str(NUM_STREAMS),
            str(TOKENS_PER_STREAM),
        ],
        env=vllm_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    times = sorted(json.loads(done.stdout.strip().splitlines()[-1])["times"])
    assert len(times) == NUM_STREAMS * TOKENS_PER_STREAM
    # No speed floor: on a loaded 2-core machine the engine itself may fall
    # below 300 tok/s (bench/results/e2e.md has the accuracy figures). Every
    # token came, and no window got more than the bound allows.
    # Times are taken when a step's tokens return, so one step's worth
    # (up to one token per stream) may land together: that is the slack.
    assert worst_window_excess(times, RATE) <= NUM_STREAMS, worst_window_excess(times, RATE)
