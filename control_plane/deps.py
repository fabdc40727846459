"""What `create_app` wires, as the routes and the edge see it, and the request-scoped
dependencies that hand it out.

The request owns its transaction: a route makes one `await db.run(service, ...)` call,
which runs the service where its `@service` policy says, commits once (writes) when it
returns and rolls back if it raises; a write is acknowledged only after its commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from starlette.applications import Starlette

from control_plane.db import Database
from control_plane.fleet.view import FleetView
from control_plane.keys.bucket import TokenBucket
from control_plane.metrics import Metrics
from control_plane.replicas.lease import LeaseKeeper
from control_plane.settings import Settings
from control_plane.usage.book import UsageSource


@dataclass(frozen=True)
class AppState:
    """Set once by `create_app`, as `app.state.control_plane`."""

    settings: Settings
    # Its on_commit callables get each new config version after its commit.
    db: Database
    # What GET /usage and /metrics show of live usage.
    usage_source: UsageSource
    # What GET /limits/{user} and GET /engines show of fleet shares.
    fleet: FleetView
    metrics: Metrics
    insecure_no_auth: bool
    # What POST /users/{user}/keys takes a token from (OUTPUT_RATE_KEY_CREATIONS_PER_MINUTE).
    key_creations: TokenBucket
    # This replica's hold on the fleet-wide work (None: an app with no push endpoint).
    lease: LeaseKeeper | None = None


def app_state(app: Starlette) -> AppState:
    state: AppState = app.state.control_plane
    return state


# async: FastAPI would run a plain function in a worker thread.
async def get_database(request: Request) -> Database:
    return app_state(request.app).db


async def get_settings(request: Request) -> Settings:
    return app_state(request.app).settings


async def get_usage_source(request: Request) -> UsageSource:
    return app_state(request.app).usage_source


async def get_fleet(request: Request) -> FleetView:
    return app_state(request.app).fleet


async def get_metrics(request: Request) -> Metrics:
    return app_state(request.app).metrics


async def get_key_creations(request: Request) -> TokenBucket:
    return app_state(request.app).key_creations


DatabaseDep = Annotated[Database, Depends(get_database)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
UsageSourceDep = Annotated[UsageSource, Depends(get_usage_source)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
FleetDep = Annotated[FleetView, Depends(get_fleet)]
KeyCreationsDep = Annotated[TokenBucket, Depends(get_key_creations)]


async def get_lease(request: Request) -> LeaseKeeper | None:
    return app_state(request.app).lease


LeaseDep = Annotated[LeaseKeeper | None, Depends(get_lease)]
