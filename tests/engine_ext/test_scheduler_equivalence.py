"""With no binding limit, the output-rate schedulers decide exactly as upstream.

The same request trace runs through vLLM's own Scheduler/AsyncScheduler and
through ours; every SchedulerOutput is compared field by field. A user whose
limit is in shadow is scheduled exactly as an unlimited one, however binding the
limit (beside enforced users or with everyone in shadow).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from vllm.config import SchedulerConfig
from vllm.v1.core.sched.output import SchedulerOutput

from engine_ext import vllm_compat
from engine_ext.limit_table import LimitTable
from engine_ext.planner import AdmissionGate, StepPlan, StepPlanner
from harness.scheduler import (
    FakeClock,
    compile_grammar,
    drive,
    make_request,
    make_scheduler,
)
from output_rate_core import protocol as p


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


def crowded_trace_requests(seed: int) -> list[tuple[int, dict]]:
    """Bursts of arrivals far beyond the free slots, long prompts that meet the
    long-prefill threshold, and structured-output requests whose grammar
    compiles a few steps after arrival (upstream passes over them meanwhile)."""
    rng = random.Random(seed)
    arrivals = []
    for i in range(48):
        burst = rng.choice([0, 0, 40, 90, 160])
        prompt = [rng.randrange(3, 250) for _ in range(rng.choice([5, 30, 200, 500]))]
        kwargs = {
            "prompt_token_ids": prompt,
            "max_tokens": rng.randint(1, 60),
            "request_id": f"c{i}",
            "structured": rng.random() < 0.25,
            "user": rng.choice(["a", "b", "c", None]),
        }
        arrivals.append((burst + rng.randint(0, 3), kwargs))
    return arrivals


def priority_trace_requests(seed: int) -> list[tuple[int, dict]]:
    """The mixed workload with priorities, for the priority policy: with few KV blocks
    the lowest-priority running request can preempt itself (vLLM 0.33 on, upstream
    then goes on with the requests after it)."""
    rng = random.Random(seed)
    return [(at, kwargs | {"priority": rng.randrange(4)}) for at, kwargs in trace_requests(11)]


SCENARIOS: dict[str, dict[str, Any]] = {
    "mixed": {
        "arrivals": trace_requests(seed=11),
        "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 128, "num_blocks": 36},
    },
    "crowded": {
        "arrivals": crowded_trace_requests(seed=5),
        "scheduler": {
            "max_num_seqs": 4,
            "max_num_batched_tokens": 256,
            "long_prefill_token_threshold": 96,
            "num_blocks": 80,
        },
    },
    # The case: one slot, a threshold of 400 and two waiting requests.
    "long-prefill": {
        "arrivals": [
            (
                0,
                {
                    "prompt_token_ids": [5 + i % 200 for i in range(900)],
                    "request_id": "long",
                    "user": "a",
                },
            ),
            (0, {"num_prompt_tokens": 8, "request_id": "short", "user": "b"}),
        ],
        "scheduler": {
            "max_num_seqs": 1,
            "max_num_batched_tokens": 1024,
            "long_prefill_token_threshold": 400,
        },
    },
    "priority": {
        "arrivals": priority_trace_requests(seed=3),
        "scheduler": {
            "max_num_seqs": 8,
            "max_num_batched_tokens": 128,
            "num_blocks": 36,
            "scheduler_options": {"policy": "priority"},
        },
    },
    # Prefill only every 3rd step while something decodes: from vLLM 0.33 the scheduler
    # holds prefill chunks and admissions on its own (before, only with data parallelism).
    "prefill-cadence": {
        "arrivals": trace_requests(seed=7),
        "scheduler": {
            "max_num_seqs": 8,
            "max_num_batched_tokens": 128,
            "num_blocks": 60,
            "scheduler_options": {"prefill_schedule_interval": 3},
        },
    },
    # vLLM 0.34's cache-aware admission: the waiting requests with a cached prefix go
    # first within a window of the queue (every step: threshold 0).
    "cache-aware": {
        "arrivals": trace_requests(seed=11),
        "scheduler": {
            "max_num_seqs": 8,
            "max_num_batched_tokens": 96,
            "num_blocks": 40,
            "scheduler_options": {
                "cache_aware_admission_window": 8,
                "cache_aware_admission_threshold": 0.0,
            },
        },
    },
}


def scenario_params() -> list[Any]:
    """Every scenario, skipped on a release without the scheduler options it needs."""
    fields = SchedulerConfig.__dataclass_fields__
    params = []
    for name, scenario in SCENARIOS.items():
        missing = set(scenario["scheduler"].get("scheduler_options", {})) - fields.keys()
        reason = f"this vLLM's scheduler has no {', '.join(sorted(missing))}"
        params.append(pytest.param(name, marks=pytest.mark.skipif(bool(missing), reason=reason)))
    return params


def summarize(out: SchedulerOutput) -> tuple:
    return (
        dict(out.num_scheduled_tokens),
        sorted(r.req_id for r in out.scheduled_new_reqs),
        sorted(out.scheduled_cached_reqs.req_ids),
        sorted(out.finished_req_ids),
        sorted(out.preempted_req_ids or ()),
        out.total_num_scheduled_tokens,
    )


def run(
    scenario: str,
    *,
    limited: bool,
    async_scheduling: bool,
    default_rate: int | None,
    snapshot: p.Snapshot | None = None,
) -> list[tuple]:
    return run_scheduler(
        scenario,
        limited=limited,
        async_scheduling=async_scheduling,
        default_rate=default_rate,
        snapshot=snapshot,
    )[0]


def run_scheduler(
    scenario: str,
    *,
    limited: bool,
    async_scheduling: bool,
    default_rate: int | None,
    snapshot: p.Snapshot | None = None,
) -> tuple[list[tuple], Any]:
    """(every step's summary, the scheduler); ``snapshot``: limits as the control plane
    would send them, installed through the engine's limit table."""
    clock = FakeClock()
    sched = make_scheduler(
        async_scheduling=async_scheduling,
        limited=limited,
        default_rate=default_rate,
        enable_prefix_caching=True,
        clock=clock,
        **SCENARIOS[scenario]["scheduler"],
    )
    if snapshot is not None:
        LimitTable.from_snapshot(snapshot).load(sched.output_rate_limiter)
    arrivals = SCENARIOS[scenario]["arrivals"]
    # step -> structured-output requests whose grammar is ready at that step.
    grammars_ready: dict[int, list] = {}

    def arrive(step: int) -> None:
        for request in grammars_ready.pop(step, []):
            compile_grammar(request)
        for at, kwargs in arrivals:
            if at == step:
                request = make_request(**kwargs)
                sched.add_request(request)
                if kwargs.get("structured"):
                    grammars_ready.setdefault(step + 1 + len(kwargs["request_id"]), []).append(
                        request
                    )

    trace = drive(sched, num_steps=900, clock=clock, step_ms=10, on_step=arrive, keep_outputs=True)
    assert len(trace.finished) == len(arrivals)
    return [summarize(o) for o in trace.outputs], sched


@pytest.mark.parametrize("scenario", scenario_params())
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("default_rate", [None, 1_000_000], ids=["no-limits", "limit-not-binding"])
def test_same_decisions_as_upstream(
    scenario: str, async_scheduling: bool, default_rate: int | None
) -> None:
    upstream = run(scenario, limited=False, async_scheduling=async_scheduling, default_rate=None)
    ours = run(scenario, limited=True, async_scheduling=async_scheduling, default_rate=default_rate)
    if scenario in ("mixed", "priority"):
        preempted = sum(len(s[4]) for s in upstream)
        assert preempted > 0, "the trace should exercise preemption"
    for step, (want, got) in enumerate(zip(upstream, ours, strict=True)):
        assert got == want, f"step {step} differs"


@pytest.mark.parametrize("scenario", scenario_params())
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_upstream_schedules_only_running_requests_and_those_the_gate_admitted(
    scenario: str, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """settle() counts covered requests instead of looking each one up, which is
    exact only if upstream schedules nothing but the requests running when the
    plan was made and those its admission took through the gate. Checked at
    every step with a binding limit, against looking every request up."""
    running_at_plan: list[set[str]] = []
    num_steps = [0, 0]  # checked, with a charged request left unscheduled
    real_plan, real_all_scheduled = StepPlanner.plan, StepPlanner._all_scheduled

    def plan(self: StepPlanner, running, *args):  # type: ignore[no-untyped-def]
        running_at_plan.append({r.request_id for r in running})
        return real_plan(self, running, *args)

    def all_scheduled(plan: StepPlan, gate: AdmissionGate, num_scheduled) -> bool:  # type: ignore[no-untyped-def]
        assert num_scheduled.keys() <= running_at_plan.pop() | gate.charged.keys()
        charged = plan.covered + plan.charged + list(gate.charged.values())
        looked_up = all(r.request_id in num_scheduled for r in charged)
        assert real_all_scheduled(plan, gate, num_scheduled) == looked_up
        num_steps[0] += 1
        num_steps[1] += not looked_up
        return looked_up

    monkeypatch.setattr(StepPlanner, "plan", plan)
    monkeypatch.setattr(StepPlanner, "_all_scheduled", staticmethod(all_scheduled))
    run(scenario, limited=True, async_scheduling=async_scheduling, default_rate=150)
    assert num_steps[0] > 100
    if scenario != "long-prefill":
        assert num_steps[1] > 0, "the trace should leave a charged request unscheduled"


def _snapshot(
    *,
    default_rate: int | None = None,
    default_enforcement: p.Enforcement | None = None,
    users: dict[str, tuple[str | None, int | None]] | None = None,
    user_enforcements: dict[str, p.Enforcement] | None = None,
) -> p.Snapshot:
    return p.Snapshot(
        version=1,
        default_rate=default_rate,
        tiers={"slow": 20},
        users=users or {},
        default_enforcement=default_enforcement,
        tier_enforcements={"slow": "shadow"},
        user_enforcements=user_enforcements or {},
    )


@pytest.mark.parametrize("scenario", scenario_params())
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_shadow_user_beside_an_enforced_one_is_scheduled_as_unlimited(
    scenario: str, async_scheduling: bool
) -> None:
    """User "a" in shadow (its tier's 20 tok/s, far below what it uses) beside "b"
    enforced at 120 tok/s: every step equals the run in which "a" has no limit."""
    shadow, shadow_sched = run_scheduler(
        scenario,
        limited=True,
        async_scheduling=async_scheduling,
        default_rate=None,
        snapshot=_snapshot(users={"a": ("slow", None), "b": (None, 120)}),
    )
    unlimited, unlimited_sched = run_scheduler(
        scenario,
        limited=True,
        async_scheduling=async_scheduling,
        default_rate=None,
        snapshot=_snapshot(users={"b": (None, 120)}),
    )
    for step, (want, got) in enumerate(zip(unlimited, shadow, strict=True)):
        assert got == want, f"step {step} differs"
    planner = shadow_sched.output_rate_planner
    assert planner.num_would_throttle.get("a", 0) > 0, "the shadow limit should bind"
    assert set(planner.num_would_throttle) == {"a"}
    # "b" is held alike in both runs, "a" never (one stream of "b" never binds).
    assert planner.num_throttled == unlimited_sched.output_rate_planner.num_throttled
    assert "a" not in planner.num_throttled
    if scenario != "long-prefill":
        assert planner.num_throttled.get("b", 0) > 0


@pytest.mark.parametrize("scenario", scenario_params())
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_everyone_in_shadow_decides_as_upstream(scenario: str, async_scheduling: bool) -> None:
    """The default in shadow at a binding rate, "b" in shadow on its own override:
    upstream's decisions, step by step, and would-throttles counted."""
    upstream = run(scenario, limited=False, async_scheduling=async_scheduling, default_rate=None)
    ours, sched = run_scheduler(
        scenario,
        limited=True,
        async_scheduling=async_scheduling,
        default_rate=None,
        snapshot=_snapshot(
            default_rate=10,
            default_enforcement="shadow",
            users={"b": (None, 15)},
            user_enforcements={"b": "shadow"},
        ),
    )
    assert not sched.output_rate_limiter.is_unlimited  # the planner runs: shadow is counted
    for step, (want, got) in enumerate(zip(upstream, ours, strict=True)):
        assert got == want, f"step {step} differs"
    planner = sched.output_rate_planner
    assert planner.num_throttled == {}
    assert planner.num_would_throttle.get("b", 0) > 0


@pytest.mark.skipif(
    not vllm_compat.release().has_local_prefill_cadence,
    reason="this vLLM holds prefill only with data parallelism (refused by verification)",
)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_prefill_cadence_mirror_says_when_upstream_passes_over_prefill_chunks(
    async_scheduling: bool,
) -> None:
    """``vllm_compat.holds_prefill_chunks`` (what the planner charges by) against upstream's
    own scheduler on the prefill-cadence trace: in every step it says held, no running
    prefill chunk is scheduled; the trace has held steps and steps that schedule one."""
    sched = make_scheduler(
        async_scheduling=async_scheduling,
        limited=False,
        **SCENARIOS["prefill-cadence"]["scheduler"],
    )
    upstream_schedule = sched.schedule
    num_steps = {True: 0, False: 0}

    def schedule(*args: Any, **kwargs: Any) -> SchedulerOutput:
        held = vllm_compat.holds_prefill_chunks(sched)
        chunks = {r.request_id for r in sched.running if r.is_prefill_chunk}
        output = upstream_schedule(*args, **kwargs)
        scheduled = chunks & output.num_scheduled_tokens.keys()
        if held:
            assert not scheduled
        num_steps[held] += bool(chunks) and (held or bool(scheduled))
        return output

    sched.schedule = schedule  # type: ignore[method-assign]
    arrivals = SCENARIOS["prefill-cadence"]["arrivals"]
    drive(
        sched,
        num_steps=900,
        on_step=lambda step: [
            sched.add_request(make_request(**kwargs)) for at, kwargs in arrivals if at == step
        ],
    )
    assert num_steps[True] > 0 and num_steps[False] > 0, num_steps
