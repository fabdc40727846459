"""Bearer tokens: the admin token (settings) writes; viewer tokens only read."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status

from control_plane import services
from control_plane.db import Database
from control_plane.deps import DatabaseDep


@dataclass(frozen=True)
class Principal:
    name: str
    can_write: bool


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def _authenticate(request: Request, db: Database) -> Principal:
    if request.app.state.insecure_no_auth:
        return Principal("anonymous-admin", can_write=True)
    token = _bearer(request)
    if token is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing bearer token (Authorization header)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    admin = request.app.state.settings.admin_token
    if admin is not None and hmac.compare_digest(token.encode(), admin.get_secret_value().encode()):
        return Principal("admin", can_write=True)
    # Only viewer tokens touch the database.
    viewer = await db.read(services.viewer_token_name, token=token)
    if viewer is not None:
        return Principal(f"viewer:{viewer}", can_write=False)
    raise HTTPException(
        status.HTTP_401_UNAUTHORIZED, "invalid token", headers={"WWW-Authenticate": "Bearer"}
    )


async def reader(request: Request, db: DatabaseDep) -> Principal:
    return await _authenticate(request, db)


async def writer(request: Request, db: DatabaseDep) -> Principal:
    principal = await _authenticate(request, db)
    if not principal.can_write:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "viewer tokens may only read")
    return principal


ReaderDep = Annotated[Principal, Depends(reader)]
WriterDep = Annotated[Principal, Depends(writer)]
