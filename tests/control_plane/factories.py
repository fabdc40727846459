"""Fresh, migrated databases (SQLite file or PostgreSQL schema) and apps on them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import Connection, create_engine, text

from control_plane.app import create_app
from control_plane.cli import upgrade
from control_plane.deps import FleetView, UsageSource
from control_plane.settings import Settings

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
ADMIN_TOKEN = "admin-secret-token"


class FakeClock:
    """The control plane's injectable clock (seconds), moved by the test: a narrow seam."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@contextmanager
def fresh_database(kind: str, tmp_path: Path) -> Iterator[str]:
    """A migrated, empty database URL; PostgreSQL gets its own schema per test."""
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / f'cp-{uuid.uuid4().hex[:8]}.db'}"
        upgrade(url)
        yield url
        return
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = f"{PG_URL}?options=-csearch_path%3D{schema}"
    try:
        upgrade(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


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
