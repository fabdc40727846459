"""Engine status: written by the push server, read by GET /engines and /metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection

from control_plane.config import service as config
from control_plane.db import service
from control_plane.deps import FlaggedDemandsView, FleetView, RefusedClaimsView
from control_plane.engines import repository as repo
from control_plane.engines.schemas import EngineList, EngineOut
from control_plane.errors import NotFound
from control_plane.fencing import LEADER, check_fence, database_now
from control_plane.fleet.view import NoFleet
from control_plane.push.claims import RefusedClaim, RefusedClaims
from control_plane.push.flagged import Flagged, FlaggedDemands
from output_rate_core import protocol as p

# What /metrics lists engines with: it shows no shares, no refused claims, no flags.
NO_FLEET = NoFleet()
NO_CLAIMS = RefusedClaims()
NO_FLAGS = FlaggedDemands()


@dataclass(frozen=True)
class EngineSeen:
    """An engine core, or an engine's API server, the push endpoint heard from."""

    engine_id: str
    model: str
    applied_version: int
    first_seen: datetime
    role: p.Role = p.ENGINE_ROLE
    # The vLLM it said it runs ("": not known); None: it did not say on this connection
    # (bound by a heartbeat after a restart): the row keeps what it had.
    vllm_version: str | None = None


# A row of an engine that never applied a version (it connected and never acknowledged
# its snapshot) goes this long after it was last seen, not after the full retention.
NEVER_APPLIED_RETENTION_S = 60.0


@service("read")
def list_engines(
    conn: Connection,
    *,
    timeout_s: float,
    retention_s: float = float("inf"),
    fleet: FleetView = NO_FLEET,
    claims: RefusedClaimsView = NO_CLAIMS,
    flagged: FlaggedDemandsView = NO_FLAGS,
) -> EngineList:
    """Engines seen within `retention_s` (older rows are deleted by the push server), with
    the shares `fleet` has them hold and the claims of their ids this replica refused."""
    now = datetime.now(UTC)
    items = [
        EngineOut(
            engine_id=e.engine_id,
            model=e.model,
            vllm_version=e.vllm_version,
            applied_version=e.applied_version,
            connected=e.connected and (now - e.last_seen).total_seconds() <= timeout_s,
            last_seen=e.last_seen,
            first_seen=e.first_seen,
            num_shared_users=fleet.num_shared_users(e.engine_id),
            # A row nobody refreshed (the push server is gone) shows no API server.
            api_applied_version=e.api_applied_version
            if (now - e.last_seen).total_seconds() <= timeout_s
            else None,
            # A home that let the engine go (or no longer heard it) holds it no more.
            home=e.home_replica
            if e.home_seen_at is not None and (now - e.last_seen).total_seconds() <= timeout_s
            else None,
            **_refused_claims(claims.of(e.engine_id)),
            **_flagged_demand(flagged.of(e.engine_id)),
        )
        for e in repo.list_engines(conn)
        if (now - e.last_seen).total_seconds() <= retention_s
    ]
    return EngineList(version=config.current_version(conn), items=items)


def _refused_claims(refused: RefusedClaim | None) -> dict[str, Any]:
    """The fields of an engine's row that show the claims of its id refused here."""
    if refused is None:
        return {"refused_claims": 0, "last_refused_claim_at": None, "last_refused_claim_from": None}
    return {
        "refused_claims": refused.num_refused,
        "last_refused_claim_at": refused.last_at,
        "last_refused_claim_from": refused.last_from,
    }


def _flagged_demand(flagged: Flagged | None) -> dict[str, Any]:
    """The fields of an engine's row that show its demand flagged implausible here."""
    if flagged is None:
        return {
            "implausible_demands": 0,
            "last_implausible_demand_at": None,
            "last_implausible_demand": None,
        }
    return {
        "implausible_demands": flagged.num_flagged,
        "last_implausible_demand_at": flagged.last_at,
        "last_implausible_demand": flagged.last_reason,
    }


@service("write")
def forget_engines(
    conn: Connection,
    *,
    retention_s: float,
    never_applied_s: float = NEVER_APPLIED_RETENTION_S,
    fence: int | None = None,
) -> int:
    """Delete the rows of engines not seen for `retention_s`, and of those that never
    applied a version not seen for `never_applied_s`; how many went. ``fence``: the
    leader's token (replicas), refused unless it still holds the lease."""
    if fence is not None:
        check_fence(conn, name=LEADER, token=fence)
    now = datetime.now(UTC)
    num = repo.delete_engines_seen_before(conn, now - timedelta(seconds=retention_s))
    return num + repo.delete_never_applied_before(conn, now - timedelta(seconds=never_applied_s))


@service("read")
def applied_engine_ids(conn: Connection) -> set[str]:
    return repo.applied_engine_ids(conn)


@service("write")
def delete_engine(conn: Connection, *, engine_id: str) -> None:
    """Forget an engine's row (it comes back if that engine is still connected)."""
    if not repo.delete_engine(conn, engine_id):
        raise NotFound(f"engine {engine_id!r} is not known", field="engine_id")


