"""vLLM 0.32.0 scheduler subclasses that enforce per-user output-token rates.

The upstream ``schedule()`` is wrapped, never copied:

- Before it, every running request whose step would *sample* (a decode, or the
  prefill chunk that can reach the end of the known sequence) is charged one
  token. A refused request is skipped for this step through the upstream
  ``next_decode_eligible_step`` hook: it stays in ``running`` with its KV
  blocks and slot, and is moved to the tail of ``running`` so that it is the
  first preemption victim when KV blocks run short. The admission cap
  (``max_num_active_reqs``) is raised by the number of throttled requests for
  this step, so they do not hold active slots; the worker-slot count
  (``max_num_running_reqs``) still bounds residency.
- Waiting requests are charged before they are offered to upstream admission;
  those of a user without budget are held back this step.
- After it, charged requests that did not end up sampling (no KV blocks,
  preempted, budget ran out, chunk stopped short) are refunded: the single
  refund point.

``update_from_output()`` is not touched, so asynchronous scheduling works.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from engine_ext.config import OutputRateConfig
from engine_ext.limiter import ANONYMOUS_USER, OutputRateLimiter
from engine_ext.metrics import PAYLOAD_FIELD, scheduler_snapshot, tier_lookup
from engine_ext.stat_logger import engine_metrics_for
from engine_ext.waiting import UserIndexedQueue

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.output_rate." + __name__)

USER_ARG = "output_rate_user"
MAX_WAIT_S = 0.05
# How often idle limiter state and rotation bookkeeping are pruned.
CLEANUP_INTERVAL_STEPS = 256
# Steps during which a request re-admitted after a slot reclaim cannot be
# reclaimed again (see docs/scheduler.md, "Slot reclaim").
RECLAIM_COOLDOWN_STEPS = 32
USAGE_REPORT_INTERVAL_NS = 1_000_000_000


def request_user(request: Request) -> str:
    """The rate-limit identity of a request (``vllm_xargs.output_rate_user``)."""
    params = request.sampling_params
    extra = params.extra_args if params is not None else None
    user = extra.get(USER_ARG) if extra else None
    return user if isinstance(user, str) and user else ANONYMOUS_USER


class _StepPlan:
    """What the pre-pass decided for one ``schedule()`` call."""

    __slots__ = (
        "charged",
        "granted_by_user",
        "parked",
        "throttled",
    )

    def __init__(self) -> None:
        # Running requests charged one token this step.
        self.charged: list[Request] = []
        # user -> that user's charged running requests; built only when needed.
        self.granted_by_user: dict[str, list[Request]] | None = None
        # Running requests refused a token; skipped this step, still resident.
        self.throttled: list[Request] = []
        # Running requests with a token but no active slot; skipped, refunded.
        self.parked: list[Request] = []


class _AdmissionGate:
    """Charges a waiting request's user when upstream's admission loop reaches it.

    Installed on the waiting queues for one ``schedule()``. A user refused once
    stays refused for the step, so the rest of its queue costs nothing.
    """

    __slots__ = ("charged", "limiter", "note_refused", "refused")

    def __init__(
        self,
        limiter: OutputRateLimiter,
        refused: set[str],
        note_refused: Callable[[str, int], None],
    ) -> None:
        self.limiter = limiter
        self.refused = refused
        self.note_refused = note_refused
        # request id -> waiting request charged one token this step.
        self.charged: dict[str, Request] = {}

    def admits(self, user: str, request: Request) -> bool:
        if request.request_id in self.charged:
            return True
        if user in self.refused:
            return False
        if self.limiter.try_take(user):
            self.charged[request.request_id] = request
            return True
        self.refused.add(user)
        self.note_refused(user, 1)
        return False


@dataclass
class ReclaimStats:
    """Slots taken back from throttled requests since the engine started."""

    num_reclaims: int = 0
    # Tokens the reclaimed requests had computed; recomputed on re-admission
    # unless the prefix cache still holds their blocks.
    num_tokens_dropped: int = 0


class OutputRateMixin:
    """Per-user output-rate enforcement around ``Scheduler.schedule()``.

    Mixed into both upstream scheduler classes; relies on their attributes.
    """

    running: list[Request]
    waiting: Any
    kv_holding_waiting: Any
    requests: dict[str, Request]
    current_step: int
    max_num_active_reqs: int
    max_num_running_reqs: int
    max_num_scheduled_tokens: int
    num_waiting_for_streaming_input: int
    requires_kv_delivery: bool
    log_stats: bool
    policy: Any

    def _init_output_rate(self, vllm_config: Any) -> None:
        self.output_rate_config = OutputRateConfig.from_vllm_config(vllm_config)
        self.output_rate_limiter = OutputRateLimiter(
            self.output_rate_config.default_rate, self.output_rate_config.user_rates
        )
        self.output_rate_clock_ns: Callable[[], int] = time.monotonic_ns
        # Earliest time a user refused in the last schedule() gets budget again.
        self.output_rate_wakeup_ns: int | None = None
        # Set by the EngineCore patch; called (from any thread) to end an idle wait.
        self.wake_engine: Callable[[], None] = lambda: None
        # request id -> rate-limit identity, for every request added and not
        # yet pruned (finished requests go at the next cleanup).
        self.output_rate_users: dict[str, str] = {}
        # Both waiting queues, indexed by user so that a step's admission
        # costs O(users with waiting requests), not O(waiting requests).
        user_of = self._user_of
        self.waiting = UserIndexedQueue(self.policy, user_of)
        self.kv_holding_waiting = UserIndexedQueue(self.policy, user_of)
        # user -> request id of the stream that was served last (rotation).
        self._last_served_req: dict[str, str] = {}
        # user -> last step in which it was given an active slot while slots
        # were short (fairness across users).
        self._last_slot_step: dict[str, int] = {}
        # Ids of reclaimed requests not re-admitted yet.
        self._reclaimed: set[str] = set()
        # request id -> first step in which it may be reclaimed again.
        self._reclaim_protected_until: dict[str, int] = {}
        self.reclaim_cooldown_steps = RECLAIM_COOLDOWN_STEPS
        self.reclaim_stats = ReclaimStats()
        # user -> tokens granted / requests throttled since the last usage report.
        self.num_granted: dict[str, int] = {}
        self.num_throttled: dict[str, int] = {}
        self._next_usage_report_ns = 0
        self.push_client: Any = None
        if self.output_rate_config.control_plane_endpoint:
            self._start_push_client(vllm_config)
        # metrics: engine figures on vLLM's /metrics (engine_ext/metrics.py); None if log stats off.
        self.output_rate_metrics = engine_metrics_for(self.output_rate_config, self.log_stats)

    def use_fake_clock(self, clock_ns: Callable[[], int]) -> None:
        """Test seam: drive the limiter and the wake-up time from a fake clock."""
        self.output_rate_clock_ns = clock_ns
        limiter = self.output_rate_limiter
        self.output_rate_limiter = OutputRateLimiter(
            limiter.default_rate, limiter.user_rates(), clock_ns=clock_ns
        )

    def _user_of(self, request: Request) -> str:
        return self.output_rate_users[request.request_id]

    # ---- vLLM hooks -----------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.output_rate_users.setdefault(request.request_id, request_user(request))
        super().add_request(request)  # type: ignore[misc]

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        self.apply_control_plane_updates()
        limiter = self.output_rate_limiter
        if limiter.is_unlimited:
            self.output_rate_wakeup_ns = None
            return super().schedule(throttle_prefills)  # type: ignore[misc]

        plan = _StepPlan()
        # schedule() increments current_step first; this is the step it will run.
        step = self.current_step + 1
        self.output_rate_wakeup_ns = None
        self._plan_running(plan, step)
        refused: set[str] = set()
        if self.waiting:
            if plan.charged:
                self._steal_turns_for_waiting(plan)
            if plan.throttled:
                refused = self._reclaim_slots(plan, step)
        self._skip_running(plan, step)
        gate = _AdmissionGate(limiter, refused, self._note_refused)
        saved_active_cap = self.max_num_active_reqs
        if plan.throttled:
            self.max_num_active_reqs = self._admission_cap(plan)
        self.waiting.install_gate(gate)
        self.kv_holding_waiting.install_gate(gate)
        try:
            output = super().schedule(throttle_prefills)  # type: ignore[misc]
        finally:
            self.max_num_active_reqs = saved_active_cap
            self.waiting.remove_gate()
            self.kv_holding_waiting.remove_gate()
        self._settle(plan, gate, output, step)
        return output

    # ---- pre-pass ---------------------------------------------------------

    def _plan_running(self, plan: _StepPlan, step: int) -> None:
        """Charge every running request whose dispatch this step would sample."""
        max_chunk = self.max_num_scheduled_tokens
        users = self.output_rate_users
        # Until someone is refused, every dispatchable request is charged.
        charged = plan.charged
        charge = charged.append
        num_busy = 0  # running requests that need no token (mid-prefill chunks)
        for request in self.running:
            num_placeholders = request.num_output_placeholders
            num_remaining = (
                request.num_tokens_with_spec + num_placeholders - request.num_computed_tokens
            )
            # Upstream's running loop skips these (decode cadence).
            if num_remaining <= 0 or step < request.next_decode_eligible_step:
                continue
            if num_remaining > max_chunk:
                num_busy += 1  # this chunk cannot reach the end
                continue
            if (
                num_placeholders > 0
                and request.num_computed_tokens + 2 - num_placeholders
                >= request.num_prompt_tokens + request.max_tokens
            ):
                continue  # upstream's async look-ahead stop: nothing to dispatch
            charge(request)
        # One limiter call per step: a user with several streams asks for all
        # of their tokens at once.
        num_wanted = Counter([users[r.request_id] for r in charged])
        num_got = self.output_rate_limiter.take_many(num_wanted)
        if num_got:
            self._rotate_contended(plan, num_got)
        plan.parked = self._park_over_active_cap(plan, num_busy)

    def _rotate_contended(self, plan: _StepPlan, num_got: dict[str, int]) -> None:
        """For users that ran short, hand their tokens to streams in rotation order.

        ``num_got`` maps each such user to the tokens it got. The same number of
        tokens goes to the streams that come first after the one served last.
        """
        users = self.output_rate_users
        # user -> its dispatchable streams in ``running`` order; filled in the
        # order in which the users ran out, which is also the order their
        # throttled streams go to the tail of ``running``.
        streams_of: dict[str, list[Request]] = {user: [] for user in num_got}
        refused: dict[str, list[Request]] = {}
        kept: list[Request] = []
        for request in plan.charged:
            user = users[request.request_id]
            streams = streams_of.get(user)
            if streams is None:
                kept.append(request)
                continue
            streams.append(request)
            if len(streams) == num_got[user] + 1:
                refused[user] = streams
        for user, streams in refused.items():
            num_granted = num_got[user]
            if num_granted:
                streams = self._rotate(user, streams)
                kept.extend(streams[:num_granted])
                self._last_served_req[user] = streams[num_granted - 1].request_id
            plan.throttled.extend(streams[num_granted:])
            self._note_refused(user, len(streams) - num_granted)
        plan.charged = kept

    def _num_free_slots(self) -> int:
        """Worker slots nobody holds (paused streaming sessions hold one too)."""
        return self.max_num_running_reqs - len(self.running) - self.num_waiting_for_streaming_input

    def _num_free_active_slots(self, plan: _StepPlan) -> int:
        """Admissions the active limit allows this step, were worker slots unbounded."""
        num_slots_used = len(self.running) + self.num_waiting_for_streaming_input
        return self.max_num_active_reqs + len(plan.throttled) - num_slots_used

    def _steal_turns_for_waiting(self, plan: _StepPlan) -> None:
        """Give a token granted to a running stream to the user's first waiting one.

        A waiting stream has never been served, so in the user's rotation it
        comes before every running stream; without this, running streams that
        keep the budget busy would starve the user's queued requests forever.
        Only where a slot is free for it: a user's throttled requests are never
        reclaimed for the same user, so without a free slot the turn would be
        lost.
        """
        num_free = min(self._num_free_slots(), self._num_free_active_slots(plan))
        if num_free <= 0 or not plan.charged:
            return
        by_user = self._granted_by_user(plan)
        num_available = self.output_rate_limiter.num_available
        for user in self.waiting.users():
            streams = by_user.get(user)
            if not streams or num_available(user, 1):
                continue
            victim = streams.pop()
            plan.charged.remove(victim)
            plan.throttled.append(victim)
            self.output_rate_limiter.refund(user)
            self._note_refused(user, 1)
            num_free -= 1
            if not num_free:
                return

    def _reclaim_slots(self, plan: _StepPlan, step: int) -> set[str]:
        """Free worker slots held by throttled requests for users who have budget.

        Throttled requests hold worker slots between their tokens; when they
        hold every slot, a waiting request of a user with budget could never
        be admitted. Such slots are taken back through upstream's own
        preemption: the victim frees its KV blocks (or leaves them in the
        prefix cache), goes back to the front of the waiting queue and resumes
        with no output lost. Returns the users reclaimed from, which may not be
        admitted again in this step.
        """
        num_free_active = self._num_free_active_slots(plan)
        num_free = self._num_free_slots()
        if num_free_active <= max(num_free, 0):
            return set()
        admissible_users, num_admissible = self._admissible_waiting(num_free_active)
        num_wanted = min(num_admissible, num_free_active) - max(num_free, 0)
        if num_wanted <= 0:
            return set()
        victims = self._pick_reclaim_victims(plan, num_wanted, admissible_users, step)
        if not victims:
            return set()
        victim_ids = {id(r) for r in victims}
        self.running = [r for r in self.running if id(r) not in victim_ids]
        plan.throttled = [r for r in plan.throttled if id(r) not in victim_ids]
        timestamp = time.monotonic()
        stats = self.reclaim_stats
        for victim in victims:
            stats.num_reclaims += 1
            stats.num_tokens_dropped += victim.num_computed_tokens
            self._reclaimed.add(victim.request_id)
            self._preempt_request(  # type: ignore[attr-defined]
                victim, timestamp, drop_stale_output=self.requires_kv_delivery
            )
        return {self.output_rate_users[r.request_id] for r in victims}

    def _admissible_waiting(self, limit: int) -> tuple[set[str], int]:
        """Users with waiting requests and budget, and how many of those requests
        (up to ``limit``) their budgets cover now. Costs O(users waiting)."""
        num_available = self.output_rate_limiter.num_available
        users: set[str] = set()
        total = 0
        for queue in (self.kv_holding_waiting, self.waiting):
            for user in queue.users():
                num = num_available(user, min(limit, queue.num_requests_of(user)))
                if num:
                    users.add(user)
                    total += num
                    if total >= limit:
                        return users, total
        return users, total

    def _pick_reclaim_victims(
        self, plan: _StepPlan, num_wanted: int, spare_users: set[str], step: int
    ) -> list[Request]:
        """Up to ``num_wanted`` throttled requests to reclaim.

        From the user holding the most throttled resident requests; ties go to
        the user whose budget returns last (it loses least by waiting in the
        queue), then by user id so the choice is deterministic. Within a user,
        the request with the fewest computed tokens (cheapest to recompute;
        ties: the one that arrived last, as upstream's own preemption prefers).
        Never a request of a user in ``spare_users`` (users about to be
        admitted), and never one re-admitted after a reclaim less than
        ``RECLAIM_COOLDOWN_STEPS`` ago.
        """
        users = self.output_rate_users
        protected = self._reclaim_protected_until
        # user -> its reclaimable throttled requests, cheapest last.
        candidates: dict[str, list[Request]] = {}
        for request in plan.throttled:
            user = users[request.request_id]
            if user in spare_users or protected.get(request.request_id, 0) > step:
                continue
            candidates.setdefault(user, []).append(request)
        if not candidates:
            return []
        for requests in candidates.values():
            requests.sort(key=lambda r: (-r.num_computed_tokens, r.arrival_time))
        ready_at = self.output_rate_limiter.ready_at_ns
        victims: list[Request] = []
        while len(victims) < num_wanted and candidates:
            user = max(candidates, key=lambda u: (len(candidates[u]), ready_at(u), u))
            requests = candidates[user]
            victims.append(requests.pop())
            if not requests:
                del candidates[user]
        return victims

    def _skip_running(self, plan: _StepPlan, step: int) -> None:
        skipped = plan.parked + plan.throttled
        if not skipped:
            return
        for request in skipped:
            if request.next_decode_eligible_step <= step:
                request.next_decode_eligible_step = step + 1
        # Skipped requests go to the tail, throttled last: upstream preempts
        # from the tail, so they lose their KV blocks first.
        skipped_ids = {id(r) for r in skipped}
        self.running = [r for r in self.running if id(r) not in skipped_ids] + skipped

    def _admission_cap(self, plan: _StepPlan) -> int:
        """Throttled requests hold a worker slot but no active slot."""
        return min(self.max_num_active_reqs + len(plan.throttled), self.max_num_running_reqs)

    def _rotate(self, user: str, streams: list[Request]) -> list[Request]:
        """Start after the stream of ``user`` that was served last."""
        last_id = self._last_served_req.get(user)
        if last_id is None:
            return streams
        for i, request in enumerate(streams):
            if request.request_id == last_id:
                return streams[i + 1 :] + streams[: i + 1]
        return streams

    def _park_over_active_cap(self, plan: _StepPlan, num_busy: int) -> list[Request]:
        """Refund and return the charged requests beyond the active cap.

        Only possible after throttling let more requests become resident than
        there are active slots. Slots go to the users that were given one least
        recently when slots were short, so nobody is favoured for sitting early
        in ``running``.
        """
        num_free = self.max_num_active_reqs - num_busy
        if len(plan.charged) <= num_free:
            return []
        by_user = self._granted_by_user(plan)
        order = sorted(by_user, key=lambda u: self._last_slot_step.get(u, -1))
        parked: list[Request] = []
        refund = self.output_rate_limiter.refund
        step = self.current_step + 1
        for user in order:
            streams = by_user[user]
            num_keep = max(0, min(len(streams), num_free))
            num_free -= num_keep
            if num_keep:
                self._last_slot_step[user] = step
            for request in streams[num_keep:]:
                refund(user)
                parked.append(request)
            del streams[num_keep:]
        parked_ids = {id(r) for r in parked}
        plan.charged = [r for r in plan.charged if id(r) not in parked_ids]
        return parked

    def _granted_by_user(self, plan: _StepPlan) -> dict[str, list[Request]]:
        if plan.granted_by_user is None:
            users = self.output_rate_users
            by_user: dict[str, list[Request]] = {}
            for request in plan.charged:
                by_user.setdefault(users[request.request_id], []).append(request)
            plan.granted_by_user = by_user
        return plan.granted_by_user

    def _note_refused(self, user: str, num_requests: int) -> None:
        self.num_throttled[user] = self.num_throttled.get(user, 0) + num_requests
        ready_at = self.output_rate_limiter.ready_at_ns(user)
        if self.output_rate_wakeup_ns is None or ready_at < self.output_rate_wakeup_ns:
            self.output_rate_wakeup_ns = ready_at

    # ---- the single refund point ------------------------------------------

    def _settle(
        self, plan: _StepPlan, gate: _AdmissionGate, output: SchedulerOutput, step: int
    ) -> None:
        scheduled = output.num_scheduled_tokens
        users = self.output_rate_users
        charged = list(itertools.chain(plan.charged, gate.charged.values()))
        unsampled = [r for r in charged if r.request_id not in scheduled or r.is_prefill_chunk]
        refund = self.output_rate_limiter.refund
        for request in unsampled:
            refund(users[request.request_id])
        if self._reclaimed:
            self._protect_readmitted(gate, scheduled, step)
        metrics = self.output_rate_metrics
        num_sampled = None
        if self.push_client is not None or metrics is not None:
            num_sampled = self._count_granted(charged, unsampled)
        if metrics is not None:  # metrics: token times of throttled users, O(throttled users)
            metrics.on_step(num_sampled, len(plan.throttled))
        if step % CLEANUP_INTERVAL_STEPS == 0:
            self._cleanup()
        self._maybe_report_usage()

    def _protect_readmitted(self, gate: _AdmissionGate, scheduled: Any, step: int) -> None:
        """Reclaimed requests admitted again are not reclaimed for a while (no thrashing)."""
        for req_id in gate.charged:
            if req_id in self._reclaimed and req_id in scheduled:
                self._reclaimed.discard(req_id)
                self._reclaim_protected_until[req_id] = step + self.reclaim_cooldown_steps

    def _count_granted(self, charged: list[Request], unsampled: list[Request]) -> Counter[str]:
        users = self.output_rate_users
        num_granted = self.num_granted
        num_sampled = Counter([users[r.request_id] for r in charged])
        num_sampled.subtract([users[r.request_id] for r in unsampled])
        for user, num in num_sampled.items():
            if num > 0:
                num_granted[user] = num_granted.get(user, 0) + num
        return num_sampled

    def _cleanup(self) -> None:
        self.output_rate_limiter.cleanup_idle_users()
        live = self.requests
        for req_id in [r for r in self.output_rate_users if r not in live]:
            del self.output_rate_users[req_id]
        self._reclaimed.intersection_update(live)
        protected = self._reclaim_protected_until
        step = self.current_step
        for req_id in [r for r, until in protected.items() if until <= step or r not in live]:
            del protected[req_id]
        live_users = set(self.output_rate_users.values())
        for table in (self._last_served_req, self._last_slot_step):
            for user in [u for u in table if u not in live_users]:
                del table[user]

    # ---- engine loop and control plane -------------------------------------

    def output_rate_wait_s(self, now_ns: int | None = None) -> float:
        """How long an engine whose step ran no model may wait for input."""
        wakeup = self.output_rate_wakeup_ns
        if wakeup is None:
            return MAX_WAIT_S
        now = self.output_rate_clock_ns() if now_ns is None else now_ns
        return max(0.0, min(MAX_WAIT_S, (wakeup - now) / 1e9))

    def _start_push_client(self, vllm_config: Any) -> None:
        from engine_ext.push_client import PushClient

        config = self.output_rate_config
        assert config.control_plane_endpoint is not None
        client = PushClient(
            endpoint=config.control_plane_endpoint,
            engine_id=config.engine_id or "engine",
            model=str(vllm_config.model_config.served_model_name or ""),
            server_public_key=config.control_plane_public_key,
            wake=lambda: self.wake_engine(),
        )
        client.start()
        self.push_client = client
        if client.wait_for_snapshot(config.snapshot_timeout_s):
            client.apply_pending(self.output_rate_limiter)
        else:
            logger.warning(
                "output-rate: control plane %s not reachable within %.1fs; "
                "serving with the limits from the command line until it answers",
                config.control_plane_endpoint,
                config.snapshot_timeout_s,
            )

    def has_requests(self) -> bool:
        # The engine loop asks this on its own thread, also while idle after a
        # WAKEUP: a limit update that woke it is applied (and acknowledged)
        # now, not when the next request arrives.
        self.apply_control_plane_updates()
        return super().has_requests()  # type: ignore[misc]

    def apply_control_plane_updates(self) -> None:
        if self.push_client is not None:
            self.push_client.apply_pending(self.output_rate_limiter)

    def _maybe_report_usage(self) -> None:
        metrics = self.output_rate_metrics
        if self.push_client is None and metrics is None:
            return
        now = self.output_rate_clock_ns()
        if now < self._next_usage_report_ns:
            return
        self._next_usage_report_ns = now + USAGE_REPORT_INTERVAL_NS
        if metrics is not None:  # metrics: the same counts, before the push client owns them
            metrics.add_usage(self.num_granted, self.num_throttled, tier_lookup(self))
        if self.push_client is not None:
            self.push_client.report_usage(granted=self.num_granted, throttled=self.num_throttled)
        self.num_granted = {}
        self.num_throttled = {}

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        # metrics: a snapshot rides on vLLM's SchedulerStats about once a second.
        # The engine goes idle once the last request finished: send what it counted now.
        stats = super().make_stats(*args, **kwargs)  # type: ignore[misc]
        metrics = self.output_rate_metrics
        if stats is None or metrics is None:
            return stats
        if not self.requests:
            self._next_usage_report_ns = 0
            self._maybe_report_usage()
        if metrics.snapshot_due() or not self.requests:
            setattr(stats, PAYLOAD_FIELD, scheduler_snapshot(metrics, self))
        return stats

    def shutdown(self) -> None:
        if self.push_client is not None:
            self.push_client.close()
        super().shutdown()  # type: ignore[misc]


class OutputRateScheduler(OutputRateMixin, Scheduler):
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self._init_output_rate(vllm_config)


class OutputRateAsyncScheduler(OutputRateMixin, AsyncScheduler):
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self._init_output_rate(vllm_config)
