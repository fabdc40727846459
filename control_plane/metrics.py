"""Prometheus metrics of one app instance (its own registry): request counts and
latencies, the config version, the default limit and configured users per tier, and
the fleet view (engines connected and lagging, per-tier tokens/s, usage report age;
docs/metrics.md)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from sqlalchemy import Connection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from control_plane import repository as repo
from control_plane import services

# Label of users that have no tier.
NO_TIER = ""
ENGINE_STATES = ("in_sync", "lagging", "disconnected")


class Metrics:
    def __init__(self, state: Any = None) -> None:
        # The app's state: settings (engine timeout) and usage_source, read at render time
        # (the push server installs its usage source after the app is built).
        self._state = state
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

    def render(self, conn: Connection) -> bytes:
        """Refresh the config gauges from the maintained counters (no table scans)."""
        state = repo.get_config(conn)
        self.version.set(state.version)
        self.default_rate.set(-1 if state.default_rate is None else state.default_rate)
        self.users.clear()
        assigned = 0
        for tier in repo.list_tiers(conn):
            self.users.labels(tier.name).set(tier.num_users)
            assigned += tier.num_users
        self.users.labels(NO_TIER).set(state.num_users - assigned)
        self._render_fleet(conn, state.version)
        return generate_latest(self.registry)

    def _render_fleet(self, conn: Connection, version: int) -> None:
        settings = getattr(self._state, "settings", None)
        timeout_s = settings.engine_timeout_s if settings is not None else 30.0
        counts = dict.fromkeys(ENGINE_STATES, 0)
        max_lag = 0
        for engine in services.list_engines(conn, timeout_s=timeout_s)["items"]:
            if not engine["connected"]:
                counts["disconnected"] += 1
                continue
            lag = version - engine["applied_version"]
            counts["lagging" if lag > 0 else "in_sync"] += 1
            max_lag = max(max_lag, lag)
        for name, num in counts.items():
            self.engines.labels(name).set(num)
        self.max_lag.set(max_lag)
        source = getattr(self._state, "usage_source", None)
        self.tier_rate.clear()
        totals = getattr(source, "totals", None)
        if totals is not None:
            usage = totals()
            records = repo.get_users(conn, [u.user for u in usage]) if usage else {}
            per_tier: dict[str, float] = {}
            for u in usage:
                record = records.get(u.user)
                tier = record.tier if record is not None and record.tier else NO_TIER
                per_tier[tier] = per_tier.get(tier, 0.0) + u.tokens_per_s_10s
            for tier, rate in per_tier.items():
                self.tier_rate.labels(tier).set(rate)
        self.report_age.clear()
        ages = getattr(source, "report_ages", None)
        if ages is not None:
            for engine_id, age in ages().items():
                self.report_age.labels(engine_id).set(age)


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


def install_metrics(app: FastAPI) -> Metrics:
    metrics = Metrics(app.state)
    app.state.metrics = metrics
    app.state.metrics_registry = metrics.registry
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return metrics
