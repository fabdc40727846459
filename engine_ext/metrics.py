"""Engine-side output-rate metrics, shown on vLLM's own ``/metrics``.

Two halves, one per process (docs/metrics.md):

- ``EngineMetrics`` lives in the scheduler (engine-core process). It keeps
  cumulative per-user counters for at most ``max_users`` users (the rest are
  folded into ``OTHER_USER``), the engine-side interval between consecutive
  tokens of throttled users per tier, and, about once a second, puts a small
  ``MetricsSnapshot`` (a msgspec struct, encoded) on the ``SchedulerStats`` that
  vLLM already sends to the API server (``Scheduler.make_stats``). Per step it costs one call with
  O(throttled users) work; the per-user counts come from the planner's own
  usage dicts once a second.
- ``OutputRateCollector`` lives in the API server process: vLLM's stat logger
  hands it each snapshot (engine_ext/stat_logger.py) and it renders the latest
  one per engine at scrape time, with vLLM's ``model_name`` and ``engine``
  labels.

Imports nothing from vLLM (the vLLM-facing glue is engine_ext/stat_logger.py).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import get_args

import msgspec
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from output_rate_core import protocol as p

# The SchedulerStats attribute that carries the snapshot (engine_ext/stat_logger.py).
PAYLOAD_FIELD = "output_rate"
# Label value of every user without a series of its own (and of tiers beyond MAX_TIERS).
OTHER_USER = "__other__"
# Tier label of users the control plane put in no tier (or engines without one).
NO_TIER = "(none)"
MAX_TIERS = 32
DEFAULT_MAX_USERS = 20
MAX_METRICS_USERS = 1000
DEFAULT_IDLE_S = 60.0
SNAPSHOT_INTERVAL_NS = 1_000_000_000
# Why the control plane refuses an engine id.
REFUSAL_REASONS: tuple[str, ...] = get_args(p.RefusalReason)
# Engine-side interval between a throttled user's consecutive tokens (seconds).
INTERVAL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

# user -> [tokens granted, request-steps throttled, last active (clock ns),
#          request-steps a shadow limit would have throttled, tokens borrowed]
_GRANTED, _THROTTLED, _LAST_ACTIVE, _WOULD_THROTTLE, _BORROWED = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class SchedulerFigures:
    """What the metrics read from an output-rate scheduler (its ``output_rate_figures()``)."""

    # tokens/s (a fleet share can be a fraction)
    rate_of: Callable[[str], float | None]
    default_rate: float | None
    is_unlimited: bool
    num_reclaims: int
    num_reclaimed_tokens: int
    # None: the engine has no control plane.
    config_version: int | None
    connected: bool | None
    tier_of: Callable[[str], str | None]
    # Fleet shares (docs/fleet.md); None without a control plane.
    fleet_size: int | None = None
    num_shares: int | None = None
    shares_leased: bool | None = None
    # Claims of its engine id the control plane refused, by reason; None without one.
    refusals: Mapping[str, int] | None = None


# ---- the snapshot that crosses from the engine-core process to the API server ----


class UserFigures(msgspec.Struct, array_like=True, frozen=True):
    num_granted: int
    num_throttled: int
    # The user's effective limit on this engine in tokens/s (None: unlimited).
    rate: float | None
    # Seconds since the user was last granted or refused a token.
    idle_s: float
    num_would_throttle: int = 0
    # Tokens lent beyond the rate, within the ceiling (a part of num_granted).
    num_borrowed: int = 0


class TierIntervals(msgspec.Struct, array_like=True, frozen=True):
    # One count per INTERVAL_BUCKETS bound, then one for +Inf (not cumulative).
    counts: list[int]
    sum_s: float


class MetricsSnapshot(msgspec.Struct, frozen=True):
    users: dict[str, UserFigures]
    # Tokens granted and request-steps refused of every user without a series.
    num_other_granted: int
    num_other_throttled: int
    idle_s: float
    default_rate: float | None
    num_throttled_resident: int
    num_reclaims: int
    num_reclaimed_tokens: int
    config_version: int | None
    connected: bool | None
    # tier name -> its users' token intervals
    intervals: dict[str, TierIntervals]
    fleet_size: int | None = None
    num_shares: int | None = None
    shares_leased: bool | None = None
    num_other_would_throttle: int = 0
    refusals: dict[str, int] | None = None
    num_other_borrowed: int = 0


_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(MetricsSnapshot)


def encode_snapshot(snapshot: MetricsSnapshot) -> bytes:
    return _snapshot_encoder.encode(snapshot)


def decode_snapshot(payload: bytes) -> MetricsSnapshot:
    return _snapshot_decoder.decode(payload)


class IntervalHistogram:
    """Bucket counts (not cumulative; the last one is +Inf) and the sum, in seconds."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(INTERVAL_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float, num: int = 1) -> None:
        self.counts[bisect.bisect_left(INTERVAL_BUCKETS, seconds)] += num
        self.sum += seconds * num


