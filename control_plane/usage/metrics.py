"""Prometheus view of live usage: per-user rates and the users the book left out."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from control_plane.usage.book import UsageBook


class UsageCollector(Collector):
    def __init__(self, book: UsageBook) -> None:
        self._book = book

    def collect(self) -> Iterator[Metric]:
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
        for usage in self._book.totals():
            rate.add_metric([usage.user], usage.tokens_per_s_10s)
            throttled.add_metric([usage.user], usage.throttled_fraction)
        yield rate
        yield throttled
