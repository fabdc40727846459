"""Build the real vLLM schedulers in-process on the CPU, and drive them.

The model runner is the only fake: ``ModelRunnerOutput`` objects are built by
hand, one sampled token per scheduled sampling request, as vLLM's own
scheduler tests do. The KV cache manager, request queues and scheduling
logic are the real ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from engine_ext.config import CONFIG_KEY, OutputRateConfig
from engine_ext.scheduler import OutputRateAsyncScheduler, OutputRateScheduler

TINY_MODEL = Path(__file__).resolve().parents[1] / ".cache" / "tiny-llama"
BLOCK_SIZE = 16
EOS_TOKEN_ID = 2
SAMPLED_TOKEN_ID = 7  # never EOS, so requests run to max_tokens
POSITIONAL = -1  # runner_output: sample positional_token() instead


class FakeClock:
    """A monotonic clock in ns that only moves when told to."""

    def __init__(self, start_ns: int = 1_000_000_000) -> None:
        self.now_ns = start_ns

    def __call__(self) -> int:
        return self.now_ns

    def advance_ms(self, ms: float) -> None:
        self.now_ns += int(ms * 1_000_000)


def make_scheduler(
    *,
    async_scheduling: bool = False,
    limited: bool = True,
    default_rate: int | None = None,
    user_rates: dict[str, int | None] | None = None,
    max_num_seqs: int = 16,
    max_num_active_seqs: int | None = None,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 1024,
    num_blocks: int = 10_000,
    enable_prefix_caching: bool = False,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    clock: FakeClock | None = None,
    scheduler_options: dict[str, Any] | None = None,
) -> Scheduler:
    """The output-rate scheduler (or upstream's with ``limited=False``).

    ``scheduler_options``: more ``SchedulerConfig`` fields (the policy, options only
    some releases have).
    """
    model_config = ModelConfig(
        model=str(TINY_MODEL),
        tokenizer=str(TINY_MODEL),
        max_model_len=max_model_len,
        dtype="bfloat16",
        seed=0,
        skip_tokenizer_init=True,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_active_seqs=max_num_active_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        async_scheduling=async_scheduling,
        is_encoder_decoder=False,
        **(scheduler_options or {}),
    )
    cache_config = CacheConfig(
        block_size=BLOCK_SIZE,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    rate_config = OutputRateConfig(default_rate=default_rate, user_rates=dict(user_rates or {}))
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        device_config=DeviceConfig("cpu"),
        additional_config={CONFIG_KEY: rate_config.to_dict()},
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype=torch.float32
                ),
            )
        ],
    )
    cache_config.num_gpu_blocks = num_blocks
    if limited:
        cls: type[Scheduler] = OutputRateAsyncScheduler if async_scheduling else OutputRateScheduler
    else:
        cls = AsyncScheduler if async_scheduling else Scheduler
    scheduler = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=False,
    )
    if limited and clock is not None:
        scheduler.use_fake_clock(clock)  # type: ignore[attr-defined]
    return scheduler


_request_ids = itertools.count()
init_none_hash(sha256)
_BLOCK_HASHER = get_request_block_hasher(BLOCK_SIZE, sha256)


def make_request(
    user: str | None,
    *,
    num_prompt_tokens: int = 8,
    max_tokens: int = 50,
    prompt_token_ids: list[int] | None = None,
    ignore_eos: bool = True,
    request_id: str | None = None,
    structured: bool = False,
    priority: int = 0,
) -> Request:
    """A request of ``user``; ``structured`` ones wait for a grammar (``compile_grammar``)."""
    extra_args = {"output_rate_user": user} if user is not None else None
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        extra_args=extra_args,
        structured_outputs=StructuredOutputsParams(regex="[a-z]+") if structured else None,
    )
    params.update_from_generation_config({}, eos_token_id=EOS_TOKEN_ID)
    prompt = prompt_token_ids or [10 + (i % 200) for i in range(num_prompt_tokens)]
    return Request(
        request_id=request_id or f"req-{next(_request_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        arrival_time=0.0,
        block_hasher=_BLOCK_HASHER,
        priority=priority,
    )


class AcceptAllGrammar:
    """Stands in for a compiled grammar (a narrow seam): accepts every token."""

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False


def compile_grammar(request: Request) -> None:
    """Finish the grammar "compilation" of a structured-output request."""
    assert request.structured_output_request is not None
    request.structured_output_request.grammar = AcceptAllGrammar()  # type: ignore[assignment]


def positional_token(request_id: str, position: int) -> int:
    """What the fake model samples at ``position`` of a request: a function of
    both, so a lost, repeated or shifted position changes the output."""
    return 10 + (sum(map(ord, request_id)) * 31 + position) % 200


def expected_output(request: Request) -> list[int]:
    """The output of an uninterrupted run with the positional fake model."""
    start = request.num_prompt_tokens
    return [positional_token(request.request_id, start + i) for i in range(request.max_tokens)]


def runner_output(
    scheduler: Scheduler, sched_out: SchedulerOutput, token_id: int = SAMPLED_TOKEN_ID
) -> ModelRunnerOutput:
    """One sampled token for every request whose scheduled chunk reaches its end.

    ``token_id=POSITIONAL`` samples ``positional_token`` instead of a constant.
    """
    req_ids = list(sched_out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        if request.is_prefill_chunk:
            sampled.append([])
        elif token_id == POSITIONAL:
            # num_computed_tokens already counts this step: the sampled token
            # lands right after it.
            sampled.append([positional_token(req_id, request.num_computed_tokens)])
        else:
            sampled.append([token_id])
    index: dict[str, Any] = {}
    if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:  # gone in vLLM 0.34
        index["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
        **index,
    )


@dataclass
class Trace:
    """What a driven scheduler did: per step, the sampled requests and time."""

    # (time ns, request id) for every token sampled.
    samples: list[tuple[int, str]] = field(default_factory=list)
    outputs: list[SchedulerOutput] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)

    def times_of(self, req_ids: set[str]) -> list[int]:
        return [t for t, r in self.samples if r in req_ids]


def drive(
    scheduler: Scheduler,
    *,
    num_steps: int,
    clock: FakeClock | None = None,
    step_ms: float = 10.0,
    on_step: Callable[[int], Any] | None = None,
    keep_outputs: bool = False,
    token_id: int = SAMPLED_TOKEN_ID,
) -> Trace:
    """Run schedule()/update_from_output() like the engine loop does.

    Async schedulers get the engine's one-step overlap: the output of step N
    is applied after step N+1 is scheduled.
    """
    trace = Trace()
    is_async = isinstance(scheduler, AsyncScheduler)
    pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None

    def apply(sched_out: SchedulerOutput, model_out: ModelRunnerOutput) -> None:
        now = clock() if clock else 0
        for req_id, tokens in zip(model_out.req_ids, model_out.sampled_token_ids, strict=True):
            if tokens and req_id in scheduler.requests:
                trace.samples.append((now, req_id))
        engine_outputs = scheduler.update_from_output(sched_out, model_out)
        for eco in engine_outputs.values():
            for out in eco.outputs:
                if out.finish_reason is not None:
                    trace.finished.add(out.request_id)

    for step in range(num_steps):
        if on_step is not None:
            on_step(step)
        sched_out = scheduler.schedule()
        if keep_outputs:
            trace.outputs.append(sched_out)
        model_out = runner_output(scheduler, sched_out, token_id)
        if is_async:
            if pending is not None:
                apply(*pending)
            pending = (sched_out, model_out)
        else:
            apply(sched_out, model_out)
        if clock is not None:
            clock.advance_ms(step_ms)
    if pending is not None:
        apply(*pending)
    return trace
