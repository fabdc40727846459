"""Engine status: written by the push server, read by GET /engines and /metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection

from control_plane.db import service
from control_plane.engines import repository as repo
from control_plane.engines.schemas import EngineList, EngineOut
from control_plane.errors import NotFound
from control_plane.fleet.view import FleetView, NoFleet
from control_plane.limits import service as limits

# What /metrics lists engines with: it shows no shares.
NO_FLEET = NoFleet()


@dataclass(frozen=True)
class EngineSeen:
    """An engine the push endpoint heard from."""

    engine_id: str
    model: str
    applied_version: int
    first_seen: datetime


@service("read")
def list_engines(
    conn: Connection,
    *,
    timeout_s: float,
    retention_s: float = float("inf"),
    fleet: FleetView = NO_FLEET,
) -> EngineList:
    """Engines seen within `retention_s` (older rows are deleted by the push server), with
    the shares `fleet` has them hold."""
    now = datetime.now(UTC)
    items = [
        EngineOut(
            engine_id=e.engine_id,
            model=e.model,
            applied_version=e.applied_version,
            connected=e.connected and (now - e.last_seen).total_seconds() <= timeout_s,
            last_seen=e.last_seen,
            first_seen=e.first_seen,
            num_shared_users=fleet.num_shared_users(e.engine_id),
        )
        for e in repo.list_engines(conn)
        if (now - e.last_seen).total_seconds() <= retention_s
    ]
    return EngineList(version=limits.current_version(conn), items=items)


@service("write")
def forget_engines(conn: Connection, *, retention_s: float) -> int:
    """Delete the rows of engines not seen for `retention_s`; how many went."""
    return repo.delete_engines_seen_before(conn, datetime.now(UTC) - timedelta(seconds=retention_s))


@service("write")
def delete_engine(conn: Connection, *, engine_id: str) -> None:
    """Forget an engine's row (it comes back if that engine is still connected)."""
    if not repo.delete_engine(conn, engine_id):
        raise NotFound(f"engine {engine_id!r} is not known", field="engine_id")


@service("write")
def record_engines(conn: Connection, *, seen: Sequence[EngineSeen]) -> None:
    """Engines that are connected now, as last seen (one row per engine_id)."""
    now = datetime.now(UTC)
    known = repo.engine_ids(conn, [e.engine_id for e in seen])
    rows = [
        {
            "engine_id": e.engine_id,
            "model": e.model,
            "applied_version": e.applied_version,
            "connected": True,
            "first_seen": e.first_seen,
            "last_seen": now,
        }
        for e in seen
    ]
    repo.insert_engines(conn, [r for r in rows if r["engine_id"] not in known])
    repo.update_engines(conn, [r for r in rows if r["engine_id"] in known])


@service("write")
def disconnect_engines(conn: Connection, *, engine_ids: Sequence[str] | None) -> None:
    """Mark these engines (None: every engine) disconnected."""
    repo.set_engines_disconnected(conn, engine_ids)
