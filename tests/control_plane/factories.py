"""Apps on fresh databases (harness/control_plane.py), settings, a fake clock, and a
writer's lock held from outside."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fastapi.testclient import TestClient
from sqlalchemy import Connection, create_engine, text

from control_plane.app import create_app
from control_plane.deps import FleetView, UsageSource
from control_plane.fleet.allocator import FleetAllocator, ShareUpdate
from control_plane.settings import Settings
from harness.control_plane import ADMIN_TOKEN
from output_rate_core.outage import DEFAULT_OUTAGE, OutagePolicy


class FakeClock:
    """The control plane's injectable clock (seconds), moved by the test: a narrow seam."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_allocator(
    *engines: str, lease_s: float = 3.0, outage: OutagePolicy = DEFAULT_OUTAGE
) -> tuple[FleetAllocator, FakeClock]:
    """An allocator on a fake clock that has heard ``engines``, each of which has
    acknowledged its first (full) table."""
    clock = FakeClock(0.0)
    alloc = FleetAllocator(clock=clock, lease_s=lease_s, outage=outage)
    for engine_id in engines:
        alloc.engine_heard(engine_id)
    updates = alloc.step()
    assert {e: u.full for e, u in updates.items()} == dict.fromkeys(engines, True)
    ack(alloc, updates)
    return alloc, clock


def ack(alloc: FleetAllocator, updates: dict[str, ShareUpdate], *only: str) -> None:
    """The engines sent ``updates`` (only those named, if any) acknowledge them."""
    for engine_id, update in updates.items():
        if not only or engine_id in only:
            alloc.acked(engine_id, update.seq)


def make_settings(url: str, **overrides: object) -> Settings:
    return Settings(database_url=url, admin_token=ADMIN_TOKEN, **overrides)  # type: ignore[arg-type]


def make_client(
    url: str, *, usage_source: UsageSource | None = None, fleet: FleetView | None = None
) -> TestClient:
    client = TestClient(create_app(make_settings(url), usage_source=usage_source, fleet=fleet))
    client.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
    return client


@contextmanager
def writers_lock_held(db_url: str) -> Iterator[Connection]:
    """A separate connection, as another process would, holding what every writer needs
    (SQLite's write lock; PostgreSQL's config row). `rollback()` on it releases it early."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            if conn.dialect.name == "sqlite":
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            else:
                conn.begin()
                conn.execute(text("UPDATE config_state SET version = version WHERE id = 1"))
            try:
                yield conn
            finally:
                conn.rollback()
    finally:
        engine.dispose()
