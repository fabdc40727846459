"""The composition of the control plane: the FastAPI application (REST API, metrics,
the admin UI) and, for `output-rate serve`, the push endpoint and the usage history
wired to it. Nothing else wires parts together."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client.registry import Collector
from starlette.exceptions import HTTPException as StarletteHTTPException

from control_plane import __version__, routes
from control_plane.audit import routes as audit_routes
from control_plane.db import Database, make_engine
from control_plane.deps import AppState, FleetView, UsageSource
from control_plane.edge import EdgeGuard
from control_plane.engines import routes as engine_routes
from control_plane.engines import service as engine_service
from control_plane.errors import ConfigurationError, DomainError, rule_words
from control_plane.fleet.coordinator import FleetCoordinator, quiet_until
from control_plane.fleet.view import CurrentFleet, NoFleet
from control_plane.keys import routes as key_routes
from control_plane.keys.bucket import TokenBucket
from control_plane.keys.last_used import KeyUseRecorder
from control_plane.limits import routes as limit_routes
from control_plane.metrics import Metrics, MetricsMiddleware
from control_plane.push.claims import RefusedClaims
from control_plane.push.flagged import FlaggedDemands
from control_plane.push.metrics import PushCollector
from control_plane.push.server import PushServer
from control_plane.replicas import relay as fleet_relay
from control_plane.replicas.lease import (
    LeaseKeeper,
    default_replica_id,
    release_locks_of_stopped_replicas,
)
from control_plane.replicas.live_usage import FleetUsage, LiveUsageCollector
from control_plane.replicas.notify import ChangeAnnouncer, ChangeListener, current_channel
from control_plane.replicas.single import hold_sqlite_lock
from control_plane.settings import Settings
from control_plane.tokens import routes as token_routes
from control_plane.usage import routes as usage_routes
from control_plane.usage.book import NoUsage, UsageBook
from control_plane.usage.history import UsageRecorder
from control_plane.usage.metrics import UsageCollector

# The built admin UI (scripts/build_ui.py): only the files the browser loads.
UI_DIR = Path(__file__).resolve().parent / "ui"
logger = logging.getLogger("control_plane")

INSECURE_WARNING = (
    "!!! AUTHENTICATION IS DISABLED (--insecure-no-auth): anyone who can reach this port "
    "can change every limit. Never run like this outside a private test machine. !!!"
)


def create_app(
    settings: Settings,
    *,
    insecure_no_auth: bool = False,
    db: Database | None = None,
    usage_source: UsageSource | None = None,
    fleet: FleetView | None = None,
    collectors: Iterable[Collector] = (),
    lease: LeaseKeeper | None = None,
    claims: RefusedClaims | None = None,
    flagged: FlaggedDemands | None = None,
) -> FastAPI:
    """The API on an already migrated database (`output-rate db upgrade`): on `db` (by
    default its own, on settings.database_url), showing `usage_source` as live usage (by
    default none), with `collectors` in its /metrics.

    What the routes use is `app.state.control_plane` (control_plane.deps.AppState).
    """
    _check_authentication(settings, insecure_no_auth=insecure_no_auth)
    app = FastAPI(title="vllm-output-rate control plane", version=__version__)
    usage_source = NoUsage() if usage_source is None else usage_source
    metrics = Metrics(
        engine_timeout_s=settings.engine_timeout_s,
        usage_source=usage_source,
        collectors=collectors,
    )
    app.state.control_plane = AppState(
        settings=settings,
        db=Database(make_engine(settings.database_url)) if db is None else db,
        usage_source=usage_source,
        fleet=NoFleet() if fleet is None else fleet,
        metrics=metrics,
        insecure_no_auth=insecure_no_auth,
        key_creations=TokenBucket(
            per_minute=settings.key_creations_per_minute, burst=settings.key_creation_burst
        ),
        lease=lease,
        claims=RefusedClaims() if claims is None else claims,
        flagged=FlaggedDemands() if flagged is None else flagged,
    )
    _answer_errors(app)
    _route(app, metrics)
    _serve_ui(app)
    return app


def _check_authentication(settings: Settings, *, insecure_no_auth: bool) -> None:
    if settings.admin_token is None and not insecure_no_auth:
        raise ConfigurationError(
            "OUTPUT_RATE_ADMIN_TOKEN is not set; set it, or pass insecure_no_auth "
            "(--insecure-no-auth) on a private test machine"
        )
    if insecure_no_auth:
        logger.warning(INSECURE_WARNING)


def _answer_errors(app: FastAPI) -> None:
    """The one place errors become HTTP: every error body is {"detail": str, "field": ...}."""
    app.exception_handler(DomainError)(_domain_error)
    app.exception_handler(RequestValidationError)(_validation_error)
    app.exception_handler(StarletteHTTPException)(_http_error)


async def _domain_error(_: Request, exc: DomainError) -> JSONResponse:
    body: dict[str, Any] = {"detail": exc.message, "field": exc.field, **exc.extra}
    if exc.errors is not None:
        body["errors"] = exc.errors
    return JSONResponse(
        body,
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [
        {
            "field": _field_name(e.get("loc", ())),
            "msg": rule_words(e),
            "type": str(e.get("type", "")),
        }
        for e in exc.errors()
    ]
    detail = "; ".join(f"{e['field']}: {e['msg']}" for e in errors) or "invalid input"
    field = errors[0]["field"] if errors else None
    return JSONResponse({"detail": detail, "field": field, "errors": errors}, status_code=422)


def _field_name(loc: Sequence[Any]) -> str:
    """("body", "items", 3, "tier") -> "items.3.tier"; a malformed body is "body"."""
    parts = [str(p) for p in loc[1:]] if loc and loc[0] in ("body", "path", "query") else []
    return ".".join(parts) or (str(loc[0]) if loc else "body")


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(
        {"detail": str(exc.detail), "field": None},
        status_code=exc.status_code,
        headers=exc.headers,
    )


def _route(app: FastAPI, metrics: Metrics) -> None:
    for domain in (
        routes,
        limit_routes,
        engine_routes,
        usage_routes,
        audit_routes,
        token_routes,
        key_routes,
    ):
        app.include_router(domain.router)
    # Inside the metrics middleware, so refused requests are counted too.
    app.add_middleware(EdgeGuard)
    app.add_middleware(MetricsMiddleware, metrics=metrics)


def _serve_ui(app: FastAPI) -> None:
    if (UI_DIR / "index.html").exists():
        app.mount("/ui", StaticFiles(directory=UI_DIR, html=True), name="ui")

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/" if (UI_DIR / "index.html").exists() else "/docs")


@dataclass
class Served:
    """What `output-rate serve` runs: the app, and beside it the push endpoint, the usage
    history and, on PostgreSQL, the LISTEN session that wakes the push thread when another
    replica commits a change (started and closed by the caller)."""

    app: FastAPI
    db: Database
    push: PushServer
    history: UsageRecorder
    key_uses: KeyUseRecorder
    lease: LeaseKeeper
    database_url: str
    listener: ChangeListener | None = None
    announcer: ChangeAnnouncer | None = None
    relay: fleet_relay.FleetRelay | None = None
    live_usage: FleetUsage | None = None
    # PostgreSQL: NOTIFY the other replicas after each commit, LISTEN for theirs.
    notify: bool = True
    _sqlite_lock: IO[str] | None = None
    _closed: bool = False

    def start(self) -> None:
        """Raises AnotherReplica when another serve holds this SQLite database."""
        self._sqlite_lock = hold_sqlite_lock(self.database_url)
        self.lease.start()
        self.push.start()
        if self.relay is not None:
            self.relay.start()
        if self.live_usage is not None:
            self.live_usage.start()
        self.history.start()
        self.key_uses.start()
        if self.db.engine.dialect.name == "postgresql" and self.notify:
            with self.db.engine.connect() as conn:
                channel = current_channel(conn)
            self.listener = ChangeListener(self.db.engine, channel, self.push.notify)
            self.listener.start()
            self.announcer = ChangeAnnouncer(self.db.engine, channel)
            self.announcer.start()
            self.db.on_commit.append(self.announcer.committed)

    def close(self) -> None:
        """Idempotent: called at the app's shutdown and again by the caller."""
        if self._closed:
            return
        self._closed = True
        # The push endpoint first: its engines hear the goodbye and move to another replica
        # now, not after the PostgreSQL sessions below end their waits (up to 0.5 s each).
        # Their wake-ups of a closed push server do nothing; the relay still sends what
        # the push thread handed it last.
        self.push.close()
        for session in (self.announcer, self.listener):
            if session is not None:
                session.close()
        if self.relay is not None:
            self.relay.close()
        if self.live_usage is not None:
            self.live_usage.close()
        self.history.close()
        self.key_uses.close()
        self.lease.close()
        if self._sqlite_lock is not None:
            self._sqlite_lock.close()