@service("write")
def claim_engine(
    conn: Connection,
    *,
    engine_id: str,
    replica: str,
    timeout_s: float,
    role: p.Role = p.ENGINE_ROLE,
) -> bool:
    """Bind an engine core, or an engine's API server (``role``), to this replica
    fleet-wide: False when another replica holds it (its home heard it within
    ``timeout_s``, database time, and has not let it go). An id with no row yet is free:
    its row is written once the engine proves itself (a replica that finds it written by
    another then lets go: record_engines)."""
    row = repo.home_of(conn, engine_id, role)
    if row is None:
        return True
    home, seen_at = row
    now = database_now(conn)
    held_elsewhere = (
        home not in (None, replica)
        and seen_at is not None
        and (now - seen_at).total_seconds() <= timeout_s
    )
    if held_elsewhere:
        return False
    repo.set_home(conn, engine_id, replica, now, role)
    return True


@service("read")
def count_live_engines(conn: Connection, *, timeout_s: float) -> int:
    """Engine cores connected to any replica (the fleet's size, as the database knows)."""
    return repo.count_homed_since(conn, database_now(conn) - timedelta(seconds=timeout_s))


@service("read")
def live_engine_ids(conn: Connection, *, within_s: float) -> list[str]:
    """Engine cores connected to any replica that heard them within ``within_s``."""
    return repo.ids_homed_since(conn, database_now(conn) - timedelta(seconds=within_s))


@service("read")
def recent_engine_ids(conn: Connection, *, within_s: float) -> list[str]:
    """Engine cores heard within ``within_s``, connected or not: the engines a fleet that
    drops a silent engine after ``within_s`` may still count."""
    return repo.ids_seen_since(conn, datetime.now(UTC) - timedelta(seconds=within_s))


@service("write")
def record_engines(
    conn: Connection, *, seen: Sequence[EngineSeen], replica: str | None = None
) -> set[tuple[str, p.Role]]:
    """Engine cores and API servers that are connected now, as last seen: one row per
    engine_id. The core owns the row's model, vLLM version, applied version and
    connected flag; its API server only its api_applied_version (and keeps the row from
    expiring). With ``replica``, both are homed at that replica, heard now; returns the
    (engine id, role) homed at another replica (it claimed them since: not written)."""
    now = datetime.now(UTC)
    # engine id -> role -> what was seen of it
    by_id: dict[str, dict[p.Role, EngineSeen]] = {}
    for e in seen:
        by_id.setdefault(e.engine_id, {})[e.role] = e
    moved: set[tuple[str, p.Role]] = set()
    if replica is None:
        known = repo.engine_ids(conn, list(by_id))
    else:
        homes = repo.homes_of(conn, list(by_id))
        known = set(homes)
        for engine_id, (core_home, api_home) in homes.items():
            roles_seen = by_id[engine_id]
            if core_home not in (None, replica) and p.ENGINE_ROLE in roles_seen:
                moved.add((engine_id, p.ENGINE_ROLE))
            if api_home not in (None, replica) and p.API_ROLE in roles_seen:
                moved.add((engine_id, p.API_ROLE))
    new_rows, core_rows, api_rows = [], [], []
    for engine_id, roles in by_id.items():
        core, api = roles.get(p.ENGINE_ROLE), roles.get(p.API_ROLE)
        if (engine_id, p.ENGINE_ROLE) in moved:
            core = None
        if (engine_id, p.API_ROLE) in moved:
            api = None
        if core is None and api is None:
            continue
        if engine_id not in known:
            first = core or api
            assert first is not None
            new_rows.append(
                {
                    "engine_id": engine_id,
                    "model": core.model if core else "",
                    "vllm_version": (core.vllm_version or None) if core else None,
                    "applied_version": core.applied_version if core else 0,
                    "connected": core is not None,
                    "api_applied_version": api.applied_version if api else None,
                    "first_seen": first.first_seen,
                    "last_seen": now,
                }
            )
            continue
        if core is not None:
            core_rows.append(
                {
                    "engine_id": engine_id,
                    "model": core.model,
                    "vllm_version": core.vllm_version,
                    "applied_version": core.applied_version,
                    "last_seen": now,
                }
            )
        if api is not None:
            api_rows.append((engine_id, api.applied_version))
    if replica is not None:
        home_seen_at = database_now(conn)
        for row in new_rows:
            homed = bool(row["connected"])
            api_homed = row["api_applied_version"] is not None
            row.update(
                home_replica=replica if homed else None,
                home_seen_at=home_seen_at if homed else None,
                api_home_replica=replica if api_homed else None,
                api_home_seen_at=home_seen_at if api_homed else None,
            )
    else:
        home_seen_at = None
    repo.insert_engines(conn, new_rows)
    repo.update_engines(conn, core_rows, home=replica, home_seen_at=home_seen_at)
    repo.update_api_versions(conn, api_rows, last_seen=now, home=replica, home_seen_at=home_seen_at)
    return moved


@service("write")
def disconnect_engines(
    conn: Connection,
    *,
    engine_ids: Sequence[str] | None,
    role: p.Role = p.ENGINE_ROLE,
    replica: str | None = None,
) -> None:
    """Mark these engines' cores disconnected, or (role api) clear their API servers'
    applied version; None: every engine. With ``replica``, only those homed there (an
    engine, or API server, that moved to another replica stays connected)."""
    if role == p.API_ROLE:
        repo.clear_api_versions(conn, engine_ids, home=replica)
    else:
        repo.set_engines_disconnected(conn, engine_ids, home=replica)
