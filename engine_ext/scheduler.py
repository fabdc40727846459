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
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler

from engine_ext.config import OutputRateConfig
from engine_ext.limiter import ANONYMOUS_USER, OutputRateLimiter

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.output_rate." + __name__)

USER_ARG = "output_rate_user"
MAX_WAIT_S = 0.05
# How often idle limiter state and rotation bookkeeping are pruned.
CLEANUP_INTERVAL_STEPS = 256
# Bound on waiting requests examined per step, so a deep queue of throttled
# users' requests cannot make every step O(queue).
MAX_WAITING_SCAN = 1024
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
        "charged_waiting",
        "granted_by_user",
        "held_waiting",
        "parked",
        "throttled",
    )

    def __init__(self) -> None:
        # Running requests charged one token this step.
        self.charged: list[Request] = []
        # Waiting requests charged one token and offered to upstream admission.
        self.charged_waiting: list[Request] = []
        # user -> that user's charged running requests; built only when needed.
        self.granted_by_user: dict[str, list[Request]] | None = None
        # Running requests refused a token; skipped this step.
        self.throttled: list[Request] = []
        # Running requests with a token but no active slot; skipped, refunded.
        self.parked: list[Request] = []
        # Waiting requests held back from admission, in queue order.
        self.held_waiting: list[Request] = []


