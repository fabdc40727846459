"""Viewer tokens: created, listed and revoked by the admin; looked up by `auth`, which
also says how one is stored (`hash_token`)."""

from __future__ import annotations

import secrets

from sqlalchemy import Connection

from control_plane.audit import service as audit
from control_plane.audit.targets import token_target
from control_plane.auth import hash_token
from control_plane.config import service as config
from control_plane.db import service
from control_plane.errors import NotFound
from control_plane.tokens import repository as repo
from control_plane.tokens.schemas import TokenCreated, TokenList, TokenOut


def _audit_token(conn: Connection, *, actor: str, action: str, token_id: int, name: str) -> None:
    """Tokens are not limit configuration: audited, but the version does not move."""
    before = None if action == "create_token" else {"name": name, "revoked": False}
    after = {"name": name, "revoked": action == "revoke_token"}
    entry = audit.Entry(actor, action, token_target(token_id), before, after)
    audit.record(conn, version=config.current_version(conn), entry=entry)


@service("write")
def create_viewer_token(conn: Connection, *, actor: str, name: str) -> TokenCreated:
    token = "orv_" + secrets.token_urlsafe(32)
    token_id = repo.insert_viewer_token(conn, name=name, token_hash=hash_token(token))
    _audit_token(conn, actor=actor, action="create_token", token_id=token_id, name=name)
    return TokenCreated(id=token_id, name=name, token=token)


@service("read")
def list_viewer_tokens(conn: Connection) -> TokenList:
    return TokenList(
        items=[
            TokenOut(
                id=t.id, name=t.name, created_at=t.created_at, revoked=t.revoked_at is not None
            )
            for t in repo.list_viewer_tokens(conn)
        ]
    )


@service("write")
def revoke_viewer_token(conn: Connection, *, actor: str, token_id: int) -> None:
    """Idempotent: revoking a revoked token changes nothing."""
    row = repo.get_viewer_token(conn, token_id)
    if row is None:
        raise NotFound(f"token {token_id} does not exist", field="token_id")
    if row.revoked_at is None:
        repo.revoke_viewer_token(conn, token_id)
        _audit_token(conn, actor=actor, action="revoke_token", token_id=token_id, name=row.name)
