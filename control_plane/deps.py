"""What `create_app` wires, as the routes and the edge see it, and the request-scoped
dependencies that hand it out.

The request owns its transaction: a route makes one `await db.run(service, ...)` call,
which runs the service where its `@service` policy says, commits once (writes) when it
returns and rolls back if it raises; a write is acknowledged only after its commit.

The running parts the app reads (live usage, fleet shares, the metrics registry, the
key-creation bound, the leader lease) belong to rooms that stand on the domains; the
routes see each through the narrow protocol below, which the real object (wired by
`app.py`) fits by its shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Protocol

from fastapi import Depends, Request
from sqlalchemy import Connection
from starlette.applications import Starlette

from control_plane.db import Database
from control_plane.push.claims import RefusedClaim, RefusedClaims
from control_plane.push.flagged import Flagged, FlaggedDemands
from control_plane.settings import Settings


@dataclass(frozen=True)
class UserUsage:
    user: str
    tokens_per_s_1s: float
    tokens_per_s_10s: float
    throttled_fraction: float
    # Of the same request-steps, those a shadow limit would have refused (it served them).
    would_throttle_fraction: float = 0.0
    # Of tokens_per_s_*, the tokens lent beyond the user's rate (borrowed up to its ceiling).
    borrowed_per_s_1s: float = 0.0
    borrowed_per_s_10s: float = 0.0


class UsageSource(Protocol):
    """What GET /usage and /metrics read of live usage (control_plane/usage/book.py)."""

    def totals(self) -> list[UserUsage]:
        """Per user, over the window: tokens/s and the throttled fraction."""
        ...

    def report_ages(self) -> dict[str, float]:
        """Seconds since each engine's last usage report."""
        ...

    def rate_1s(self, user: str) -> float | None:
        """One user's tokens/s over the short window, as `totals` has it (None: no report
        in the window names the user); without computing everyone's."""
        ...


class FleetView(Protocol):
    """What GET /limits/{user} and GET /engines show of fleet shares, read from the
    allocator the push server runs (control_plane/fleet/view.py)."""

    def shares_of(self, user: str) -> dict[str, int]:
        """engine id -> the share (milli-tokens/s) it may be enforcing for the user."""
        ...

    def num_shared_users(self, engine_id: str) -> int:
        """Users the engine holds a share for."""
        ...


class RefusedClaimsView(Protocol):
    """What GET /engines shows of the claims of live engine ids this replica refused (two
    engines with one id; control_plane/push/claims.py)."""

    def of(self, engine_id: str) -> RefusedClaim | None:
        """The refusals of that engine id (None: none)."""
        ...


class FlaggedDemandsView(Protocol):
    """What GET /engines shows of the engines whose demand this replica flagged
    implausible (control_plane/push/demand.py)."""

    def of(self, engine_id: str) -> Flagged | None:
        """The flags of that engine id (None: none)."""
        ...


class MetricsPage(Protocol):
    """GET /metrics (control_plane/metrics.py)."""

    def render(self, conn: Connection) -> bytes:
        """The registry's text, its config and fleet gauges read in `conn`'s transaction."""
        ...


class KeyCreations(Protocol):
    """The bound on POST /users/{user}/keys (control_plane/keys/bucket.py)."""

    def take(self) -> float:
        """Take a token: 0.0 when one was there, else the seconds until one is (none taken)."""
        ...


class Leadership(Protocol):
    """This replica in the leader lease, as GET /readyz tells it
    (control_plane/replicas/lease.py)."""

    @property
    def holder(self) -> str: ...

    @property
    def is_leader(self) -> bool: ...


@dataclass(frozen=True)
class AppState:
    """Set once by `create_app`, as `app.state.control_plane`."""

    settings: Settings
    # Its on_commit callables get each new config version (and its ops) after its commit.
    db: Database
    usage_source: UsageSource
    fleet: FleetView
    metrics: MetricsPage
    insecure_no_auth: bool
    # What POST /users/{user}/keys takes a token from (OUTPUT_RATE_KEY_CREATIONS_PER_MINUTE).
    key_creations: KeyCreations
    # This replica's hold on the fleet-wide work (None: an app with no push endpoint).
    lease: Leadership | None = None
    # Claims of live engine ids its push endpoint refused (an app with none: empty).
    claims: RefusedClaimsView = field(default_factory=RefusedClaims)
    # Engines whose demand its push endpoint flagged implausible (an app with none: empty).
    flagged: FlaggedDemandsView = field(default_factory=FlaggedDemands)


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


async def get_claims(request: Request) -> RefusedClaimsView:
    return app_state(request.app).claims


async def get_flagged(request: Request) -> FlaggedDemandsView:
    return app_state(request.app).flagged


async def get_metrics(request: Request) -> MetricsPage:
    return app_state(request.app).metrics


async def get_key_creations(request: Request) -> KeyCreations:
    return app_state(request.app).key_creations


async def get_lease(request: Request) -> Leadership | None:
    return app_state(request.app).lease


DatabaseDep = Annotated[Database, Depends(get_database)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
UsageSourceDep = Annotated[UsageSource, Depends(get_usage_source)]
MetricsDep = Annotated[MetricsPage, Depends(get_metrics)]
FleetDep = Annotated[FleetView, Depends(get_fleet)]
ClaimsDep = Annotated[RefusedClaimsView, Depends(get_claims)]
FlaggedDep = Annotated[FlaggedDemandsView, Depends(get_flagged)]
KeyCreationsDep = Annotated[KeyCreations, Depends(get_key_creations)]
LeaseDep = Annotated[Leadership | None, Depends(get_lease)]
