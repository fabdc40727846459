"""API key queries. Only a key's SHA-256 is stored; revoking deletes its row."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import Connection, bindparam, delete, func, insert, or_, select, update

from control_plane.models import ApiKey, table

api_keys = table(ApiKey)


class KeyRow(NamedTuple):
    id: str
    user: str
    key_hash: str
    created_at: datetime
    last_used_at: datetime | None


_COLUMNS = (
    api_keys.c.id,
    api_keys.c.user,
    api_keys.c.key_hash,
    api_keys.c.created_at,
    api_keys.c.last_used_at,
)
_GET_KEY = select(*_COLUMNS).where(api_keys.c.id == bindparam("key_id"))
_COUNT_USER_KEYS = (
    select(func.count()).select_from(api_keys).where(api_keys.c.user == bindparam("user"))
)
# Moves last_used_at forward only (reports may arrive out of order), on existing rows only.
_TOUCH = (
    update(api_keys)
    .where(
        api_keys.c.id == bindparam("key_id"),
        or_(api_keys.c.last_used_at.is_(None), api_keys.c.last_used_at < bindparam("used_at")),
    )
    .values(last_used_at=bindparam("used_at"))
)


def get_key(conn: Connection, key_id: str) -> KeyRow | None:
    row = conn.execute(_GET_KEY, {"key_id": key_id}).one_or_none()
    return None if row is None else KeyRow(*row)


def count_user_keys(conn: Connection, user: str) -> int:
    return int(conn.execute(_COUNT_USER_KEYS, {"user": user}).scalar() or 0)


def list_user_keys(conn: Connection, user: str) -> list[KeyRow]:
    query = (
        select(*_COLUMNS)
        .where(api_keys.c.user == user)
        .order_by(api_keys.c.created_at, api_keys.c.id)
    )
    return [KeyRow(*row) for row in conn.execute(query)]


def insert_key(
    conn: Connection, *, key_id: str, user: str, key_hash: str, created_at: datetime
) -> None:
    conn.execute(
        insert(api_keys).values(
            id=key_id, user=user, key_hash=key_hash, created_at=created_at, last_used_at=None
        )
    )


def delete_key(conn: Connection, key_id: str) -> None:
    conn.execute(delete(api_keys).where(api_keys.c.id == key_id))


def all_keys(conn: Connection) -> dict[str, tuple[str, str]]:
    """key id -> (user, hash)"""
    rows = conn.execute(select(api_keys.c.id, api_keys.c.user, api_keys.c.key_hash))
    return {key_id: (user, key_hash) for key_id, user, key_hash in rows}


def touch_keys(conn: Connection, used: Sequence[tuple[str, datetime]]) -> None:
    """Set last_used_at of the (key id, time) pairs whose key exists and whose time is
    newer (an unknown id changes nothing: no row is ever made here)."""
    if used:
        params: list[dict[str, Any]] = [{"key_id": k, "used_at": at} for k, at in used]
        conn.execute(_TOUCH, params)
