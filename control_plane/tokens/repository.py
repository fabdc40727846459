"""Viewer token queries; only a token's SHA-256 is stored."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Row, insert, select, update

from control_plane.models import ViewerToken, table

viewer_tokens = table(ViewerToken)


def insert_viewer_token(conn: Connection, *, name: str, token_hash: str) -> int:
    row = conn.execute(
        insert(viewer_tokens)
        .values(name=name, token_hash=token_hash, created_at=datetime.now(UTC))
        .returning(viewer_tokens.c.id)
    ).one()
    return int(row[0])


def get_viewer_token(conn: Connection, token_id: int) -> Row[Any] | None:
    return conn.execute(select(viewer_tokens).where(viewer_tokens.c.id == token_id)).one_or_none()


def revoke_viewer_token(conn: Connection, token_id: int) -> None:
    conn.execute(
        update(viewer_tokens)
        .where(viewer_tokens.c.id == token_id)
        .values(revoked_at=datetime.now(UTC))
    )


def list_viewer_tokens(conn: Connection) -> Sequence[Row[Any]]:
    return conn.execute(select(viewer_tokens).order_by(viewer_tokens.c.id)).all()
