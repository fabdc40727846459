from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session


def get_db(request: Request) -> Iterator[Session]:
    """One session per request. Writes commit through ``commit``; anything
    left uncommitted (an error, a read) is rolled back here."""
    session = request.app.state.session_factory()
    try:
        yield session
    finally:
        session.rollback()
        session.close()


SessionDep = Annotated[Session, Depends(get_db)]


def commit(request: Request, session: Session) -> None:
    """Commit the request's transaction, then tell listeners the new version."""
    from control_plane import services

    session.commit()
    version = services.current_version(session)
    session.commit()
    for listener in request.app.state.on_commit:
        try:
            listener(version)
        except Exception:  # a listener must never fail a committed write
            request.app.state.logger.exception("on_commit listener failed")
