"""vLLM scheduler subclasses that enforce per-user output-token rates (0.32.0-0.34.0).

A thin adapter between upstream's scheduler and ``engine_ext.planner``. Each
``schedule()``, upstream's is wrapped, never copied:

1. The planner decides the step from the running requests and the per-user
   view of the waiting queues (charges, throttled, parked, reclaim victims,
   admission cap).
2. The plan is applied to upstream's state here, in one place: victims are
   preempted through upstream's own preemption; skipped requests get
   ``next_decode_eligible_step`` past this step (upstream's running loop then
   passes over them; they keep their KV blocks and slot) and move to the tail
   of ``running`` (upstream preempts from the tail when KV blocks run short);
   ``max_num_active_reqs`` is raised for the step so throttled requests hold
   no active slot, ``max_num_running_reqs`` still bounds residency.
3. Upstream's ``schedule()`` runs with the planner's admission gate on every
   waiting queue of the release (engine_ext/waiting.py): a waiting request is charged when
   upstream's admission reaches it, a user without budget is passed over.
4. The planner's ``settle`` refunds every charge that did not sample.

``update_from_output()`` is not touched, so asynchronous scheduling works.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from engine_ext import vllm_compat
from engine_ext.config import OutputRateConfig
from engine_ext.drafts import DraftLedger
from engine_ext.limiter import ANONYMOUS_USER, USER_ARG, OutputRateLimiter
from engine_ext.metrics import PAYLOAD_FIELD, SchedulerFigures, encode_snapshot
from engine_ext.planner import RECLAIM_COOLDOWN_STEPS, ReclaimStats, Slots, StepPlan, StepPlanner
from engine_ext.stat_logger import engine_metrics_for
from engine_ext.waiting import UserIndexedQueue
from output_rate_core import protocol as p

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = [
    "RECLAIM_COOLDOWN_STEPS",
    "OutputRateAsyncScheduler",
    "OutputRateMixin",
    "OutputRateScheduler",
    "request_user",
]

MAX_WAIT_S = 0.05
# How often idle limiter state and rotation bookkeeping are pruned.
CLEANUP_INTERVAL_STEPS = 256
USAGE_REPORT_INTERVAL_NS = 1_000_000_000
# Fleet demand (streams per user) is restated this often; a user new to this engine
# is reported at the next step (docs/fleet.md).
DEMAND_REPORT_INTERVAL_NS = 250_000_000
# A user new here is reported at once, but no sooner than this (125 ms) after the last
# report: half the demand frames a second the control plane takes from one engine.
DEMAND_MIN_SPACING_NS = int(2e9 / p.MAX_DEMAND_FRAMES_PER_S)
assert DEMAND_MIN_SPACING_NS < DEMAND_REPORT_INTERVAL_NS


def request_user(request: Request) -> str:
    """The rate-limit identity of a request (``vllm_xargs.output_rate_user``)."""
    params = request.sampling_params
    extra = params.extra_args if params is not None else None
    user = extra.get(USER_ARG) if extra else None
    return user if isinstance(user, str) and user else ANONYMOUS_USER


class OutputRateMixin:
    """Per-user output-rate enforcement around ``Scheduler.schedule()``.

    Mixed into both upstream scheduler classes; relies on their attributes
    (listed in engine_ext/vllm_compat.py).
    """

    running: list[Request]
    waiting: Any
    kv_holding_waiting: Any
    requests: dict[str, Request]
    finished_req_ids: set[str]
    current_step: int
    max_num_active_reqs: int
    max_num_running_reqs: int
    max_num_scheduled_tokens: int
    num_waiting_for_streaming_input: int
    policy: Any
    log_stats: bool

    def _init_output_rate(self, vllm_config: Any) -> None:
        vllm_compat.check_vllm_version()
        vllm_compat.require_attributes(Scheduler, vllm_compat.SCHEDULER_METHODS, "Scheduler")
        waiting_queues = vllm_compat.release().waiting_queues
        vllm_compat.require_attributes(
            self, vllm_compat.SCHEDULER_ATTRIBUTES + waiting_queues, "Scheduler"
        )
        self.output_rate_config = OutputRateConfig.from_vllm_config(vllm_config)
        self.output_rate_clock_ns: Callable[[], int] = time.monotonic_ns
        # request -> rate-limit identity, for every request the scheduler holds
        # (added in add_request, dropped once upstream has freed the request).
        self.output_rate_users: dict[Request, str] = {}
        # request id -> request, for the same requests (upstream names freed ones by id).
        self._output_rate_requests: dict[str, Request] = {}
        self.output_rate_planner = StepPlanner(
            OutputRateLimiter(
                self.output_rate_config.default_rate, self.output_rate_config.user_rates
            ),
            self.output_rate_users,
        )
        config = self.output_rate_config
        if config.default_ceiling is not None or config.user_ceilings:
            self.output_rate_limiter.replace_ceilings(
                None if config.default_ceiling is None else config.default_ceiling * p.MILLI,
                {
                    user: None if ceiling is None else ceiling * p.MILLI
                    for user, ceiling in config.user_ceilings.items()
                },
            )
        # Every waiting queue, indexed by user so that a step's admission
        # costs O(users with waiting requests), not O(waiting requests).
        self._waiting_queues = tuple(
            UserIndexedQueue(self.policy, self._user_of) for _ in waiting_queues
        )
        for name, queue in zip(waiting_queues, self._waiting_queues, strict=True):
            setattr(self, name, queue)
        # The control-plane client, attached by the engine-core side, and how an idle
        # engine sends its stats (set by the engine-core side; None: it cannot).
        self.push_client: Any = None
        self.output_rate_publish_stats: Callable[[Any], None] | None = None
        # (applied version, in sync, refusals) as the last idle stats showed them.
        self._published_link: tuple[int, bool, int] | None = None
        self._next_usage_report_ns = 0
        self._next_demand_report_ns = 0
        # A request of a user the control plane has no demand of from this engine came.
        self._new_demand = False
        self._last_demand_report_ns = -DEMAND_MIN_SPACING_NS
        # metrics: engine figures on vLLM's /metrics (engine_ext/metrics.py); None if log stats off.
        self.output_rate_metrics = engine_metrics_for(self.output_rate_config, self.log_stats)
        if self.output_rate_metrics is not None:
            self.output_rate_planner.count_granted = True
        # Speculative decoding: drafts charged at dispatch, settled by what was emitted.
        self.output_rate_drafts: DraftLedger | None = None
        if vllm_config.speculative_config is not None:
            self.output_rate_drafts = DraftLedger(
                self.output_rate_limiter,
                self.output_rate_users,
                is_async=isinstance(self, AsyncScheduler),
                clock_ns=lambda: self.output_rate_clock_ns(),
            )
            self.output_rate_planner.counts_at_dispatch = False

    @property
    def output_rate_limiter(self) -> OutputRateLimiter:
        return self.output_rate_planner.limiter

    @output_rate_limiter.setter
    def output_rate_limiter(self, limiter: OutputRateLimiter) -> None:
        self.output_rate_planner.limiter = limiter
        if self.output_rate_drafts is not None:
            self.output_rate_drafts.limiter = limiter

    @property
    def reclaim_stats(self) -> ReclaimStats:
        return self.output_rate_planner.reclaim_stats

    def use_fake_clock(self, clock_ns: Callable[[], int]) -> None:
        """Test seam: drive the limiter and the wake-up time from a fake clock."""
        self.output_rate_clock_ns = clock_ns
        self.output_rate_limiter = self.output_rate_limiter.with_clock(clock_ns)

    def _user_of(self, request: Request) -> str:
        return self.output_rate_users[request]

    def _forget_freed_requests(self) -> None:
        """Drop the requests upstream freed since its last ``schedule()``.

        Upstream lists their ids in ``finished_req_ids`` until its next
        ``schedule()`` ends (and frees none inside one).
        """
        known = self._output_rate_requests
        for req_id in self.finished_req_ids:
            request = known.get(req_id)
            if request is not None and self.requests.get(req_id) is not request:
                del known[req_id], self.output_rate_users[request]

    # ---- vLLM hooks -----------------------------------------------------

    def add_request(self, request: Request) -> None:
        # A request id the scheduler holds is a streaming session's next input,
        # merged by upstream into the request it has.
        if request.request_id not in self.requests:
            old = self._output_rate_requests.pop(request.request_id, None)
            if old is not None:  # the id of a request freed since the last step
                del self.output_rate_users[old]
            user = self.output_rate_users[request] = request_user(request)
            self._output_rate_requests[request.request_id] = request
            push = self.push_client
            if push is not None and user not in push.demand_sent:
                self._new_demand = True
        super().add_request(request)  # type: ignore[misc]

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        drafts = self.output_rate_drafts
        if drafts is not None:
            self._count_served(drafts.settle())
        self._forget_freed_requests()
        self.apply_control_plane_updates()
        self._maybe_report_demand()
        planner = self.output_rate_planner
        if planner.limiter.is_unlimited:
            planner.wakeup_ns = None
            return super().schedule(throttle_prefills)  # type: ignore[misc]

        # schedule() increments current_step first; this is the step it will run.
        step = self.current_step + 1
        slots = Slots(
            max_active=self.max_num_active_reqs,
            max_running=self.max_num_running_reqs,
            num_held=len(self.running) + self.num_waiting_for_streaming_input,
            max_chunk=self.max_num_scheduled_tokens,
            holds_prefill_chunks=vllm_compat.holds_prefill_chunks(self),
        )
        waiting = self._waiting_queues
        plan, gate = planner.plan(self.running, waiting, slots, step)
        self._apply_plan(plan, step)
        if drafts is not None:
            # The plan's requests are upstream's, which the ledger reads more of.
            drafts.allot(cast("list[Request]", [*plan.covered, *plan.charged]))
            if plan.borrowed:
                drafts.cut(cast("list[Request]", plan.borrowed))
        saved_active_cap = self.max_num_active_reqs
        if plan.admission_cap is not None:
            self.max_num_active_reqs = plan.admission_cap
        for queue in waiting:
            queue.install_gate(gate)
        try:
            output = super().schedule(throttle_prefills)  # type: ignore[misc]
        finally:
            self.max_num_active_reqs = saved_active_cap
            for queue in waiting:
                queue.remove_gate()
        planner.settle(plan, gate, output.num_scheduled_tokens, step)
        if drafts is not None:
            drafts.dispatch(
                self.requests,
                output.num_scheduled_tokens,
                output.scheduled_spec_decode_tokens,
                step,
            )
        if self.output_rate_metrics is not None:  # metrics: O(throttled users)
            self.output_rate_metrics.on_step(planner.num_granted, len(plan.throttled))
        if step % CLEANUP_INTERVAL_STEPS == 0:
            planner.cleanup(self.requests, step)
        self._maybe_report_usage()
        return output

    def _apply_plan(self, plan: StepPlan, step: int) -> None:
        """The plan's changes to upstream's state, all of them."""
        if plan.victims:
            victim_ids = {id(r) for r in plan.victims}
            self.running = [r for r in self.running if id(r) not in victim_ids]
            timestamp = time.monotonic()
            for victim in plan.victims:
                vllm_compat.preempt_request(self, victim, timestamp)
        skipped = plan.parked + plan.throttled
        if not skipped and not plan.borrowed:
            return
        for request in skipped:
            if request.next_decode_eligible_step <= step:
                request.next_decode_eligible_step = step + 1
        # Skipped requests go to the tail, throttled last: upstream preempts
        # from the tail (running[-1]), so they lose their KV blocks first. Borrowed
        # ones go right before them: scheduled after every other running request (the
        # token budget's rest), preempted before them.
        moved = plan.borrowed + skipped
        moved_ids = {id(r) for r in moved}
        self.running = [r for r in self.running if id(r) not in moved_ids] + moved  # type: ignore[operator]

    # ---- engine loop and control plane -------------------------------------

    def output_rate_wait_s(self, now_ns: int | None = None) -> float:
        """How long an engine whose step ran no model may wait for input."""
        wakeup = self.output_rate_planner.wakeup_ns
        if wakeup is None:
            return MAX_WAIT_S
        now = self.output_rate_clock_ns() if now_ns is None else now_ns
        return max(0.0, min(MAX_WAIT_S, (wakeup - now) / 1e9))

    def attach_push_client(self, client: Any) -> None:
        """Take limits from (and report usage to) a started control-plane client."""
        self.push_client = client
        self.output_rate_planner.count_granted = True
        self.apply_control_plane_updates()

    def has_requests(self) -> bool:
        # The engine loop asks this on its own thread, also while idle after a
        # WAKEUP: a limit update that woke it is applied (and acknowledged)
        # now, not when the next request arrives.
        self.apply_control_plane_updates()
        if super().has_requests():  # type: ignore[misc]
            return True
        # Idle: no schedule() reports the demand that ended with the last request, and a
        # share left here would sit unused while the user's other engines need it. Nor
        # the whole demand the control plane answers with a full table of shares (due
        # after each snapshot and each gap): without one the engine takes no share
        # message, so not the fleet size its safe shares divide by.
        push = self.push_client
        if push is not None and (push.demand_sent or push.demand_due):
            push.report_demand({})
        self._publish_link_figures()
        return False

    def _publish_link_figures(self) -> None:
        """An idle engine sends no stats, so /metrics would not show its link to the
        control plane changing (a refused engine id, a lost or regained connection): when
        it changed, one SchedulerStats with the metrics snapshot goes out now."""
        push, publish = self.push_client, self.output_rate_publish_stats
        if push is None or publish is None or self.output_rate_metrics is None:
            return
        link = (push.applied_version, push.is_in_sync, sum(push.refusals.values()))
        if link == self._published_link:
            return
        self._published_link = link
        stats = self.make_stats()
        if stats is not None:
            publish(stats)

    def apply_control_plane_updates(self) -> None:
        if self.push_client is not None:
            self.push_client.apply_pending(self.output_rate_limiter, self.output_rate_clock_ns())

    def _maybe_report_demand(self) -> None:
        """Tell the control plane this engine's streams per fleet-limited user."""
        push = self.push_client
        if push is None:
            return
        now = self.output_rate_clock_ns()
        due = push.demand_due or now >= self._next_demand_report_ns
        spaced = now >= self._last_demand_report_ns + DEMAND_MIN_SPACING_NS
        if not (due or (self._new_demand and spaced)):
            return
        self._last_demand_report_ns = now
        self._next_demand_report_ns = now + DEMAND_REPORT_INTERVAL_NS
        self._new_demand = False
        push.report_demand(*self._fleet_demand(push.table.is_fleet_limited))

    def _fleet_demand(
        self, is_fleet_limited: Callable[[str], bool]
    ) -> tuple[dict[str, int], frozenset[str]]:
        """The streams per fleet-limited user that a share here can serve, and the users
        none of whose requests can run (docs/fleet.md, "Demand"). While every running slot
        is taken, a user's waiting requests wait for a slot, not for its share: a user that
        runs some counts only those; one that runs none counts all of them and is stalled."""
        users = self.output_rate_users
        streams = Counter(users.values())
        fleet = {user: n for user, n in streams.items() if is_fleet_limited(user)}
        if len(self.running) < self.max_num_running_reqs:
            return fleet, frozenset()
        running = Counter(users[request] for request in self.running if request in users)
        stalled = frozenset(user for user in fleet if not running[user])
        return {user: running[user] or n for user, n in fleet.items()}, stalled

    def _count_served(self, num_emitted: Counter[str]) -> None:
        planner = self.output_rate_planner
        if num_emitted and (planner.count_granted or planner.limiter.has_shadow):
            planner.count_served(num_emitted)

    def _maybe_report_usage(self) -> None:
        metrics = self.output_rate_metrics
        if self.push_client is None and metrics is None:
            return
        now = self.output_rate_clock_ns()
        if now < self._next_usage_report_ns:
            return
        self._next_usage_report_ns = now + USAGE_REPORT_INTERVAL_NS
        granted, throttled, would = self.output_rate_planner.take_usage()
        borrowed = self.output_rate_planner.take_borrowed()
        if metrics is not None:  # metrics: the same counts, before the push client owns them
            metrics.add_usage(granted, throttled, self._tier_of(), would, borrowed)
        if self.push_client is not None:
            self.push_client.report_usage(
                granted=granted, throttled=throttled, would_throttle=would, borrowed=borrowed
            )

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        # metrics: a snapshot rides on vLLM's SchedulerStats about once a second, and
        # when the last request finished (an idle engine sends no stats).
        stats = super().make_stats(*args, **kwargs)  # type: ignore[misc]
        metrics = self.output_rate_metrics
        if stats is None or metrics is None:
            return stats
        if not self.requests:
            self._next_usage_report_ns = 0
            self._maybe_report_usage()
        if metrics.snapshot_due() or not self.requests:
            snapshot = metrics.snapshot(self.output_rate_figures())
            setattr(stats, PAYLOAD_FIELD, encode_snapshot(snapshot))
        return stats

    def output_rate_figures(self) -> SchedulerFigures:
        """What the engine's metrics show of this scheduler (read-only)."""
        limiter = self.output_rate_limiter
        push = self.push_client
        stats = self.reclaim_stats
        return SchedulerFigures(
            rate_of=limiter.rate_of,
            default_rate=limiter.default_rate,
            is_unlimited=limiter.is_unlimited,
            num_reclaims=stats.num_reclaims,
            num_reclaimed_tokens=stats.num_tokens_dropped,
            config_version=None if push is None else push.applied_version,
            connected=None if push is None else push.is_in_sync,
            tier_of=self._tier_of(),
            fleet_size=None if push is None else push.table.num_engines,
            num_shares=None if push is None else len(push.table.fleet.shares),
            shares_leased=None if push is None else push.table.fleet.lease_expires_ns is not None,
            refusals=None if push is None else dict(push.refusals),
        )

    def _tier_of(self) -> Callable[[str], str | None]:
        """user -> its tier in the control plane's table (None without a control plane)."""
        push = self.push_client
        return (lambda user: None) if push is None else push.table.tier_of


class OutputRateScheduler(OutputRateMixin, Scheduler):
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self._init_output_rate(vllm_config)


class OutputRateAsyncScheduler(OutputRateMixin, AsyncScheduler):
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self._init_output_rate(vllm_config)