def create_served_app(settings: Settings, *, insecure_no_auth: bool = False) -> Served:
    """The app with its push endpoint: every commit wakes the push server, engines'
    usage reports feed GET /usage, /metrics and the usage history, their API servers'
    key-use reports the keys' last_used_at. On PostgreSQL the fleet allocator runs on
    the leader replica only, the others relay to it (docs/replicas.md); on SQLite (one
    replica) it always runs here."""
    engine = make_engine(settings.database_url)
    replicated = engine.dialect.name == "postgresql"
    if replicated:
        release_locks_of_stopped_replicas(engine)
    db = Database(engine)
    book = UsageBook()
    replica_id = settings.replica_id or default_replica_id()
    lease = LeaseKeeper(db, holder=replica_id)
    key_uses = KeyUseRecorder(db)
    if replicated:
        push_side = _push_among_replicas(settings, db, book, key_uses, lease, replica_id)
    else:
        push_side = _push_alone(settings, db, book, key_uses)
    push = push_side.push
    db.on_commit.append(push.committed)
    history = UsageRecorder(
        db,
        retention_days=settings.usage_retention_days,
        max_users_per_minute=settings.usage_history_max_users_per_minute,
        term=(lambda: lease.term) if replicated else None,
    )
    book.on_report.append(history.add)
    collectors: list[Collector] = [
        PushCollector(push),
        UsageCollector(book, history, push_side.usage_source),
    ]
    if push_side.live_usage is not None:
        collectors.append(LiveUsageCollector(push_side.live_usage))
    app = create_app(
        settings,
        insecure_no_auth=insecure_no_auth,
        db=db,
        usage_source=push_side.usage_source,
        fleet=push_side.fleet,
        collectors=collectors,
        lease=lease,
        claims=push.claims,
        flagged=push.flagged,
    )
    served = Served(
        app=app,
        db=db,
        push=push,
        history=history,
        key_uses=key_uses,
        lease=lease,
        database_url=settings.database_url,
        relay=push_side.relay,
        live_usage=push_side.live_usage,
        notify=settings.replica_notify,
    )
    # At shutdown, while the process still runs (uvicorn re-raises SIGTERM after it, so
    # the caller's own close may never come): engines hear the goodbye, counts are flushed,
    # the lease is released.
    app.router.on_shutdown.append(served.close)
    return served


