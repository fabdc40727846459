"""Bearer tokens: the admin token (settings) writes; viewer tokens only read.

A viewer token is found by its SHA-256, the only form stored (control_plane/tokens/
creates, lists and revokes them).

`authenticate` is the one check. The edge guard (control_plane/edge.py) runs it before a
request body is read and leaves the principal in the request state; the route
dependencies below reuse it, or run it for requests without a body.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from sqlalchemy import Connection, bindparam, select

from control_plane.db import service
from control_plane.deps import AppState, app_state
from control_plane.models import ViewerToken, table

# Where the edge guard leaves the principal (scope["state"], i.e. request.state).
PRINCIPAL_KEY = "output_rate_principal"
viewer_tokens = table(ViewerToken)
_FIND_VIEWER = select(viewer_tokens.c.name).where(
    viewer_tokens.c.token_hash == bindparam("token_hash"), viewer_tokens.c.revoked_at.is_(None)
)


@dataclass(frozen=True)
class Principal:
    name: str
    can_write: bool


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@service("read")
def viewer_token_name(conn: Connection, *, token: str) -> str | None:
    """The name of the live viewer token `token`, or None."""
    name: str | None = conn.execute(_FIND_VIEWER, {"token_hash": hash_token(token)}).scalar()
    return name


def _bearer(authorization: str) -> str | None:
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def authenticate(state: AppState, authorization: str) -> Principal:
    """The principal of an Authorization header value; HTTPException 401 if none."""
    if state.insecure_no_auth:
        return Principal("anonymous-admin", can_write=True)
    token = _bearer(authorization)
    if token is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing bearer token (Authorization header)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    admin = state.settings.admin_token
    if admin is not None and hmac.compare_digest(token.encode(), admin.get_secret_value().encode()):
        return Principal("admin", can_write=True)
    # Only viewer tokens touch the database.
    viewer = await state.db.run(viewer_token_name, token=token)
    if viewer is not None:
        return Principal(f"viewer:{viewer}", can_write=False)
    raise HTTPException(
        status.HTTP_401_UNAUTHORIZED, "invalid token", headers={"WWW-Authenticate": "Bearer"}
    )


def check_can_write(principal: Principal) -> Principal:
    if not principal.can_write:
        raise HTTPException(status.HTTP_403_FORBIDDEN, "viewer tokens may only read")
    return principal


async def _principal(request: Request) -> Principal:
    known: Principal | None = getattr(request.state, PRINCIPAL_KEY, None)
    if known is not None:
        return known
    return await authenticate(app_state(request.app), request.headers.get("authorization", ""))


async def reader(request: Request) -> Principal:
    return await _principal(request)


async def writer(request: Request) -> Principal:
    return check_can_write(await _principal(request))


ReaderDep = Annotated[Principal, Depends(reader)]
WriterDep = Annotated[Principal, Depends(writer)]
