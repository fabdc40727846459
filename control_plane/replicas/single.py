"""SQLite is one replica: a second `output-rate serve` on the same SQLite file is refused
at start (it would push only its own writes at once, keep its own engines' usage, and run
a second fleet allocator). The first holds an exclusive lock on ``<database>.serve.lock``
for its lifetime; the kernel drops it when the process ends, kill -9 included."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from sqlalchemy.engine import make_url


class AnotherReplica(RuntimeError):
    """Another `output-rate serve` already serves this SQLite database."""


def sqlite_path(database_url: str) -> Path | None:
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database).resolve()


def hold_sqlite_lock(database_url: str) -> IO[str] | None:
    """Take the lock (None on PostgreSQL or an in-memory database); keep the handle open."""
    path = sqlite_path(database_url)
    if path is None:
        return None
    lock_path = path.with_name(path.name + ".serve.lock")
    handle = lock_path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise AnotherReplica(
            f"another output-rate serve (pid {holder}) already serves the SQLite database "
            f"{path}; SQLite is single-replica: run replicas on PostgreSQL "
            "(OUTPUT_RATE_DATABASE_URL=postgresql+psycopg://...), see docs/replicas.md"
        ) from None
    handle.truncate(0)
    handle.write(str(os.getpid()))
    handle.flush()
    return handle
