"""The database: one engine, and one transaction per call of a service.

A service function takes the Connection of one transaction and declares, once, where
`Database.run` runs it: `@service("read")`, `"scan"`, `"write"` or `"write_batch"`
(`Policy` below). Routes only `await db.run(fn, ...)`.

SQLite needs help to serialize writers: pysqlite's own transaction handling is switched
off so that write transactions start with BEGIN IMMEDIATE, taking the write lock up front
and waiting on the busy timeout. A deferred transaction that read first and then tries to
write can fail at once with "database is locked" under concurrency.

Where the work runs (docs/control-plane.md, "How a request runs"): a hop to a worker
thread costs the server more CPU than a SQLite point query (0.1 ms idle, up to 0.5 ms
under load, against 0.05 ms), so SQLite reads run on the event loop; in WAL mode a
reader never waits for a lock. A small SQLite write runs there too when it can take the
write lock at once (busy timeout 0); otherwise, and for bulk writes and everything on
PostgreSQL (a network round trip), it runs on the writer thread, which may wait for
another writer: the loop must never wait.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Concatenate, Generic, Literal, ParamSpec, TypeVar

import anyio.to_thread
from sqlalchemy import Connection, String, any_, bindparam, create_engine, event, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import GenericFunction

from output_rate_core import protocol as p

logger = logging.getLogger("control_plane")

P = ParamSpec("P")
T = TypeVar("T")

WRITE_OPTION = "output_rate_write"
# With WRITE_OPTION on SQLite: take the write lock now or fail at once, never wait.
NO_WAIT_OPTION = "output_rate_no_wait"
SQLITE_BUSY_TIMEOUT_MS = 30_000
# More connections than the server's 40 worker threads: a thread holding a connection
# must never wait for one blocked on the pool.
_POOL: dict[str, Any] = {"pool_size": 10, "max_overflow": 40}


def one_of(conn: Connection, column: Any, values: list[str]) -> ColumnElement[bool]:
    """`column IN values` as one statement parameter on PostgreSQL (= ANY(array)): with
    10,000 values an IN list of as many parameters cost it 4x more to send and plan. SQLite
    (>= 3.32: 32,766 parameters) takes the list, probed through the index."""
    if conn.dialect.name == "postgresql":
        return column == any_(bindparam(None, values, type_=ARRAY(String)))
    return column.in_(values)


class unicode_lower(GenericFunction[str]):
    """lower() of any letter, not only ASCII ones, on both databases: SQLite's lower()
    and LIKE fold ASCII only ("MÜLLER" would not find "müller"), so SQLite calls Python's
    str.lower (registered on each connection); on PostgreSQL the ids' columns are
    collated "C" (byte order), under which lower() folds ASCII only too, so it lowers
    under the database's default collation (LC_CTYPE: any UTF-8 locale, C.UTF-8
    included, folds every letter)."""

    type = String()
    inherit_cache = True


@compiles(unicode_lower)
def _unicode_lower(element: unicode_lower, compiler: SQLCompiler, **kw: Any) -> str:
    return f'lower({compiler.process(element.clauses, **kw)} COLLATE "default")'


@compiles(unicode_lower, "sqlite")
def _unicode_lower_sqlite(element: unicode_lower, compiler: SQLCompiler, **kw: Any) -> str:
    return f"unicode_lower({compiler.process(element.clauses, **kw)})"


def _python_lower(value: str | None) -> str | None:
    return None if value is None else value.lower()


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
        # Temporary tables, sorts and statement journals (a bulk write's) in memory: a
        # write opens no file beyond its connection's, so a descriptor shortage cannot
        # fail it.
        cursor.execute("PRAGMA temp_store=MEMORY")
        cursor.close()
        dbapi_connection.create_function("unicode_lower", 1, _python_lower, deterministic=True)

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        # Straight on the driver's connection: these run once per request, and going
        # through SQLAlchemy's statement machinery cost more than the statements.
        dbapi_connection = conn.connection.dbapi_connection
        options = conn.get_execution_options()
        if not options.get(WRITE_OPTION, False):
            dbapi_connection.execute("BEGIN")
        elif options.get(NO_WAIT_OPTION, False):
            dbapi_connection.execute("PRAGMA busy_timeout=0")
            try:
                dbapi_connection.execute("BEGIN IMMEDIATE")
            finally:
                dbapi_connection.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        else:
            dbapi_connection.execute("BEGIN IMMEDIATE")


# Where a service runs (Database.run):
# - read: a small read; SQLite: on the event loop; PostgreSQL: a worker thread.
# - scan: a read whose cost grows with the data (a deep page, a count): a worker thread.
# - write: a small write (one user, one tier); SQLite: on the loop when the write lock
#   is free at once, else the writer thread; PostgreSQL: the writer thread.
# - write_batch: a write of any size: the writer thread.
Policy = Literal["read", "scan", "write", "write_batch"]
_WRITES: frozenset[Policy] = frozenset({"write", "write_batch"})


class Service(Generic[P, T]):
    """A service function with its policy. Called with a Connection it is the plain
    function, in that connection's transaction (another service, a test)."""

    def __init__(self, fn: Callable[Concatenate[Connection, P], T], policy: Policy) -> None:
        self.fn = fn
        self.policy = policy

    def __call__(self, conn: Connection, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self.fn(conn, *args, **kwargs)


def service(
    policy: Policy,
) -> Callable[[Callable[Concatenate[Connection, P], T]], Service[P, T]]:
    """Declare where `Database.run` runs the decorated service function."""

    def declare(fn: Callable[Concatenate[Connection, P], T]) -> Service[P, T]:
        return Service(fn, policy)

    return declare


@dataclass(frozen=True)
class Commit:
    """A config version a write made: its number and its ops, the very ops its change-log
    row holds (control_plane/config/service.py, `commit`)."""

    version: int
    ops: tuple[p.Op, ...]


@dataclass(frozen=True)
class ConfigChange(Generic[T]):
    """What a write of the configuration returns: its result and the version it
    committed (None: it changed nothing). `Database` hands that `Commit` to its
    `on_commit` hooks once the transaction has committed."""

    result: T
    commit: Commit | None
    # The version of the record written, as its ETag names it once committed (None: the
    # write versions no record: a bulk change, an API key).
    record_version: int | None = None


class _WriteLockBusy(Exception):
    """Another connection holds SQLite's write lock."""


def _is_locked(error: Exception) -> bool:
    """SQLite's "database is locked", raw from the driver or wrapped by SQLAlchemy."""
    orig = error.orig if isinstance(error, OperationalError) else error
    return isinstance(orig, sqlite3.OperationalError) and "locked" in str(orig)


class Database:
    """The app's engine and its unit of work: each call runs `fn(conn, **kwargs)` in one
    transaction, committed once when `fn` returns (writes) or rolled back (reads, and
    writes that raise). `on_commit` callables get each new config version (a `Commit`)
    after its commit, outside the transaction, on the thread that wrote it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.on_commit: list[Callable[[Commit], None]] = []
        # SQLite: small reads and writes run on the event loop (see the module doc).
        self._on_loop = engine.dialect.name == "sqlite"
        # One thread runs every request's write: writers serialize on the database's
        # lock anyway, so they queue here instead of parking worker threads on it,
        # and a one-thread executor is the cheapest hop off the loop.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="output-rate-writer")
        # The writer thread's connection, kept open (only that thread uses it): a queued
        # write neither waits for the pool nor opens a connection, a file, when the
        # process is short of them.
        self._writer_conn: Connection | None = None
        # SQLite: the connection that reads and writes inline on an event loop's thread,
        # kept open (one per such thread) so that a request does not pay a pool
        # checkout and return. Calls on it never interleave: each runs to completion
        # without awaiting.
        self._inline = threading.local()
        self._inline_connections: list[Connection] = []
        self._inline_lock = threading.Lock()

    async def run(self, fn: Service[P, T], /, *a: P.args, **kw: P.kwargs) -> T:
        """Run a service in one transaction, where its policy says."""
        if fn.policy == "read":
            return await self.read(fn.fn, *a, **kw)
        if fn.policy == "scan":
            return await self.scan(fn.fn, *a, **kw)
        if fn.policy == "write":
            return await self.write(fn.fn, *a, **kw)
        return await self.write_batch(fn.fn, *a, **kw)

    def run_now(self, fn: Service[P, T], /, *a: P.args, **kw: P.kwargs) -> T:
        """Run a service in one transaction on the calling thread (a thread of its own,
        never the event loop): a read rolled back, a write committed."""
        if fn.policy in _WRITES:
            return self.write_now(fn.fn, *a, **kw)
        return self.read_now(fn.fn, *a, **kw)

    def read_now(
        self, fn: Callable[Concatenate[Connection, P], T], /, *a: P.args, **kw: P.kwargs
    ) -> T:
        with self.engine.connect() as conn:
            return fn(conn, *a, **kw)

    def write_now(
        self, fn: Callable[Concatenate[Connection, P], T], /, *a: P.args, **kw: P.kwargs
    ) -> T:
        result = self._write(lambda conn: fn(conn, *a, **kw))
        self._after_commit(result)
        return result

    async def read(
        self, fn: Callable[Concatenate[Connection, P], T], /, *a: P.args, **kw: P.kwargs
    ) -> T:
        if self._on_loop:
            conn = self._inline_connection()
            try:
                return fn(conn, *a, **kw)
            finally:
                conn.rollback()
        return await anyio.to_thread.run_sync(partial(self.read_now, fn, *a, **kw))

    async def scan(
        self, fn: Callable[Concatenate[Connection, P], T], /, *a: P.args, **kw: P.kwargs
    ) -> T:
        """A read whose cost grows with the data (a deep page, a count): in a worker
        thread on every database, so that it never stalls the other requests."""
        return await anyio.to_thread.run_sync(partial(self.read_now, fn, *a, **kw))

    async def write(
        self, fn: Callable[Concatenate[Connection, P], T], /, *a: P.args, **kw: P.kwargs
    ) -> T:
        """A small write (one user, one tier). On SQLite it runs on the event loop when
        the write lock is free at once (a write there costs less than the hop to a
        thread); if another writer holds it, it queues on the writer thread instead."""
        if self._on_loop:
            try:
                result = self._write(lambda conn: fn(conn, *a, **kw), wait=False)
            except _WriteLockBusy:
                pass
            else:
                self._after_commit(result)
                return result
        return await self.write_batch(fn, *a, **kw)

    async def write_batch(
        self, fn: Callable[Concatenate[Connection, P], T], /, *a: P.args, **kw: P.kwargs
    ) -> T:
        """A write of any size: always on the writer thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._writer, partial(self._write_on_writer, lambda conn: fn(conn, *a, **kw))
        )

    def open_connections(self) -> None:
        """Open now every connection a request or a usage flush would otherwise open
        while serving, each with all its files: the writer thread's, the event loop's
        own on SQLite (call this on the loop's thread), and the pool's idle ones."""
        self._writer.submit(self._open_writer_connection).result()
        pooled = [self.engine.connect() for _ in range(_POOL["pool_size"])]
        for conn in [self._inline_connection()] if self._on_loop else []:
            self._open_files(conn)
        for conn in pooled:
            self._open_files(conn)
            conn.close()  # back to the pool, which keeps it open

    def _open_writer_connection(self) -> None:
        conn = self._writer_connection()
        database = self.engine.url.database
        if self._on_loop and database and not Path(f"{database}-wal").exists():
            # SQLite makes the -wal file at the first write after the last connection
            # closed, and a connection opens it at its next read: write once (the
            # header's user_version, to the value it has) so that each can open it now.
            # (When the file is there, another connection holds it: no write needed.)
            with conn.begin():
                version = int(conn.exec_driver_sql("PRAGMA user_version").scalar_one())
                conn.exec_driver_sql(f"PRAGMA user_version = {version}")
        self._open_files(conn)

    def _open_files(self, conn: Connection) -> None:
        if self._on_loop:
            conn.exec_driver_sql("SELECT count(*) FROM sqlite_master").scalar()
            conn.rollback()

    def _write_on_writer(self, work: Callable[[Connection], T]) -> T:
        result = self._run_write(self._writer_connection(), work, wait=True)
        self._after_commit(result)
        return result

    def _writer_connection(self) -> Connection:
        conn = self._writer_conn
        if conn is not None and not conn.closed and not conn.invalidated and self._alive(conn):
            return conn
        if conn is not None:
            conn.close()
        self._writer_conn = self.engine.connect()
        return self._writer_conn

    def _alive(self, conn: Connection) -> bool:
        """PostgreSQL: the pool's pre-ping, for a connection that stays out of the pool
        (a restarted server must not fail the next write). A SQLite file cannot go away."""
        if self._on_loop:
            return True
        dbapi_connection = conn.connection.dbapi_connection
        try:
            return dbapi_connection is not None and self.engine.dialect.do_ping(dbapi_connection)
        except Exception:
            conn.invalidate()
            return False

    def _inline_connection(self) -> Connection:
        conn: Connection | None = getattr(self._inline, "conn", None)
        if conn is None or conn.closed or conn.invalidated:
            conn = self.engine.connect()
            self._inline.conn = conn
            with self._inline_lock:
                self._inline_connections.append(conn)
        return conn

    def _write(self, work: Callable[[Connection], T], *, wait: bool = True) -> T:
        if not wait:
            return self._run_write(self._inline_connection(), work, wait=False)
        with self.engine.connect() as conn:
            return self._run_write(conn, work, wait=True)

    def _run_write(self, conn: Connection, work: Callable[[Connection], T], *, wait: bool) -> T:
        # Read by the "begin" event only. Connection.execution_options changes the
        # connection in place, so the inline connection is set back for its next read.
        conn.execution_options(**{WRITE_OPTION: True, NO_WAIT_OPTION: not wait})
        try:
            transaction = conn.begin()
        except (OperationalError, sqlite3.OperationalError) as error:
            if not wait and _is_locked(error):
                raise _WriteLockBusy from error
            raise
        finally:
            conn.execution_options(**{WRITE_OPTION: False, NO_WAIT_OPTION: False})
        with transaction:
            return work(conn)

    def _after_commit(self, result: object) -> None:
        if isinstance(result, ConfigChange) and result.commit is not None:
            self.notify(result.commit)

    def notify(self, commit: Commit) -> None:
        for hook in list(self.on_commit):
            try:
                hook(commit)
            except Exception:  # a hook must never fail a committed write
                logger.exception("on_commit hook %r failed for version %d", hook, commit.version)

    def ping(self) -> None:
        """One round trip to the database (readiness); raises when it is unreachable."""
        with self.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    def dispose(self) -> None:
        self._writer.shutdown(wait=True)
        if self._writer_conn is not None:
            self._writer_conn.close()
            self._writer_conn = None
        with self._inline_lock:
            for conn in self._inline_connections:
                conn.close()
            self._inline_connections.clear()
        self.engine.dispose()
