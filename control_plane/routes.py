"""Routes of no domain: health, who the token is, Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from control_plane import metrics as metrics_service
from control_plane.auth import ReaderDep
from control_plane.deps import DatabaseDep, MetricsDep
from control_plane.schemas import ERRORS, Health, SessionOut

router = APIRouter(responses=ERRORS)


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    return Health(status="ok")


@router.get("/session", response_model=SessionOut)
async def session(principal: ReaderDep) -> SessionOut:
    """Who the bearer token is: the UI shows write controls only when can_write."""
    return SessionOut(name=principal.name, can_write=principal.can_write)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(db: DatabaseDep, collected: MetricsDep, _: ReaderDep) -> PlainTextResponse:
    body = await db.run(metrics_service.render, metrics=collected)
    return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)
