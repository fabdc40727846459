"""Build the real vLLM schedulers in-process on the CPU, and drive them.

The model runner is the only fake: ``ModelRunnerOutput`` objects are built by
hand, one sampled token per scheduled sampling request, as vLLM's own
scheduler tests do (with speculative decoding, ``drive_speculative``: the
drafter's proposals and the number of drafts accepted are drawn at random).
The KV cache manager, request queues and scheduling logic are the real ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
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
    user_ceilings: dict[str, int | None] | None = None,
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
    num_speculative_tokens: int | None = None,
) -> Scheduler:
    """The output-rate scheduler (or upstream's with ``limited=False``).

    ``num_speculative_tokens``: n-gram speculative decoding with that many drafts
    (the drafter is ``drive_speculative``'s fake; asynchronous scheduling takes
    vLLM's GPU n-gram method, the one it schedules asynchronously).

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
    rate_config = OutputRateConfig(
        default_rate=default_rate,
        user_rates=dict(user_rates or {}),
        user_ceilings=dict(user_ceilings or {}),
    )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        device_config=DeviceConfig("cpu"),
        speculative_config=(
            None
            if num_speculative_tokens is None
            # vLLM schedules n-gram drafts asynchronously only with its GPU drafter.
            else SpeculativeConfig(
                method="ngram_gpu" if async_scheduling else "ngram",
                num_speculative_tokens=num_speculative_tokens,
            )
        ),
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
    arrival_time: float = 0.0,
) -> Request:
    """A request of ``user``; ``structured`` ones wait for a grammar (``compile_grammar``).

    ``arrival_time`` (seconds) orders equal priorities in a priority queue.
    """
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
        arrival_time=arrival_time,
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
    return model_runner_output(req_ids, sampled)


def model_runner_output(req_ids: list[str], sampled: list[list[int]]) -> ModelRunnerOutput:
    """What the model runner returns: ``sampled[i]`` are the tokens of ``req_ids[i]``."""
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


@dataclass(frozen=True)
class Delivery:
    """The tokens one sampled step gave one request."""

    dispatched_ns: int  # when the step was scheduled (its tokens were charged)
    request_id: str
    num_tokens: int  # after vLLM trimmed what a stop left out
    num_proposed: int  # drafts the request held when schedule() began
    num_drafts: int  # drafts scheduled for the step
    num_accepted: int


@dataclass
class SpecTrace:
    deliveries: list[Delivery] = field(default_factory=list)
    outputs: list[SchedulerOutput] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)


def drive_speculative(
    scheduler: Scheduler,
    *,
    num_steps: int,
    rng: Any,
    clock: FakeClock | None = None,
    step_ms: float = 10.0,
    accept_probability: float = 0.6,
    eos_probability: float = 0.0,
    on_step: Callable[[int], Any] | None = None,
    keep_outputs: bool = False,
) -> SpecTrace:
    """Run the engine loop with speculative decoding; the model runner and its
    drafter are the fakes (a narrow seam).

    Each draft of a step is accepted with ``accept_probability`` until the first
    rejection, then the bonus token is sampled; every sampled token is EOS with
    ``eos_probability`` (vLLM trims what follows a stop). Synchronous schedulers
    get new drafts (0 to ``num_spec_tokens``, at random) after each step, as the
    engine's n-gram drafter gives them; asynchronous ones keep upstream's
    placeholders (the drafts live in the worker) and the one-step overlap.
    """
    trace = SpecTrace()
    is_async = isinstance(scheduler, AsyncScheduler)
    max_drafts = scheduler.num_spec_tokens
    pending: tuple[int, dict[str, int], SchedulerOutput, ModelRunnerOutput] | None = None

    def model_output(sched_out: SchedulerOutput) -> ModelRunnerOutput:
        req_ids = list(sched_out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            if scheduler.requests[req_id].is_prefill_chunk:
                sampled.append([])
                continue
            num_drafts = len(sched_out.scheduled_spec_decode_tokens.get(req_id, ()))
            num_accepted = 0
            while num_accepted < num_drafts and rng.random() < accept_probability:
                num_accepted += 1
            sampled.append(
                [
                    EOS_TOKEN_ID if rng.random() < eos_probability else SAMPLED_TOKEN_ID
                    for _ in range(num_accepted + 1)
                ]
            )
        return model_runner_output(req_ids, sampled)

    def apply(
        dispatched_ns: int,
        proposed: dict[str, int],
        sched_out: SchedulerOutput,
        out: ModelRunnerOutput,
    ) -> None:
        engine_outputs = scheduler.update_from_output(sched_out, out)
        # request id -> tokens the step gave it, as the engine streams them.
        received: dict[str, int] = {}
        for eco in engine_outputs.values():
            for o in eco.outputs:
                received[o.request_id] = len(o.new_token_ids)
                if o.finish_reason is not None:
                    trace.finished.add(o.request_id)
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
            if req_id in received:
                num_drafts = len(sched_out.scheduled_spec_decode_tokens.get(req_id, ()))
                trace.deliveries.append(
                    Delivery(
                        dispatched_ns,
                        req_id,
                        received[req_id],
                        proposed.get(req_id, 0),
                        num_drafts,
                        len(tokens) - 1,
                    )
                )
        if not is_async:
            # The drafter proposes for the requests of the step that go on decoding.
            decoding = [
                r
                for r in out.req_ids
                if r in scheduler.requests and not scheduler.requests[r].is_prefill_chunk
            ]
            drafts = [[SAMPLED_TOKEN_ID] * rng.randint(0, max_drafts) for _ in decoding]
            scheduler.update_draft_token_ids(DraftTokenIds(decoding, drafts))

    for step in range(num_steps):
        if on_step is not None:
            on_step(step)
        now = clock() if clock else 0
        proposed = {r.request_id: len(r.spec_token_ids) for r in scheduler.running}
        sched_out = scheduler.schedule()
        if keep_outputs:
            trace.outputs.append(sched_out)
        out = model_output(sched_out)
        if is_async:
            if pending is not None:
                apply(*pending)
            pending = (now, proposed, sched_out, out)
        else:
            apply(now, proposed, sched_out, out)
        if clock is not None:
            clock.advance_ms(step_ms)
    if pending is not None:
        apply(*pending)
    return trace