@dataclass(frozen=True)
class _PushSide:
    """The push server and what the app shows through it: live usage and fleet shares;
    among replicas also the relay to the leader and the usage merged over replicas."""

    push: PushServer
    usage_source: UsageSource
    fleet: FleetView
    relay: fleet_relay.FleetRelay | None = None
    live_usage: FleetUsage | None = None


def _push_alone(
    settings: Settings, db: Database, book: UsageBook, key_uses: KeyUseRecorder
) -> _PushSide:
    """SQLite, one replica: this one runs the fleet allocator, and its book is all usage.
    It starts quiet, as a new leader does (docs/fleet.md, "Bound holes"): the process it
    replaces (a restart) may have given out leases up to the moment it started, and its
    fresh allocator knows none of them; engines keep those shares until their lease ends,
    then their safe shares, and only then hear the new shares. The engines its predecessor
    heard within ``gone_after`` count in the fleet at once, and it stays quiet until each
    said its whole demand (at most SEED_WAIT_S): else an engine joining before they are
    back reads a fleet without them, and serves its safe share of that smaller fleet
    beside them."""
    outage = settings.outage
    fleet = _new_fleet(
        settings, quiet_until(time.monotonic(), settings.share_lease_s, outage.kept_s)
    )
    heard = db.run_now(engine_service.recent_engine_ids, within_s=fleet.gone_after_s)
    if heard:
        fleet.await_engines(heard)
        logger.info(
            "fleet: %d engine(s) heard in the last %.0fs count at once; first shares after "
            "each said its whole demand",
            len(heard),
            fleet.gone_after_s,
        )
    push = PushServer.from_settings(settings, db=db, usage=book, fleet=fleet, key_uses=key_uses.add)
    return _PushSide(push=push, usage_source=book, fleet=CurrentFleet(lambda: push.fleet))


def _push_among_replicas(
    settings: Settings,
    db: Database,
    book: UsageBook,
    key_uses: KeyUseRecorder,
    lease: LeaseKeeper,
    replica_id: str,
) -> _PushSide:
    """PostgreSQL: the leader runs the fleet allocator, the others relay to it; live usage
    is this replica's book merged with the others'."""
    with db.engine.connect() as conn:
        channel = current_channel(conn, prefix=fleet_relay.CHANNEL_PREFIX)
    relay = fleet_relay.FleetRelay(
        db,
        replica_id=replica_id,
        term=lambda: lease.term,
        channel=channel,
        notify=settings.replica_notify,
    )
    push = PushServer.from_settings(
        settings,
        db=db,
        usage=book,
        key_uses=key_uses.add,
        relay=relay,
        term=lambda: lease.term,
        make_fleet=partial(_new_fleet, settings),
    )
    relay.on_arrival = push.wake
    live = FleetUsage(
        db, book, replica_id=replica_id, term=lambda: lease.term, allocator=lambda: push.fleet
    )
    # The leader shows its allocator's shares; a follower, what the leader last wrote.
    fleet = CurrentFleet(lambda: push.fleet if push.fleet is not None else live.shares())
    return _PushSide(push=push, usage_source=live, fleet=fleet, relay=relay, live_usage=live)


def _new_fleet(settings: Settings, quiet_until: float = float("-inf")) -> FleetCoordinator:
    return FleetCoordinator(
        lease_s=settings.share_lease_s,
        gone_after_s=settings.share_gone_after_s,
        quiet_until=quiet_until,
        outage=settings.outage,
    )
