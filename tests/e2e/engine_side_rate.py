"""Engine-side token times of one user, from a real in-process vLLM engine with the plugin.

Run as a script by tests/e2e/test_engine_side_rate.py (a fresh process, so the
engine can run in-process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The
configuration goes through ``additional_config["output_rate"]``, the same path
the server flags take. The only addition is an observer around
``update_from_output`` that records when each sampled token comes back, so the
GCRA bound can be checked on engine time instead of client delivery time.
Prints one JSON object: {"times": [...]} (monotonic seconds, one per token).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main(rate: int, num_streams: int, tokens_per_stream: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from engine_ext.scheduler import OutputRateScheduler
    from harness.servers import TINY_MODEL

    times: list[float] = []
    original = OutputRateScheduler.update_from_output

    def observed(self: Any, scheduler_output: Any, model_output: Any) -> Any:
        now = time.monotonic()
        for req_id, tokens in zip(
            model_output.req_ids, model_output.sampled_token_ids, strict=True
        ):
            if tokens and req_id in self.requests:
                times.extend([now] * len(tokens))
        return original(self, scheduler_output, model_output)

    OutputRateScheduler.update_from_output = observed  # type: ignore[method-assign]
    llm = LLM(
        model=str(TINY_MODEL),
        max_model_len=512,
        enforce_eager=True,
        max_num_seqs=32,
        additional_config={"output_rate": {"user_rates": {"x": rate}}},
    )
    params = SamplingParams(
        max_tokens=tokens_per_stream, ignore_eos=True, extra_args={"output_rate_user": "x"}
    )
    llm.generate(["Once upon a time"] * num_streams, params, use_tqdm=False)
    print(json.dumps({"times": times}))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
