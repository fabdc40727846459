"""Prometheus metrics of one app instance (its own registry): request counts and
latencies, the config version, the default limit and configured users per tier, and
the fleet view (engines connected and lagging, per-tier tokens/s, usage report age;
docs/metrics.md)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.registry import Collector
from sqlalchemy import Connection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from control_plane.db import service
from control_plane.deps import MetricsPage, UsageSource
from control_plane.engines import service as engines
from control_plane.limits import service as limits
from control_plane.usage import service as usage

# Label of users that have no tier.
NO_TIER = ""
ENGINE_STATES = ("in_sync", "lagging", "disconnected")


class Metrics:
    """The app's registry; `collectors` add their own families (the push server's)."""

    def __init__(
        self,
        *,
        engine_timeout_s: float,
        usage_source: UsageSource,
        collectors: Iterable[Collector] = (),
    ) -> None:
        self._engine_timeout_s = engine_timeout_s
        self._usage_source = usage_source
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "output_rate_http_requests",
            "HTTP requests by route template, method and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "output_rate_http_request_seconds",
            "HTTP request latency by route template and method",
            ["method", "route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=self.registry,
        )
        self.version = Gauge(
            "output_rate_config_version", "Current config version", registry=self.registry
        )
        self.default_rate = Gauge(
            "output_rate_default_tokens_per_second",
            "Default limit in tokens/s (-1: unlimited)",
            registry=self.registry,
        )
        self.users = Gauge(
            "output_rate_users",
            'Configured users per tier (tier="" for users without a tier)',
            ["tier"],
            registry=self.registry,
        )

        self.engines = Gauge(
            "output_rate_fleet_engines",
            "Known engines by state: in_sync (applied the current version), lagging "
            "(connected, older version), disconnected",
            ["state"],
            registry=self.registry,
        )
        self.max_lag = Gauge(
            "output_rate_fleet_max_version_lag",
            "Largest (current version - applied version) over connected engines",
            registry=self.registry,
        )
        self.tier_rate = Gauge(
            "output_rate_tier_output_tokens_per_second",
            'Output tokens/s per tier over the last 10 s, summed over engines (tier="" for '
            "users without a tier)",
            ["tier"],
            registry=self.registry,
        )
        self.report_age = Gauge(
            "output_rate_usage_report_age_seconds",
            "Seconds since each engine's last usage report (engines report only with traffic)",
            ["engine_id"],
            registry=self.registry,
        )
        for collector in collectors:
            self.registry.register(collector)

    def render(self, conn: Connection) -> bytes:
        """Refresh the config gauges from the maintained counters (no table scans)."""
        counts = limits.user_counts(conn)
        self.version.set(counts.version)
        self.default_rate.set(-1 if counts.default_rate is None else counts.default_rate)
        self.users.clear()
        for tier, num in counts.num_users_per_tier.items():
            self.users.labels(tier).set(num)
        self.users.labels(NO_TIER).set(counts.num_users - sum(counts.num_users_per_tier.values()))
        self._render_fleet(conn, counts.version)
        return generate_latest(self.registry)

    def _render_fleet(self, conn: Connection, version: int) -> None:
        states = dict.fromkeys(ENGINE_STATES, 0)
        max_lag = 0
        for engine in engines.list_engines(conn, timeout_s=self._engine_timeout_s).items:
            if not engine.connected:
                states["disconnected"] += 1
                continue
            lag = version - engine.applied_version
            states["lagging" if lag > 0 else "in_sync"] += 1
            max_lag = max(max_lag, lag)
        for name, num in states.items():
            self.engines.labels(name).set(num)
        self.max_lag.set(max_lag)
        self.tier_rate.clear()
        for tier, rate in usage.tier_rates(conn, self._usage_source.totals()).items():
            self.tier_rate.labels(NO_TIER if tier is None else tier).set(rate)
        self.report_age.clear()
        for engine_id, age in self._usage_source.report_ages().items():
            self.report_age.labels(engine_id).set(age)


@service("read")
def render(conn: Connection, *, metrics: MetricsPage) -> bytes:
    """GET /metrics: the registry's text, its config and fleet gauges read now."""
    return metrics.render(conn)


class MetricsMiddleware:
    """Pure ASGI (no per-request task), labelled by route template so that user ids never
    become label values."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.requests.labels(scope["method"], route, str(status)).inc()
            self.metrics.latency.labels(scope["method"], route).observe(time.perf_counter() - start)