class EngineMetrics:
    """Cumulative engine figures with bounded per-user cardinality.

    A user gets a series of its own when a slot is free (at most ``max_users``;
    among users new in the same usage interval the most active first) and keeps
    it until it has been idle (no token granted or refused) for ``idle_s``;
    everything else is counted under ``OTHER_USER``. Counters of a series only
    count while it exists, so ``sum by (engine)`` is the engine's total only
    while no user was folded.
    """

    def __init__(
        self,
        *,
        max_users: int = DEFAULT_MAX_USERS,
        idle_s: float = DEFAULT_IDLE_S,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.max_users = max_users
        self.idle_ns = int(idle_s * 1e9)
        self.clock_ns = clock_ns
        self.users: dict[str, list[int]] = {}
        self.other = [0, 0, 0, 0, 0]
        self.num_throttled_resident = 0
        self.intervals: dict[str, IntervalHistogram] = {}
        # Users throttled in the last two usage intervals -> their tier's histogram.
        self._watched: dict[str, IntervalHistogram] = {}
        self._throttled_before: set[str] = set()
        # user -> clock ns of its last granted token (watched users only).
        self._last_grant_ns: dict[str, int] = {}
        # user -> its count in the scheduler's running dict at the last step.
        self._seen: dict[str, int] = {}
        self._next_snapshot_ns = 0

    # ---- engine thread, once per usage interval ------------------------------

    def add_usage(
        self,
        granted: Mapping[str, int],
        throttled: Mapping[str, int],
        tier_of: Callable[[str], str | None] = lambda user: None,
        would_throttle: Mapping[str, int] | None = None,
        borrowed: Mapping[str, int] | None = None,
    ) -> None:
        """Count one usage interval's per-user tokens granted, request-steps refused,
        request-steps a shadow limit would have refused and tokens borrowed (users that
        borrowed are in ``granted`` too).

        The scheduler starts new running counts after this call.
        """
        self._seen = {}
        now = self.clock_ns()
        users = self.users
        would = would_throttle or {}
        lent = borrowed or {}
        # Served users with would-throttles are in ``granted`` too.
        active = set(granted).union(throttled)
        new = [u for u in active if u not in users]
        if new:
            free = self.max_users - len(users)
            new.sort(key=lambda u: -(granted.get(u, 0) + throttled.get(u, 0)))
            for user in new[: max(free, 0)]:
                if user != OTHER_USER:
                    users[user] = [0, 0, now, 0, 0]
        other = self.other
        for user in active:
            series = users.get(user)
            if series is None:
                series = other
            else:
                series[_LAST_ACTIVE] = now
            series[_GRANTED] += granted.get(user, 0)
            series[_THROTTLED] += throttled.get(user, 0)
            series[_WOULD_THROTTLE] += would.get(user, 0)
            series[_BORROWED] += lent.get(user, 0)
        self._watch(set(throttled), tier_of)

    def _watch(self, throttled: set[str], tier_of: Callable[[str], str | None]) -> None:
        watched_users = throttled | self._throttled_before
        self._throttled_before = throttled
        old = self._watched
        watched: dict[str, IntervalHistogram] = {}
        for user in watched_users:
            hist = old.get(user)
            watched[user] = hist if hist is not None else self._histogram(tier_of(user))
        for user in [u for u in self._last_grant_ns if u not in watched]:
            del self._last_grant_ns[user]
        self._watched = watched

    def _histogram(self, tier: str | None) -> IntervalHistogram:
        name = tier if tier is not None else NO_TIER
        hist = self.intervals.get(name)
        if hist is None:
            if len(self.intervals) >= MAX_TIERS:
                name = OTHER_USER
                hist = self.intervals.get(name)
            if hist is None:
                hist = self.intervals[name] = IntervalHistogram()
        return hist

    # ---- engine thread, every step -------------------------------------------

    def on_step(self, granted: Mapping[str, int], num_throttled: int) -> None:
        """Record this step's throttled resident requests and watched users' token times.

        ``granted`` is the scheduler's running count of tokens per user since the
        last ``add_usage`` (the planner's ``num_granted``); the tokens of this step
        are its growth. Costs O(watched users).
        """
        self.num_throttled_resident = num_throttled
        watched = self._watched
        if not watched or not granted:
            return
        seen = self._seen
        last_grant = self._last_grant_ns
        now = 0
        for user, hist in watched.items():
            total = granted.get(user)
            if total is None:
                continue
            num = total - seen.get(user, 0)
            if num <= 0:
                continue
            seen[user] = total
            now = now or self.clock_ns()
            last = last_grant.get(user)
            if last is not None:
                hist.observe((now - last) / 1e9)
            if num > 1:
                hist.observe(0.0, num - 1)  # streams of one user served in the same step
            last_grant[user] = now

    # ---- engine thread, from make_stats ----------------------------------------

    def snapshot_due(self) -> bool:
        now = self.clock_ns()
        if now < self._next_snapshot_ns:
            return False
        self._next_snapshot_ns = now + SNAPSHOT_INTERVAL_NS
        return True

    def snapshot(self, figures: SchedulerFigures) -> MetricsSnapshot:
        """The snapshot sent to the API server; forgets series idle for ``idle_s``."""
        if figures.is_unlimited:
            # schedule() takes upstream's path and throttles nobody (on_step is not called).
            self.num_throttled_resident = 0
        now = self.clock_ns()
        users = self.users
        for user in [u for u, s in users.items() if now - s[_LAST_ACTIVE] > self.idle_ns]:
            del users[user]
        rate_of = figures.rate_of
        return MetricsSnapshot(
            users={
                user: UserFigures(
                    s[_GRANTED],
                    s[_THROTTLED],
                    rate_of(user),
                    (now - s[_LAST_ACTIVE]) / 1e9,
                    s[_WOULD_THROTTLE],
                    s[_BORROWED],
                )
                for user, s in users.items()
            },
            num_other_granted=self.other[_GRANTED],
            num_other_throttled=self.other[_THROTTLED],
            num_other_would_throttle=self.other[_WOULD_THROTTLE],
            num_other_borrowed=self.other[_BORROWED],
            idle_s=self.idle_ns / 1e9,
            default_rate=figures.default_rate,
            num_throttled_resident=self.num_throttled_resident,
            num_reclaims=figures.num_reclaims,
            num_reclaimed_tokens=figures.num_reclaimed_tokens,
            config_version=figures.config_version,
            connected=figures.connected,
            fleet_size=figures.fleet_size,
            num_shares=figures.num_shares,
            shares_leased=figures.shares_leased,
            refusals=None if figures.refusals is None else dict(figures.refusals),
            intervals={
                tier: TierIntervals(list(h.counts), h.sum) for tier, h in self.intervals.items()
            },
        )


class OutputRateCollector(Collector):
    """Renders the latest snapshot of every engine (API server process)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # engine index -> (model name, snapshot, time received)
        self._latest: dict[int, tuple[str, MetricsSnapshot, float]] = {}

    def update(self, engine_idx: int, model_name: str, snapshot: MetricsSnapshot) -> None:
        with self._lock:
            self._latest[engine_idx] = (model_name, snapshot, self._clock())

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        with self._lock:
            latest = sorted(self._latest.items())
        users, engines, intervals, fleet = _Users(), _Engines(), _Intervals(), _Fleet()
        for engine_idx, (model_name, snapshot, received) in latest:
            labels = [model_name, str(engine_idx)]
            num_tracked = users.add(labels, snapshot, age_s=now - received)
            engines.add(labels, snapshot, num_tracked=num_tracked)
            intervals.add(labels, snapshot)
            fleet.add(labels, snapshot)
        for part in (users, engines, intervals, fleet):
            yield from part.families()


# vLLM's labels of an engine's series; a user's series add the user.
ENGINE_LABELS = ["model_name", "engine"]
USER_LABELS = [*ENGINE_LABELS, "user"]


class _Users:
    """The per-user series of one scrape."""

    def __init__(self) -> None:
        self.granted = CounterMetricFamily(
            "vllm:output_rate_granted_tokens",
            "Output tokens granted per user by the output-rate limiter",
            labels=USER_LABELS,
        )
        self.throttled = CounterMetricFamily(
            "vllm:output_rate_throttled_steps",
            "Request-steps refused a token per user (one per throttled request per step)",
            labels=USER_LABELS,
        )
        self.would_throttle = CounterMetricFamily(
            "vllm:output_rate_would_throttle_steps",
            "Request-steps a shadow limit would have refused per user (they were served)",
            labels=USER_LABELS,
        )
        self.borrowed = CounterMetricFamily(
            "vllm:output_rate_borrowed_tokens",
            "Output tokens granted per user beyond its rate, within its ceiling (a part of"
            " the granted tokens)",
            labels=USER_LABELS,
        )
        self.limit = GaugeMetricFamily(
            "vllm:output_rate_user_limit_tokens_per_second",
            "Effective limit of each user with a series (absent: unlimited)",
            labels=USER_LABELS,
        )

    def add(self, labels: list[str], snapshot: MetricsSnapshot, *, age_s: float) -> int:
        """One engine's users, those idle past the snapshot's idle_s by now (`age_s` after
        it arrived) left out, and OTHER_USER; returns how many users had a series."""
        num_tracked = 0
        for user, figures in snapshot.users.items():
            if figures.idle_s + age_s > snapshot.idle_s:
                continue
            num_tracked += 1
            self.granted.add_metric([*labels, user], figures.num_granted)
            self.throttled.add_metric([*labels, user], figures.num_throttled)
            self.would_throttle.add_metric([*labels, user], figures.num_would_throttle)
            self.borrowed.add_metric([*labels, user], figures.num_borrowed)
            if figures.rate is not None:
                self.limit.add_metric([*labels, user], figures.rate)
        self.granted.add_metric([*labels, OTHER_USER], snapshot.num_other_granted)
        self.throttled.add_metric([*labels, OTHER_USER], snapshot.num_other_throttled)
        self.would_throttle.add_metric([*labels, OTHER_USER], snapshot.num_other_would_throttle)
        self.borrowed.add_metric([*labels, OTHER_USER], snapshot.num_other_borrowed)
        return num_tracked

    def families(self) -> tuple[Metric, ...]:
        return (self.granted, self.throttled, self.would_throttle, self.borrowed, self.limit)


class _Engines:
    """The per-engine series of one scrape: its limiter and its link to the control plane."""

    def __init__(self) -> None:
        self.default = GaugeMetricFamily(
            "vllm:output_rate_default_limit_tokens_per_second",
            "Limit of users without their own (absent: unlimited)",
            labels=ENGINE_LABELS,
        )
        self.tracked = GaugeMetricFamily(
            "vllm:output_rate_tracked_users",
            "Users with a series of their own (the rest are user=__other__)",
            labels=ENGINE_LABELS,
        )
        self.resident = GaugeMetricFamily(
            "vllm:output_rate_throttled_requests",
            "Requests refused a token in the last step that stay resident (keep KV blocks)",
            labels=ENGINE_LABELS,
        )
        self.reclaims = CounterMetricFamily(
            "vllm:output_rate_slot_reclaims",
            "Worker slots taken back from throttled requests (preempted for users with budget)",
            labels=ENGINE_LABELS,
        )
        self.reclaimed = CounterMetricFamily(
            "vllm:output_rate_reclaimed_tokens",
            "Computed tokens of reclaimed requests (recomputed unless prefix-cached)",
            labels=ENGINE_LABELS,
        )
        self.version = GaugeMetricFamily(
            "vllm:output_rate_config_version",
            "Config version of the control plane this engine applied",
            labels=ENGINE_LABELS,
        )
        self.connected = GaugeMetricFamily(
            "vllm:output_rate_control_plane_connected",
            "1 while in sync with the control plane, 0 while it is silent or resyncing",
            labels=ENGINE_LABELS,
        )
        self.refusals = CounterMetricFamily(
            "vllm:output_rate_control_plane_refusals",
            "Claims of this engine's id the control plane refused, by reason "
            "(engine_id_in_use: another live engine has the id)",
            labels=[*ENGINE_LABELS, "reason"],
        )

    def add(self, labels: list[str], snapshot: MetricsSnapshot, *, num_tracked: int) -> None:
        self.tracked.add_metric(labels, num_tracked)
        if snapshot.default_rate is not None:
            self.default.add_metric(labels, snapshot.default_rate)
        self.resident.add_metric(labels, snapshot.num_throttled_resident)
        self.reclaims.add_metric(labels, snapshot.num_reclaims)
        self.reclaimed.add_metric(labels, snapshot.num_reclaimed_tokens)
        if snapshot.config_version is not None:
            self.version.add_metric(labels, snapshot.config_version)
            self.connected.add_metric(labels, 1 if snapshot.connected else 0)
        if snapshot.refusals is not None:
            # Every reason from the start, so an alert sees the first refusal as an increase.
            for reason in REFUSAL_REASONS:
                self.refusals.add_metric([*labels, reason], snapshot.refusals.get(reason, 0))

    def families(self) -> tuple[Metric, ...]:
        return (
            self.default,
            self.tracked,
            self.resident,
            self.reclaims,
            self.reclaimed,
            self.version,
            self.connected,
            self.refusals,
        )


class _Intervals:
    """The engine-side token intervals of throttled users, per engine and tier."""

    def __init__(self) -> None:
        self.intervals = HistogramMetricFamily(
            "vllm:output_rate_token_interval_seconds",
            "Engine-side time between consecutive tokens of a throttled user, per tier",
            labels=[*ENGINE_LABELS, "tier"],
        )

    def add(self, labels: list[str], snapshot: MetricsSnapshot) -> None:
        bounds = (*INTERVAL_BUCKETS, float("inf"))
        for tier, tier_intervals in snapshot.intervals.items():
            # Prometheus buckets are cumulative; the snapshot's counts are not.
            buckets, running = [], 0
            for bound, count in zip(bounds, tier_intervals.counts, strict=True):
                running += count
                buckets.append((_le(bound), running))
            self.intervals.add_metric([*labels, tier], buckets, tier_intervals.sum_s)

    def families(self) -> tuple[Metric, ...]:
        return (self.intervals,)


class _Fleet:
    """The per-engine series of fleet shares (docs/fleet.md); none without a control plane."""

    def __init__(self) -> None:
        self.fleet_size = GaugeMetricFamily(
            "vllm:output_rate_fleet_engines",
            "Engines in the fleet as the control plane last said (fleet limits without a "
            "share are split by it)",
            labels=ENGINE_LABELS,
        )
        self.num_shares = GaugeMetricFamily(
            "vllm:output_rate_fleet_shares",
            "Users this engine holds a fleet share for (each user's share is its "
            "vllm:output_rate_user_limit_tokens_per_second)",
            labels=ENGINE_LABELS,
        )
        self.leased = GaugeMetricFamily(
            "vllm:output_rate_fleet_lease_valid",
            "1 while the fleet shares' lease (and a keep time) holds, 0 once it ran out (outage "
            "shares apply)",
            labels=ENGINE_LABELS,
        )

    def add(self, labels: list[str], snapshot: MetricsSnapshot) -> None:
        if snapshot.fleet_size is not None:
            self.fleet_size.add_metric(labels, snapshot.fleet_size)
            self.num_shares.add_metric(labels, snapshot.num_shares or 0)
            self.leased.add_metric(labels, 1 if snapshot.shares_leased else 0)

    def families(self) -> tuple[Metric, ...]:
        return (self.fleet_size, self.num_shares, self.leased)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
