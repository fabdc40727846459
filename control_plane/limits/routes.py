"""Routes of users' limits, tiers and the default limit. Thin: parse, run one service."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Response, status

from control_plane.auth import ReaderDep, WriterDep
from control_plane.deps import DatabaseDep, FleetDep, UsageSourceDep
from control_plane.limits import service
from control_plane.limits.schemas import (
    BulkIn,
    BulkOut,
    DefaultIn,
    DefaultOut,
    LimitDetail,
    LimitIn,
    LimitOut,
    LimitPage,
    LimitPatch,
    TierIn,
    TierList,
    TierOut,
    TierPatch,
)
from control_plane.schemas import CONFLICT, ERRORS, NOT_FOUND, UserPath, merge_patch_body
from output_rate_core.ids import MAX_USER_ID_LEN, TIER_NAME_PATTERN, USER_ID_PATTERN

router = APIRouter(responses=ERRORS)

TierPath = Annotated[str, Path(pattern=TIER_NAME_PATTERN)]


@router.get("/limits", response_model=LimitPage)
async def list_limits(
    db: DatabaseDep,
    _: ReaderDep,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    tier: Annotated[str | None, Query(pattern=TIER_NAME_PATTERN)] = None,
    q: Annotated[str | None, Query(max_length=MAX_USER_ID_LEN, pattern=USER_ID_PATTERN)] = None,
    after: Annotated[
        str | None,
        Query(
            max_length=256,
            pattern=USER_ID_PATTERN,
            description="Cursor: only users after this id (the last id of the previous "
            "page). Fast at any depth, unlike a large offset.",
        ),
    ] = None,
    contains: Annotated[
        str | None,
        Query(
            max_length=256,
            pattern=USER_ID_PATTERN,
            description="Substring of the user id (any case)",
        ),
    ] = None,
    sort: Annotated[
        Literal["user", "-user", "tier", "-tier", "override", "-override"],
        Query(description="Order; '-' descending; no tier / no override last"),
    ] = "user",
) -> LimitPage:
    return await db.run(
        service.list_limits,
        offset=offset,
        limit=limit,
        tier=tier,
        prefix=q,
        after=after,
        contains=contains,
        sort=sort,
    )


@router.post("/limits:bulk", response_model=BulkOut)
async def bulk_put_limits(body: BulkIn, db: DatabaseDep, principal: WriterDep) -> BulkOut:
    items = [
        service.UserItem(i.user, i.output_tokens_per_second, i.tier, i.scope, i.enforcement)
        for i in body.items
    ]
    change = await db.run(service.bulk_put_limits, actor=principal.name, items=items)
    return change.result


@router.get("/limits/{user}", response_model=LimitDetail)
async def get_limit(
    user: UserPath, db: DatabaseDep, fleet: FleetDep, usage: UsageSourceDep, _: ReaderDep
) -> LimitDetail:
    return await db.run(service.get_limit_detail, user=user, fleet=fleet, usage=usage)


@router.put("/limits/{user}", response_model=LimitOut)
async def put_limit(
    user: UserPath, body: LimitIn, db: DatabaseDep, principal: WriterDep
) -> LimitOut:
    change = await db.run(
        service.put_limit,
        actor=principal.name,
        user=user,
        rate=body.output_tokens_per_second,
        tier=body.tier,
        scope=body.scope,
        enforcement=body.enforcement,
    )
    return change.result


@router.patch(
    "/limits/{user}",
    response_model=LimitOut,
    openapi_extra=merge_patch_body(LimitPatch),
    summary="Change only the fields sent (JSON merge patch, RFC 7396)",
)
async def patch_limit(
    user: UserPath, body: LimitPatch, db: DatabaseDep, principal: WriterDep
) -> LimitOut:
    changes = body.model_dump(include=body.model_fields_set)
    change = await db.run(service.patch_limit, actor=principal.name, user=user, changes=changes)
    return change.result


@router.delete("/limits/{user}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_limit(user: UserPath, db: DatabaseDep, principal: WriterDep) -> Response:
    await db.run(service.delete_limit, actor=principal.name, user=user)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/tiers", response_model=TierList)
async def list_tiers(db: DatabaseDep, _: ReaderDep) -> TierList:
    return await db.run(service.list_tiers)


@router.get("/tiers/{name}", response_model=TierOut, responses=NOT_FOUND)
async def get_tier(name: TierPath, db: DatabaseDep, _: ReaderDep) -> TierOut:
    return await db.run(service.get_tier, name=name)


@router.put("/tiers/{name}", response_model=TierOut)
async def put_tier(name: TierPath, body: TierIn, db: DatabaseDep, principal: WriterDep) -> TierOut:
    change = await db.run(
        service.put_tier,
        actor=principal.name,
        name=name,
        rate=body.output_tokens_per_second,
        description=body.description,
        scope=body.scope,
        enforcement=body.enforcement,
    )
    return change.result


@router.patch(
    "/tiers/{name}",
    response_model=TierOut,
    responses=NOT_FOUND,
    openapi_extra=merge_patch_body(TierPatch),
    summary="Change only the fields sent (JSON merge patch, RFC 7396)",
)
async def patch_tier(
    name: TierPath, body: TierPatch, db: DatabaseDep, principal: WriterDep
) -> TierOut:
    changes = body.model_dump(include=body.model_fields_set)
    change = await db.run(service.patch_tier, actor=principal.name, name=name, changes=changes)
    return change.result


@router.delete(
    "/tiers/{name}", status_code=status.HTTP_204_NO_CONTENT, responses={**NOT_FOUND, **CONFLICT}
)
async def delete_tier(name: TierPath, db: DatabaseDep, principal: WriterDep) -> Response:
    await db.run(service.delete_tier, actor=principal.name, name=name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/default-limit", response_model=DefaultOut)
async def get_default(db: DatabaseDep, _: ReaderDep) -> DefaultOut:
    return await db.run(service.get_default)


@router.put("/default-limit", response_model=DefaultOut)
async def put_default(body: DefaultIn, db: DatabaseDep, principal: WriterDep) -> DefaultOut:
    change = await db.run(
        service.put_default,
        actor=principal.name,
        rate=body.output_tokens_per_second,
        scope=body.scope,
        enforcement=body.enforcement,
    )
    return change.result
