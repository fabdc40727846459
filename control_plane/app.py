"""The FastAPI application: REST API, metrics and the admin UI."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy import Connection
from starlette.exceptions import HTTPException as StarletteHTTPException

from control_plane import __version__
from control_plane.api import router
from control_plane.db import Database, make_engine
from control_plane.edge import EdgeGuard
from control_plane.errors import ConfigurationError, DomainError
from control_plane.metrics import install_metrics
from control_plane.settings import Settings

# The built admin UI (scripts/build_ui.py): only the files the browser loads.
UI_DIR = Path(__file__).resolve().parent / "ui"
logger = logging.getLogger("control_plane")

INSECURE_WARNING = (
    "!!! AUTHENTICATION IS DISABLED (--insecure-no-auth): anyone who can reach this port "
    "can change every limit. Never run like this outside a private test machine. !!!"
)


class NoUsage:
    """Usage source until the push server provides live figures."""

    def usage_items(self, conn: Connection) -> list[dict[str, Any]]:
        return []


def _field_name(loc: Sequence[Any]) -> str:
    """("body", "items", 3, "tier") -> "items.3.tier"; a malformed body is "body"."""
    parts = [str(p) for p in loc[1:]] if loc and loc[0] in ("body", "path", "query") else []
    return ".".join(parts) or (str(loc[0]) if loc else "body")


def create_app(settings: Settings, *, insecure_no_auth: bool = False) -> FastAPI:
    """The API on an already migrated database (`output-rate db upgrade`).

    app.state offers db (control_plane.db.Database: its on_commit callables get each new
    config version after its commit) and usage_source (what GET /usage shows).
    """
    if settings.admin_token is None and not insecure_no_auth:
        raise ConfigurationError(
            "OUTPUT_RATE_ADMIN_TOKEN is not set; set it, or pass insecure_no_auth "
            "(--insecure-no-auth) on a private test machine"
        )
    if insecure_no_auth:
        logger.warning(INSECURE_WARNING)
    app = FastAPI(title="vllm-output-rate control plane", version=__version__)
    app.state.settings = settings
    app.state.insecure_no_auth = insecure_no_auth
    app.state.db = Database(make_engine(settings.database_url))
    app.state.usage_source = NoUsage()

    # The one place errors become HTTP: every error body is {"detail": str, "field": ...}.
    @app.exception_handler(DomainError)
    async def domain_error(_: Request, exc: DomainError) -> JSONResponse:
        return JSONResponse(
            {"detail": exc.message, "field": exc.field}, status_code=exc.status_code
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {
                "field": _field_name(e.get("loc", ())),
                "msg": str(e.get("msg", "invalid")),
                "type": str(e.get("type", "")),
            }
            for e in exc.errors()
        ]
        detail = "; ".join(f"{e['field']}: {e['msg']}" for e in errors) or "invalid input"
        field = errors[0]["field"] if errors else None
        return JSONResponse({"detail": detail, "field": field, "errors": errors}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            {"detail": str(exc.detail), "field": None},
            status_code=exc.status_code,
            headers=exc.headers,
        )

    app.include_router(router)
    # Inside the metrics middleware, so refused requests are counted too.
    app.add_middleware(EdgeGuard)
    install_metrics(app)

    if (UI_DIR / "index.html").exists():
        app.mount("/ui", StaticFiles(directory=UI_DIR, html=True), name="ui")

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/" if (UI_DIR / "index.html").exists() else "/docs")

    return app
