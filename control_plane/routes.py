"""Routes of no domain: health, who the token is, Prometheus metrics."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread
from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from control_plane import metrics as metrics_service
from control_plane.auth import ReaderDep
from control_plane.deps import DatabaseDep, Leadership, LeaseDep, MetricsDep
from control_plane.schemas import ERRORS, Health, Readiness, SessionOut

router = APIRouter(responses=ERRORS)
READY_TIMEOUT_S = 2.0


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process answers (liveness)."""
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "The database is unreachable"}},
)
async def readyz(db: DatabaseDep, lease: LeaseDep) -> JSONResponse:
    """Whether this replica reaches its database within READY_TIMEOUT_S (a load balancer
    sends traffic only to ready replicas); no token needed, nothing else is said."""
    try:
        with anyio.fail_after(READY_TIMEOUT_S):
            # A black-holed connection never answers: the probe says unready after the
            # timeout instead of waiting with the ping (the thread is left to finish).
            await anyio.to_thread.run_sync(db.ping, abandon_on_cancel=True)
    except Exception:
        body = Readiness(status="unready", database="unreachable", **_replica(lease))
        return JSONResponse(body.model_dump(), status_code=503)
    return JSONResponse(Readiness(status="ready", database="ok", **_replica(lease)).model_dump())


def _replica(lease: Leadership | None) -> dict[str, Any]:
    if lease is None:
        return {"replica": None, "leader": None}
    return {"replica": lease.holder, "leader": lease.is_leader}


@router.get("/session", response_model=SessionOut)
async def session(principal: ReaderDep) -> SessionOut:
    """Who the bearer token is: the UI shows write controls only when can_write."""
    return SessionOut(name=principal.name, can_write=principal.can_write)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(db: DatabaseDep, collected: MetricsDep, _: ReaderDep) -> PlainTextResponse:
    body = await db.run(metrics_service.render, metrics=collected)
    return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)
