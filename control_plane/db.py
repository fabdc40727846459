"""Database engine and sessions.

SQLite needs help to serialize writers: pysqlite's own transaction handling is switched
off so that write transactions start with BEGIN IMMEDIATE, taking the write lock up front
and waiting on the busy timeout. A deferred transaction that read first and then tries to
write can fail at once with "database is locked" under concurrency.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

WRITE_OPTION = "output_rate_write"
SQLITE_BUSY_TIMEOUT_MS = 30_000
# More connections than the server's 40 worker threads: a thread holding a connection
# must never wait for one blocked on the pool.
_POOL: dict[str, Any] = {"pool_size": 10, "max_overflow": 40}


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
            **_POOL,
        )
        _configure_sqlite(engine)
        return engine
    return create_engine(url, pool_pre_ping=True, **_POOL)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # BEGIN is emitted by _begin below
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: a committed write survives a killed process (not a power cut).
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        write = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def begin_write(session: Session) -> None:
    """Start the session's transaction as a writer (SQLite: BEGIN IMMEDIATE).

    Does nothing when the transaction already began; writers then rely on the config-row
    lock taken by the services (PostgreSQL) or on having started as writers (SQLite).
    """
    if not session.in_transaction():
        session.connection(execution_options={WRITE_OPTION: True})
