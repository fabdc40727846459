"""Prometheus metrics of one app instance (its own registry): request counts and
latencies, the config version, the default limit and configured users per tier."""

from __future__ import annotations

import time

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from sqlalchemy import Connection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from control_plane import repository as repo

# Label of users that have no tier.
NO_TIER = ""


class Metrics:
    def __init__(self) -> None:
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
        return generate_latest(self.registry)


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
    metrics = Metrics()
    app.state.metrics = metrics
    app.state.metrics_registry = metrics.registry
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return metrics
