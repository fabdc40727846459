"""Engine status queries: the rows the push server writes and GET /engines reads."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, bindparam, delete, func, insert, select, update

from control_plane.models import Engine, table

engines = table(Engine)


def list_engines(conn: Connection) -> Sequence[Row[Any]]:
    return conn.execute(select(engines).order_by(engines.c.engine_id)).all()


def engine_ids(conn: Connection, ids: Sequence[str]) -> set[str]:
    query = select(engines.c.engine_id).where(engines.c.engine_id.in_(ids))
    return set(conn.execute(query).scalars())


def applied_engine_ids(conn: Connection) -> set[str]:
    """Engines that applied a version (an engine core, or an API server)."""
    query = select(engines.c.engine_id).where(
        (engines.c.applied_version > 0) | engines.c.api_applied_version.is_not(None)
    )
    return set(conn.execute(query).scalars())


def delete_never_applied_before(conn: Connection, cutoff: datetime) -> int:
    """Rows of engines that never applied a version, seen last before ``cutoff``."""
    result = conn.execute(
        delete(engines).where(
            engines.c.last_seen < cutoff,
            engines.c.applied_version == 0,
            engines.c.api_applied_version.is_(None),
            engines.c.connected.is_(False),
        )
    )
    return int(result.rowcount or 0)


def insert_engines(conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    if rows:
        conn.execute(insert(engines), list(rows))


def update_engines(conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """rows: engine_id, model, applied_version, last_seen (all mark it connected)."""
    if not rows:
        return
    statement = (
        update(engines)
        .where(engines.c.engine_id == bindparam("id"))
        .values(
            # A peer known only from a heartbeat has no model: keep the one we had.
            model=func.coalesce(func.nullif(bindparam("new_model"), ""), engines.c.model),
            applied_version=bindparam("new_applied_version"),
            connected=True,
            last_seen=bindparam("new_last_seen"),
        )
    )
    conn.execute(
        statement,
        [
            {
                "id": r["engine_id"],
                "new_model": r["model"],
                "new_applied_version": r["applied_version"],
                "new_last_seen": r["last_seen"],
            }
            for r in rows
        ],
    )


def update_api_versions(
    conn: Connection, versions: Sequence[tuple[str, int]], *, last_seen: datetime
) -> None:
    """(engine id, version its API server applied), on existing rows."""
    if not versions:
        return
    statement = (
        update(engines)
        .where(engines.c.engine_id == bindparam("id"))
        .values(api_applied_version=bindparam("new_api_version"), last_seen=last_seen)
    )
    conn.execute(statement, [{"id": i, "new_api_version": v} for i, v in versions])


def clear_api_versions(conn: Connection, ids: Sequence[str] | None = None) -> None:
    """These engines (all of them for None) have no API server connected."""
    statement = update(engines).values(api_applied_version=None)
    if ids is not None:
        statement = statement.where(engines.c.engine_id.in_(ids))
    conn.execute(statement)


def set_engines_disconnected(conn: Connection, ids: Sequence[str] | None = None) -> None:
    """Mark the given engines (all of them for None) disconnected."""
    statement = update(engines).values(connected=False)
    if ids is not None:
        statement = statement.where(engines.c.engine_id.in_(ids))
    conn.execute(statement)


def delete_engines_seen_before(conn: Connection, cutoff: datetime) -> int:
    result = conn.execute(delete(engines).where(engines.c.last_seen < cutoff))
    return int(result.rowcount or 0)


def delete_engine(conn: Connection, engine_id: str) -> bool:
    result = conn.execute(delete(engines).where(engines.c.engine_id == engine_id))
    return bool(result.rowcount)
