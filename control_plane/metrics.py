"""Prometheus metrics of one app instance (its own registry)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.routing import Match

from control_plane import repository as repo


def install_metrics(app: FastAPI) -> None:
    registry = CollectorRegistry()
    requests = Counter(
        "output_rate_http_requests",
        "HTTP requests",
        ["method", "route", "status"],
        registry=registry,
    )
    latency = Histogram(
        "output_rate_http_request_seconds",
        "HTTP request latency",
        ["method", "route"],
        registry=registry,
    )
    version = Gauge("output_rate_config_version", "Current config version", registry=registry)
    users = Gauge("output_rate_users", "Configured users per tier", ["tier"], registry=registry)
    app.state.metrics_registry = registry

    def route_of(request: Request) -> str:
        for route in app.router.routes:
            match, _ = route.matches(request.scope)
            if match == Match.FULL:
                return getattr(route, "path", "other")
        return "unmatched"

    @app.middleware("http")
    async def measure(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        route = route_of(request)
        requests.labels(request.method, route, str(response.status_code)).inc()
        latency.labels(request.method, route).observe(time.perf_counter() - start)
        return response

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        with app.state.session_factory() as session:
            version.set(repo.get_config(session).version)
            counts = repo.count_users_by_tier(session)
        users.clear()
        for tier, count in counts.items():
            users.labels(tier).set(count)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
