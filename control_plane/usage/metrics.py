"""Prometheus view of live usage: per-user rates and throttled (and would-throttle)
fractions, of the whole fleet with replicas; the users this replica's book left out, and
the reports (and history users) refused by its usage bounds."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from control_plane.deps import UsageSource
from control_plane.usage import book as usage_book
from control_plane.usage import history as usage_history
from control_plane.usage.book import UsageBook
from control_plane.usage.history import UsageRecorder


class UsageCollector(Collector):
    """``live``: what the per-user series show (default: ``book``; with replicas, the
    fleet's usage: control_plane/replicas/live_usage.py)."""

    def __init__(
        self,
        book: UsageBook,
        history: UsageRecorder | None = None,
        live: UsageSource | None = None,
    ) -> None:
        self._book = book
        self._history = history
        self._live: UsageSource = book if live is None else live

    def collect(self) -> Iterator[Metric]:
        refused = CounterMetricFamily(
            "output_rate_usage_refused",
            "Usage refused by its bounds (docs/metrics.md): whole reports of one engine "
            "(reasons reports, tokens, steps, users, parts), or users left out of the "
            "usage history (history_engine_users, history_users)",
            labels=["reason"],
        )
        counts = self._book.refused.counts()
        reasons = list(usage_book.REFUSAL_REASONS)
        if self._history is not None:
            counts.update(self._history.refused.counts())
            reasons += usage_history.REFUSAL_REASONS
        for reason in reasons:
            refused.add_metric([reason], counts.get(reason, 0))
        yield refused
        left_out = CounterMetricFamily(
            "output_rate_usage_users_left_out",
            "Users of usage reports left out: /usage already tracks its maximum of users",
        )
        left_out.add_metric([], self._book.num_users_left_out)
        yield left_out
        rate = GaugeMetricFamily(
            "output_rate_user_output_tokens_per_second",
            "Output tokens/s per user over the last 10 s, summed over engines",
            labels=["user"],
        )
        throttled = GaugeMetricFamily(
            "output_rate_user_throttled_fraction",
            "Fraction of a user's request-steps refused a token over the last 10 s",
            labels=["user"],
        )
        would_throttle = GaugeMetricFamily(
            "output_rate_user_would_throttle_fraction",
            "Fraction of a user's request-steps a shadow limit would have refused a token "
            "(they were served) over the last 10 s",
            labels=["user"],
        )
        for usage in self._live.totals():
            rate.add_metric([usage.user], usage.tokens_per_s_10s)
            throttled.add_metric([usage.user], usage.throttled_fraction)
            would_throttle.add_metric([usage.user], usage.would_throttle_fraction)
        yield rate
        yield throttled
        yield would_throttle
