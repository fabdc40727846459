"""Routes of live usage and usage history."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query

from control_plane.auth import ReaderDep
from control_plane.deps import DatabaseDep, SettingsDep, UsageSourceDep
from control_plane.schemas import ERRORS
from control_plane.usage import service
from control_plane.usage.schemas import UsageHistoryOut, UsageList
from output_rate_core.ids import USER_ID_PATTERN

router = APIRouter(responses=ERRORS)


@router.get("/usage", response_model=UsageList)
async def usage(db: DatabaseDep, source: UsageSourceDep, _: ReaderDep) -> UsageList:
    return await db.run(service.live_usage, source=source)


@router.get("/usage/history", response_model=UsageHistoryOut)
async def usage_history(
    db: DatabaseDep,
    settings: SettingsDep,
    _: ReaderDep,
    user: Annotated[
        str | None, Query(min_length=1, max_length=256, pattern=USER_ID_PATTERN)
    ] = None,
    since: Annotated[datetime | None, Query(description="ISO 8601; default: one hour ago")] = None,
    step: Annotated[
        int, Query(ge=60, le=86_400, description="Seconds per bucket, whole minutes")
    ] = 60,
    top: Annotated[int, Query(ge=1, le=100, description="Without user: this many users")] = 10,
    order: Annotated[Literal["throttled", "tokens"], Query()] = "throttled",
) -> UsageHistoryOut:
    return await db.run(
        service.usage_history,
        now=time.time(),
        since=since,
        step=step,
        user=user,
        top=top,
        order=order,
        retention_days=settings.usage_retention_days,
    )
