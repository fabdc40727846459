"""Request-scoped dependencies: the request owns its one transaction."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Annotated

import anyio.to_thread
from fastapi import Depends, Request
from sqlalchemy.orm import Session

from control_plane.db import WRITE_OPTION
from control_plane.services import NEW_VERSION_KEY

logger = logging.getLogger("control_plane")

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


async def get_db(request: Request) -> AsyncIterator[Session]:
    """One session and one transaction per request: committed once when the route returns,
    rolled back if it raises. A write that produced a new config version then tells the
    on_commit hooks, outside the transaction.

    Writes open their transaction as writers (SQLite: BEGIN IMMEDIATE) and queue for the
    process's write lock on the event loop first. Waiting for the database lock inside
    the threadpool would deadlock: with every worker thread blocked on the lock, the
    holder could not get a thread to run its route and commit.
    """
    factory = request.app.state.session_factory
    if request.method in SAFE_METHODS:
        session = factory()
        ok = False
        try:
            yield session
            ok = True
        finally:
            await anyio.to_thread.run_sync(lambda: _finish(session, ok=ok))
        return
    async with request.app.state.write_lock:
        session = factory(execution_options={WRITE_OPTION: True})
        ok = False
        try:
            yield session
            ok = True
        finally:
            new_version = await anyio.to_thread.run_sync(lambda: _finish(session, ok=ok))
    if new_version is not None:
        _notify(request, new_version)


def _finish(session: Session, *, ok: bool) -> int | None:
    """Commit (or roll back) and close in one worker-thread hop."""
    try:
        new_version: int | None = session.info.pop(NEW_VERSION_KEY, None)
        if ok:
            session.commit()
        else:
            session.rollback()
            new_version = None
        return new_version
    finally:
        session.close()


def _notify(request: Request, version: int) -> None:
    for hook in list(request.app.state.on_commit):
        try:
            hook(version)
        except Exception:  # a hook must never fail a committed write
            logger.exception("on_commit hook %r failed for version %d", hook, version)


# scope="function": the exit code (the commit) runs when the route returns, before the
# response is sent, so a write is acknowledged only once it is committed.
SessionDep = Annotated[Session, Depends(get_db, scope="function")]
