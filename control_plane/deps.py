"""Request-scoped dependencies: the request owns its one transaction."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from control_plane.db import begin_write
from control_plane.services import NEW_VERSION_KEY

logger = logging.getLogger("control_plane")

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


async def _write_gate(request: Request) -> AsyncIterator[None]:
    """One writer at a time per process, queued on the event loop rather than in threads.

    Writers serialize on the database lock anyway. Waiting for it inside the threadpool
    would deadlock: with every worker thread blocked on the lock, the holder could not
    get a thread to run its route and commit.
    """
    if request.method in SAFE_METHODS:
        yield
        return
    async with request.app.state.write_lock:
        yield


def get_db(
    request: Request, _gate: Annotated[None, Depends(_write_gate, scope="function")]
) -> Iterator[Session]:
    """One session and one transaction per request: committed once when the route returns,
    rolled back if it raises. Writes start as writers (SQLite: BEGIN IMMEDIATE) so that
    concurrent writers queue on the lock instead of failing. A write that produced a new
    config version then tells the on_commit hooks, outside the transaction."""
    session: Session = request.app.state.session_factory()
    try:
        if request.method not in SAFE_METHODS:
            begin_write(session)
        yield session
        new_version = session.info.pop(NEW_VERSION_KEY, None)
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
    if new_version is not None:
        _notify(request, new_version)


def _notify(request: Request, version: int) -> None:
    for hook in list(request.app.state.on_commit):
        try:
            hook(version)
        except Exception:  # a hook must never fail a committed write
            logger.exception("on_commit hook %r failed for version %d", hook, version)


# scope="function": the exit code (the commit) runs when the route returns, before the
# response is sent, so a write is acknowledged only once it is committed.
SessionDep = Annotated[Session, Depends(get_db, scope="function")]
