"""Engine status queries: the rows the push server writes and GET /engines reads."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, String, bindparam, delete, func, insert, select, update

from control_plane.models import Engine, table
from output_rate_core import protocol as p

engines = table(Engine)
# role -> the columns naming its home replica and when that home last heard it
HOME_COLUMNS = {
    p.ENGINE_ROLE: ("home_replica", "home_seen_at"),
    p.API_ROLE: ("api_home_replica", "api_home_seen_at"),
}


def list_engines(conn: Connection) -> Sequence[Row[Any]]:
    return conn.execute(select(engines).order_by(engines.c.engine_id)).all()


def engine_ids(conn: Connection, ids: Sequence[str]) -> set[str]:
    query = select(engines.c.engine_id).where(engines.c.engine_id.in_(ids))
    return set(conn.execute(query).scalars())


def homes_of(conn: Connection, ids: Sequence[str]) -> dict[str, tuple[str | None, str | None]]:
    """engine id -> the home replicas of its core and of its API server, for the rows that
    exist (locked until the end of the transaction, so a claim by another replica waits
    or is seen)."""
    query = (
        select(engines.c.engine_id, engines.c.home_replica, engines.c.api_home_replica)
        .where(engines.c.engine_id.in_(ids))
        .order_by(engines.c.engine_id)
        .with_for_update()
    )
    return {row.engine_id: (row.home_replica, row.api_home_replica) for row in conn.execute(query)}


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


def home_of(conn: Connection, engine_id: str, role: p.Role = p.ENGINE_ROLE) -> Any:
    """(home replica, when it last heard it) of the engine's core or API server (the row
    locked until the end of the transaction)."""
    replica, seen_at = HOME_COLUMNS[role]
    query = (
        select(engines.c[replica], engines.c[seen_at])
        .where(engines.c.engine_id == engine_id)
        .with_for_update()
    )
    return conn.execute(query).one_or_none()


def set_home(
    conn: Connection,
    engine_id: str,
    replica: str,
    seen_at: datetime,
    role: p.Role = p.ENGINE_ROLE,
) -> None:
    replica_column, seen_column = HOME_COLUMNS[role]
    conn.execute(
        update(engines)
        .where(engines.c.engine_id == engine_id)
        .values({replica_column: replica, seen_column: seen_at})
    )


def count_homed_since(conn: Connection, cutoff: datetime) -> int:
    """Engine cores connected to some replica that heard them after ``cutoff``."""
    query = select(func.count()).where(engines.c.connected, engines.c.home_seen_at >= cutoff)
    return int(conn.execute(query).scalar_one())


def ids_seen_since(conn: Connection, cutoff: datetime) -> list[str]:
    """Engine cores heard after ``cutoff``, connected or not."""
    query = select(engines.c.engine_id).where(
        engines.c.last_seen >= cutoff, engines.c.applied_version > 0
    )
    return list(conn.execute(query).scalars())


def ids_homed_since(conn: Connection, cutoff: datetime) -> list[str]:
    query = select(engines.c.engine_id).where(engines.c.connected, engines.c.home_seen_at >= cutoff)
    return list(conn.execute(query).scalars())


def update_engines(
    conn: Connection,
    rows: Sequence[dict[str, Any]],
    *,
    home: str | None = None,
    home_seen_at: datetime | None = None,
) -> None:
    """rows: engine_id, model, vllm_version, applied_version, last_seen (all mark it
    connected; with ``home``, homed at that replica as of ``home_seen_at``)."""
    if not rows:
        return
    homed = {} if home is None else {"home_replica": home, "home_seen_at": home_seen_at}
    statement = (
        update(engines)
        .where(engines.c.engine_id == bindparam("id"))
        .values(
            # A peer known only from a heartbeat has no model: keep the one we had.
            model=func.coalesce(func.nullif(bindparam("new_model"), ""), engines.c.model),
            # None: not said on this connection (bound by a heartbeat after a restart),
            # keep the one we had; "": said it is not known.
            vllm_version=func.nullif(
                func.coalesce(bindparam("new_vllm_version", type_=String), engines.c.vllm_version),
                "",
            ),
            applied_version=bindparam("new_applied_version"),
            connected=True,
            last_seen=bindparam("new_last_seen"),
            **homed,
        )
    )
    conn.execute(
        statement,
        [
            {
                "id": r["engine_id"],
                "new_model": r["model"],
                "new_vllm_version": r["vllm_version"],
                "new_applied_version": r["applied_version"],
                "new_last_seen": r["last_seen"],
            }
            for r in rows
        ],
    )


def update_api_versions(
    conn: Connection,
    versions: Sequence[tuple[str, int]],
    *,
    last_seen: datetime,
    home: str | None = None,
    home_seen_at: datetime | None = None,
) -> None:
    """(engine id, version its API server applied), on existing rows (with ``home``,
    the API servers homed at that replica as of ``home_seen_at``)."""
    if not versions:
        return
    homed = {} if home is None else {"api_home_replica": home, "api_home_seen_at": home_seen_at}
    statement = (
        update(engines)
        .where(engines.c.engine_id == bindparam("id"))
        .values(api_applied_version=bindparam("new_api_version"), last_seen=last_seen, **homed)
    )
    conn.execute(statement, [{"id": i, "new_api_version": v} for i, v in versions])


def clear_api_versions(
    conn: Connection, ids: Sequence[str] | None = None, *, home: str | None = None
) -> None:
    """These engines (all of them for None) have no API server connected, let go by its
    home; with ``home``, only those whose API server is homed at that replica (or
    nowhere)."""
    statement = update(engines).values(api_applied_version=None, api_home_seen_at=None)
    if ids is not None:
        statement = statement.where(engines.c.engine_id.in_(ids))
    if home is not None:
        statement = statement.where(
            (engines.c.api_home_replica == home) | engines.c.api_home_replica.is_(None)
        )
    conn.execute(statement)


def set_engines_disconnected(
    conn: Connection, ids: Sequence[str] | None = None, *, home: str | None = None
) -> None:
    """Mark the given engines (all of them for None) disconnected, let go by their home
    (another replica may bind them at once); with ``home``, only those homed at that
    replica (or nowhere)."""
    statement = update(engines).values(connected=False, home_seen_at=None)
    if ids is not None:
        statement = statement.where(engines.c.engine_id.in_(ids))
    if home is not None:
        statement = statement.where(
            (engines.c.home_replica == home) | engines.c.home_replica.is_(None)
        )
    conn.execute(statement)


def delete_engines_seen_before(conn: Connection, cutoff: datetime) -> int:
    result = conn.execute(delete(engines).where(engines.c.last_seen < cutoff))
    return int(result.rowcount or 0)


def delete_engine(conn: Connection, engine_id: str) -> bool:
    result = conn.execute(delete(engines).where(engines.c.engine_id == engine_id))
    return bool(result.rowcount)
