"""The FastAPI application: REST API, metrics and the admin UI."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.orm import Session

from control_plane.api import router
from control_plane.db import make_engine, make_session_factory
from control_plane.errors import ConfigurationError, DomainError
from control_plane.metrics import install_metrics
from control_plane.settings import Settings

WEB_DIR = Path(__file__).resolve().parents[1] / "web"
logger = logging.getLogger("control_plane")

INSECURE_WARNING = (
    "!!! AUTHENTICATION IS DISABLED (--insecure-no-auth): anyone who can reach this port "
    "can change every limit. Never run like this outside a private test machine. !!!"
)


class NoUsage:
    """Usage source until the push server provides live figures."""

    def usage_items(self, session: Session) -> list[dict[str, Any]]:
        return []


def _field_message(error: dict[str, Any]) -> str:
    loc = [str(p) for p in error.get("loc", ()) if p not in ("body", "path", "query")]
    return f"{'.'.join(loc) or 'body'}: {error.get('msg', 'invalid')}"


def create_app(settings: Settings, *, insecure_no_auth: bool = False) -> FastAPI:
    """The API on an already migrated database (`output-rate db upgrade`).

    app.state offers session_factory, on_commit (callables taking the new config version,
    run after each committed write) and usage_source (what GET /usage shows).
    """
    if settings.admin_token is None and not insecure_no_auth:
        raise ConfigurationError(
            "OUTPUT_RATE_ADMIN_TOKEN is not set; set it, or pass insecure_no_auth "
            "(--insecure-no-auth) on a private test machine"
        )
    if insecure_no_auth:
        logger.warning(INSECURE_WARNING)
    app = FastAPI(title="vllm-output-rate control plane", version="0.1.0")
    engine = make_engine(settings.database_url)
    app.state.settings = settings
    app.state.insecure_no_auth = insecure_no_auth
    app.state.db_engine = engine
    app.state.session_factory = make_session_factory(engine)
    app.state.on_commit = []
    app.state.usage_source = NoUsage()
    app.state.logger = logger

    @app.exception_handler(DomainError)
    async def domain_error(_: Request, exc: DomainError) -> JSONResponse:
        return JSONResponse(
            {"detail": exc.message, "field": exc.field}, status_code=exc.status_code
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")}
            for e in exc.errors()
        ]
        message = "; ".join(_field_message(e) for e in errors)
        return JSONResponse({"detail": errors, "message": message}, status_code=422)

    app.include_router(router)
    install_metrics(app)

    if (WEB_DIR / "index.html").exists():
        app.mount("/ui", StaticFiles(directory=WEB_DIR, html=True), name="ui")

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/" if (WEB_DIR / "index.html").exists() else "/docs")

    return app