class OutputRateMixin:
    """Per-user output-rate enforcement around ``Scheduler.schedule()``.

    Mixed into both upstream scheduler classes; relies on their attributes.
    """

    running: list[Request]
    waiting: Any
    requests: dict[str, Request]
    current_step: int
    max_num_active_reqs: int
    max_num_running_reqs: int
    max_num_scheduled_tokens: int
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
        # user -> request id of the stream that was served last (rotation).
        self._last_served_req: dict[str, str] = {}
        # user -> last step in which it was given an active slot while slots
        # were short (fairness across users).
        self._last_slot_step: dict[str, int] = {}
        # user -> tokens granted / requests throttled since the last usage report.
        self.num_granted: dict[str, int] = {}
        self.num_throttled: dict[str, int] = {}
        self._next_usage_report_ns = 0
        self.push_client: Any = None
        if self.output_rate_config.control_plane_endpoint:
            self._start_push_client(vllm_config)

    def use_fake_clock(self, clock_ns: Callable[[], int]) -> None:
        """Test seam: drive the limiter and the wake-up time from a fake clock."""
        self.output_rate_clock_ns = clock_ns
        limiter = self.output_rate_limiter
        self.output_rate_limiter = OutputRateLimiter(
            limiter.default_rate, limiter.user_rates(), clock_ns=clock_ns
        )

    # ---- vLLM hooks -----------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.output_rate_user = request_user(request)  # type: ignore[attr-defined]
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
        saved_waiting = self._hold_back_waiting(plan)
        self._skip_running(plan, step)
        saved_active_cap = self.max_num_active_reqs
        if plan.throttled:
            self.max_num_active_reqs = self._admission_cap(plan)
        try:
            output = super().schedule(throttle_prefills)  # type: ignore[misc]
        finally:
            self.max_num_active_reqs = saved_active_cap
            if saved_waiting is not None:
                self._restore_waiting(saved_waiting, plan)
        self._settle(plan, output, step)
        return output

    # ---- pre-pass ---------------------------------------------------------

    def _plan_running(self, plan: _StepPlan, step: int) -> None:
        """Charge every running request whose dispatch this step would sample."""
        max_chunk = self.max_num_scheduled_tokens
        # Until someone is refused, every dispatchable request is charged.
        charged = plan.charged
        charge = charged.append
        num_busy = 0  # running requests that need no token (mid-prefill chunks)
        for request in self.running:
            num_placeholders = request.num_output_placeholders
            num_remaining = (
                request.num_tokens_with_spec + num_placeholders - request.num_computed_tokens
            )
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
        num_wanted = Counter([r.output_rate_user for r in charged])  # type: ignore[attr-defined]
        num_got = self.output_rate_limiter.take_many(num_wanted)
        if num_got:
            self._rotate_contended(plan, num_got)
        plan.parked = self._park_over_active_cap(plan, num_busy)

    def _rotate_contended(self, plan: _StepPlan, num_got: dict[str, int]) -> None:
        """For users that ran short, hand their tokens to streams in rotation order.

        ``num_got`` maps each such user to the tokens it got. The same number of
        tokens goes to the streams that come first after the one served last.
        """
        # user -> its dispatchable streams in ``running`` order; filled in the
        # order in which the users ran out, which is also the order their
        # throttled streams go to the tail of ``running``.
        streams_of: dict[str, list[Request]] = {user: [] for user in num_got}
        refused: dict[str, list[Request]] = {}
        kept: list[Request] = []
        for request in plan.charged:
            user = request.output_rate_user  # type: ignore[attr-defined]
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
            by_user: dict[str, list[Request]] = {}
            for request in plan.charged:
                by_user.setdefault(request.output_rate_user, []).append(request)  # type: ignore[attr-defined]
            plan.granted_by_user = by_user
        return plan.granted_by_user

    def _note_refused(self, user: str, num_requests: int) -> None:
        self.num_throttled[user] = self.num_throttled.get(user, 0) + num_requests
        ready_at = self.output_rate_limiter.ready_at_ns(user)
        if self.output_rate_wakeup_ns is None or ready_at < self.output_rate_wakeup_ns:
            self.output_rate_wakeup_ns = ready_at

    def _hold_back_waiting(self, plan: _StepPlan) -> Any:
        """Charge the waiting requests upstream may admit; hide the rest.

        Returns the original waiting queue (now holding only the unexamined
        tail) when upstream is given a filtered queue, else None.
        """
        if not self.waiting:
            return None
        limiter = self.output_rate_limiter
        original = self.waiting
        offered = create_request_queue(self.policy)
        refused_users: set[str] = set()
        num_scanned = 0
        while (
            original
            and len(offered) < self._admission_cap(plan) - len(self.running)
            and num_scanned < MAX_WAITING_SCAN
        ):
            request = original.pop_request()
            num_scanned += 1
            user = request.output_rate_user
            has_budget = user not in refused_users and limiter.try_take(user)
            if has_budget or self._steal_turn(plan, user):
                plan.charged_waiting.append(request)
                offered.add_request(request)
            else:
                if user not in refused_users:
                    refused_users.add(user)
                    self._note_refused(user, 1)
                plan.held_waiting.append(request)
        self.waiting = offered
        return original

    def _steal_turn(self, plan: _StepPlan, user: str) -> bool:
        """Give a token granted to one of ``user``'s running streams to a waiting one.

        A waiting stream has never been served, so in the user's rotation it
        comes before every running stream; without this, running streams that
        keep the budget busy would starve the user's queued requests forever.
        """
        streams = self._granted_by_user(plan).get(user)
        if not streams:
            return False
        victim = streams.pop()
        plan.charged.remove(victim)
        plan.throttled.append(victim)
        self._note_refused(user, 1)
        return True

    def _restore_waiting(self, original: Any, plan: _StepPlan) -> None:
        # What upstream left in the offered queue (not admitted, skipped, or
        # preempted this step) goes back in front, then the held-back ones.
        leftover = list(self.waiting)
        front = leftover + plan.held_waiting
        original.prepend_requests(reversed(front))
        self.waiting = original

    # ---- the single refund point ------------------------------------------

    def _settle(self, plan: _StepPlan, output: SchedulerOutput, step: int) -> None:
        scheduled = output.num_scheduled_tokens
        unsampled = [
            r
            for r in itertools.chain(plan.charged, plan.charged_waiting)
            if r.request_id not in scheduled or r.is_prefill_chunk
        ]
        refund = self.output_rate_limiter.refund
        for request in unsampled:
            refund(request.output_rate_user)  # type: ignore[attr-defined]
        if self.push_client is not None:
            self._count_granted(plan, unsampled)
        if step % CLEANUP_INTERVAL_STEPS == 0:
            self._cleanup()
        self._maybe_report_usage()

    def _count_granted(self, plan: _StepPlan, unsampled: list[Request]) -> None:
        num_granted = self.num_granted
        num_sampled = Counter(
            [r.output_rate_user for r in itertools.chain(plan.charged, plan.charged_waiting)]  # type: ignore[attr-defined]
        )
        num_sampled.subtract([r.output_rate_user for r in unsampled])  # type: ignore[attr-defined]
        for user, num in num_sampled.items():
            if num > 0:
                num_granted[user] = num_granted.get(user, 0) + num

    def _cleanup(self) -> None:
        self.output_rate_limiter.cleanup_idle_users()
        live_users = {r.output_rate_user for r in self.requests.values()}  # type: ignore[attr-defined]
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
        if self.push_client is None:
            return
        now = self.output_rate_clock_ns()
        if now < self._next_usage_report_ns:
            return
        self._next_usage_report_ns = now + USAGE_REPORT_INTERVAL_NS
        self.push_client.report_usage(granted=self.num_granted, throttled=self.num_throttled)
        self.num_granted = {}
        self.num_throttled = {}

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
