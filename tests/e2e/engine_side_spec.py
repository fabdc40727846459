"""Engine-side token counts of a real in-process engine with n-gram speculative decoding.

Run as a script by tests/e2e/test_spec_decode.py (a fresh process, so the engine
can run in-process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Users and limits go
through ``additional_config["output_rate"]``, the path the server flags take. The
only additions are observers: around ``schedule()``, the clock time each step was
dispatched (when its tokens are charged); around ``update_from_output()``, the
tokens each request of the step really received (after vLLM's stop trimming) and
the drafts scheduled and accepted. Greedy sampling on a repetitive prompt, so the
n-gram drafter's proposals are accepted.

Prints one JSON object: {"events": {user: [[dispatch s, tokens], ...]},
"drafts": {user: n}, "accepted": {user: n}}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter, defaultdict
from typing import Any

NUM_SPEC_TOKENS = 4
PROMPT = "one two three four five one two three four five one two three four five"


def main(limited_rate: int, num_streams: int, tokens_per_stream: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from engine_ext.scheduler import OutputRateScheduler, request_user
    from harness.servers import TINY_MODEL

    # id(scheduler output) -> when schedule() returned it.
    dispatched_at: dict[int, float] = {}
    events: dict[str, list[tuple[float, int]]] = defaultdict(list)
    num_drafts: Counter[str] = Counter()
    num_accepted: Counter[str] = Counter()
    schedule = OutputRateScheduler.schedule
    update_from_output = OutputRateScheduler.update_from_output

    def observed_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        now = time.monotonic()
        output = schedule(self, *args, **kwargs)
        dispatched_at[id(output)] = now
        return output

    def observed_update(self: Any, scheduler_output: Any, model_output: Any) -> Any:
        at = dispatched_at.pop(id(scheduler_output))
        users = {r: request_user(self.requests[r]) for r in model_output.req_ids}
        for req_id, tokens in zip(
            model_output.req_ids, model_output.sampled_token_ids, strict=True
        ):
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, ())
            if tokens and drafts:
                num_drafts[users[req_id]] += len(drafts)
                num_accepted[users[req_id]] += len(tokens) - 1
        outputs = update_from_output(self, scheduler_output, model_output)
        for client_outputs in outputs.values():
            for out in client_outputs.outputs:
                if out.new_token_ids:
                    events[users[out.request_id]].append((at, len(out.new_token_ids)))
        return outputs

    OutputRateScheduler.schedule = observed_schedule  # type: ignore[method-assign]
    OutputRateScheduler.update_from_output = observed_update  # type: ignore[method-assign]
    llm = LLM(
        model=str(TINY_MODEL),
        max_model_len=512,
        enforce_eager=True,
        max_num_seqs=16,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": NUM_SPEC_TOKENS,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
        additional_config={"output_rate": {"user_rates": {"limited": limited_rate}}},
    )
    prompts, params = [], []
    for user, n in (("limited", num_streams), ("free", 1)):
        for _ in range(n):
            prompts.append(PROMPT)
            params.append(
                SamplingParams(
                    max_tokens=tokens_per_stream,
                    temperature=0.0,
                    ignore_eos=True,
                    extra_args={"output_rate_user": user},
                )
            )
    llm.generate(prompts, params, use_tqdm=False)
    print(json.dumps({"events": events, "drafts": num_drafts, "accepted": num_accepted}))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
