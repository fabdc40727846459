"""With no binding limit, the output-rate schedulers decide exactly as upstream.

The same request trace runs through vLLM's own Scheduler/AsyncScheduler and
through ours; every SchedulerOutput is compared field by field.
"""

from __future__ import annotations

import random

import pytest
from vllm.v1.core.sched.output import SchedulerOutput

from tests.engine_ext.sched_helpers import FakeClock, drive, make_request, make_scheduler


def trace_requests(seed: int) -> list[tuple[int, dict]]:
    """(arrival step, make_request kwargs) for a mixed workload."""
    rng = random.Random(seed)
    shared_prefix = [rng.randrange(3, 250) for _ in range(48)]
    arrivals = []
    for i in range(40):
        if rng.random() < 0.3:
            prompt = shared_prefix + [rng.randrange(3, 250) for _ in range(rng.randint(1, 20))]
        else:
            prompt = [rng.randrange(3, 250) for _ in range(rng.randint(1, 300))]
        kwargs = {
            "prompt_token_ids": prompt,
            "max_tokens": rng.randint(1, 120),
            "request_id": f"r{i}",
        }
        arrivals.append((rng.randint(0, 150), kwargs | {"user": rng.choice(["a", "b", None])}))
    return arrivals


def summarize(out: SchedulerOutput) -> tuple:
    return (
        dict(out.num_scheduled_tokens),
        sorted(r.req_id for r in out.scheduled_new_reqs),
        sorted(out.scheduled_cached_reqs.req_ids),
        sorted(out.finished_req_ids),
        sorted(out.preempted_req_ids or ()),
        out.total_num_scheduled_tokens,
    )


def run(*, limited: bool, async_scheduling: bool, default_rate: int | None) -> list[tuple]:
    clock = FakeClock()
    sched = make_scheduler(
        async_scheduling=async_scheduling,
        limited=limited,
        default_rate=default_rate,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        num_blocks=36,  # tight: forces preemptions
        enable_prefix_caching=True,
        clock=clock,
    )
    arrivals = trace_requests(seed=11)

    def arrive(step: int) -> None:
        for at, kwargs in arrivals:
            if at == step:
                sched.add_request(make_request(**kwargs))

    trace = drive(sched, num_steps=900, clock=clock, step_ms=10, on_step=arrive, keep_outputs=True)
    assert len(trace.finished) == len(arrivals)
    return [summarize(o) for o in trace.outputs]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("default_rate", [None, 1_000_000], ids=["no-limits", "limit-not-binding"])
def test_same_decisions_as_upstream(async_scheduling: bool, default_rate: int | None) -> None:
    upstream = run(limited=False, async_scheduling=async_scheduling, default_rate=None)
    ours = run(limited=True, async_scheduling=async_scheduling, default_rate=default_rate)
    preempted = sum(len(s[4]) for s in upstream)
    assert preempted > 0, "the trace should exercise preemption"
    for step, (want, got) in enumerate(zip(upstream, ours, strict=True)):
        assert got == want, f"step {step} differs"
