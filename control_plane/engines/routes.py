"""Routes of engine status."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Response, status

from control_plane.auth import ReaderDep, WriterDep
from control_plane.deps import ClaimsDep, DatabaseDep, FlaggedDep, FleetDep, SettingsDep
from control_plane.engines import service
from control_plane.engines.schemas import EngineList
from control_plane.schemas import ERRORS, NOT_FOUND
from output_rate_core.ids import ENGINE_ID_PATTERN, MAX_ENGINE_ID_LEN

router = APIRouter(responses=ERRORS)

EnginePath = Annotated[
    str, Path(min_length=1, max_length=MAX_ENGINE_ID_LEN, pattern=ENGINE_ID_PATTERN)
]


@router.get("/engines", response_model=EngineList)
async def list_engines(
    db: DatabaseDep,
    settings: SettingsDep,
    fleet: FleetDep,
    claims: ClaimsDep,
    flagged: FlaggedDep,
    _: ReaderDep,
) -> EngineList:
    return await db.run(
        service.list_engines,
        timeout_s=settings.engine_timeout_s,
        retention_s=settings.engine_retention_s,
        fleet=fleet,
        claims=claims,
        flagged=flagged,
    )


@router.delete("/engines/{engine_id}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND)
async def delete_engine(engine_id: EnginePath, db: DatabaseDep, _: WriterDep) -> Response:
    await db.run(service.delete_engine, engine_id=engine_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
