"""REST routes. Thin: parse, run one service call in one transaction, answer."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request, Response, status
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from control_plane import services
from control_plane.auth import ReaderDep, WriterDep
from control_plane.deps import DatabaseDep
from control_plane.schemas import (
    ENGINE_ID_PATTERN,
    MAX_ENGINE_ID_LEN,
    MAX_USER_ID_LEN,
    TIER_NAME_PATTERN,
    USER_ID_PATTERN,
    AuditChanges,
    AuditList,
    BulkIn,
    BulkOut,
    DefaultIn,
    DefaultOut,
    EngineList,
    ErrorOut,
    Health,
    LimitIn,
    LimitOut,
    LimitPage,
    LimitPatch,
    SessionOut,
    TierIn,
    TierList,
    TierOut,
    TierPatch,
    TokenCreated,
    TokenIn,
    TokenList,
    UsageHistoryOut,
    UsageList,
)

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorOut, "description": "The body could not be read (e.g. not UTF-8)"},
    401: {"model": ErrorOut, "description": "Missing or wrong bearer token"},
    403: {"model": ErrorOut, "description": "A viewer token tried to write"},
    422: {"model": ErrorOut, "description": "Invalid input, naming the field"},
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorOut}}
CONFLICT: dict[int | str, dict[str, Any]] = {409: {"model": ErrorOut}}

router = APIRouter(responses=ERRORS)

MERGE_PATCH = "application/merge-patch+json"


def _merge_patch_body(model: type[Any]) -> dict[str, Any]:
    """OpenAPI: the body is accepted as application/json and as a JSON merge patch."""
    ref = {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": ref, MERGE_PATCH: ref},
        }
    }


UserPath = Annotated[str, Path(min_length=1, max_length=MAX_USER_ID_LEN, pattern=USER_ID_PATTERN)]
EnginePath = Annotated[
    str, Path(min_length=1, max_length=MAX_ENGINE_ID_LEN, pattern=ENGINE_ID_PATTERN)
]
TierPath = Annotated[str, Path(pattern=TIER_NAME_PATTERN)]


@router.get("/healthz", response_model=Health)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/session", response_model=SessionOut)
async def session(principal: ReaderDep) -> dict[str, Any]:
    """Who the bearer token is: the UI shows write controls only when can_write."""
    return {"name": principal.name, "can_write": principal.can_write}


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
) -> dict[str, Any]:
    return await db.scan(
        services.list_limits,
        offset=offset,
        limit=limit,
        tier=tier,
        prefix=q,
        after=after,
        contains=contains,
        sort=sort,
    )


@router.post("/limits:bulk", response_model=BulkOut)
async def bulk_put_limits(body: BulkIn, db: DatabaseDep, principal: WriterDep) -> dict[str, Any]:
    items = [(i.user, i.output_tokens_per_second, i.tier) for i in body.items]
    change = await db.write_batch(services.bulk_put_limits, actor=principal.name, items=items)
    return change.result


@router.get("/limits/{user}", response_model=LimitOut)
async def get_limit(user: UserPath, db: DatabaseDep, _: ReaderDep) -> dict[str, Any]:
    return await db.read(services.get_limit, user=user)


@router.put("/limits/{user}", response_model=LimitOut)
async def put_limit(
    user: UserPath, body: LimitIn, db: DatabaseDep, principal: WriterDep
) -> dict[str, Any]:
    change = await db.write(
        services.put_limit,
        actor=principal.name,
        user=user,
        rate=body.output_tokens_per_second,
        tier=body.tier,
    )
    return change.result


@router.patch(
    "/limits/{user}",
    response_model=LimitOut,
    openapi_extra=_merge_patch_body(LimitPatch),
    summary="Change only the fields sent (JSON merge patch, RFC 7396)",
)
async def patch_limit(
    user: UserPath, body: LimitPatch, db: DatabaseDep, principal: WriterDep
) -> dict[str, Any]:
    changes = body.model_dump(include=body.model_fields_set)
    change = await db.write(services.patch_limit, actor=principal.name, user=user, changes=changes)
    return change.result


@router.delete("/limits/{user}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_limit(user: UserPath, db: DatabaseDep, principal: WriterDep) -> Response:
    await db.write(services.delete_limit, actor=principal.name, user=user)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/tiers", response_model=TierList)
async def list_tiers(db: DatabaseDep, _: ReaderDep) -> dict[str, Any]:
    return {"items": await db.read(services.list_tiers)}


@router.get("/tiers/{name}", response_model=TierOut, responses=NOT_FOUND)
async def get_tier(name: TierPath, db: DatabaseDep, _: ReaderDep) -> dict[str, Any]:
    return await db.read(services.get_tier, name=name)


@router.put("/tiers/{name}", response_model=TierOut)
async def put_tier(
    name: TierPath, body: TierIn, db: DatabaseDep, principal: WriterDep
) -> dict[str, Any]:
    change = await db.write(
        services.put_tier,
        actor=principal.name,
        name=name,
        rate=body.output_tokens_per_second,
        description=body.description,
    )
    return change.result


@router.patch(
    "/tiers/{name}",
    response_model=TierOut,
    responses=NOT_FOUND,
    openapi_extra=_merge_patch_body(TierPatch),
    summary="Change only the fields sent (JSON merge patch, RFC 7396)",
)
async def patch_tier(
    name: TierPath, body: TierPatch, db: DatabaseDep, principal: WriterDep
) -> dict[str, Any]:
    changes = body.model_dump(include=body.model_fields_set)
    change = await db.write(services.patch_tier, actor=principal.name, name=name, changes=changes)
    return change.result


@router.delete(
    "/tiers/{name}", status_code=status.HTTP_204_NO_CONTENT, responses={**NOT_FOUND, **CONFLICT}
)
async def delete_tier(name: TierPath, db: DatabaseDep, principal: WriterDep) -> Response:
    await db.write(services.delete_tier, actor=principal.name, name=name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/default-limit", response_model=DefaultOut)
async def get_default(db: DatabaseDep, _: ReaderDep) -> dict[str, Any]:
    return await db.read(services.get_default)


@router.put("/default-limit", response_model=DefaultOut)
async def put_default(body: DefaultIn, db: DatabaseDep, principal: WriterDep) -> dict[str, Any]:
    change = await db.write(
        services.put_default, actor=principal.name, rate=body.output_tokens_per_second
    )
    return change.result


@router.get("/engines", response_model=EngineList)
async def list_engines(request: Request, db: DatabaseDep, _: ReaderDep) -> dict[str, Any]:
    settings = request.app.state.settings
    return await db.read(
        services.list_engines,
        timeout_s=settings.engine_timeout_s,
        retention_s=settings.engine_retention_s,
    )


@router.delete("/engines/{engine_id}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND)
async def delete_engine(engine_id: EnginePath, db: DatabaseDep, _: WriterDep) -> Response:
    await db.write(services.delete_engine, engine_id=engine_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/usage", response_model=UsageList)
async def usage(request: Request, db: DatabaseDep, _: ReaderDep) -> dict[str, Any]:
    return {"items": await db.scan(request.app.state.usage_source.usage_items)}


@router.get("/usage/history", response_model=UsageHistoryOut)
async def usage_history(
    request: Request,
    db: DatabaseDep,
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
) -> dict[str, Any]:
    now = time.time()
    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=UTC)  # a time without a zone is UTC
    since_s = now - 3600 if since is None else since.timestamp()
    result = await db.scan(
        services.usage_history,
        now=now,
        since=since_s,
        step=step,
        user=user,
        top=top,
        order=order,
    )
    return {**result, "retention_days": request.app.state.settings.usage_retention_days}


@router.get("/audit", response_model=AuditList)
async def audit(
    db: DatabaseDep,
    _: ReaderDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    before_id: Annotated[
        int | None,
        Query(ge=1, le=2**31 - 1, description="Cursor: next_before_id of the previous page"),
    ] = None,
    target: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=MAX_USER_ID_LEN + 16,
            pattern=USER_ID_PATTERN,
            description="Only entries about this target (a user, a tier, default, token:ID)",
        ),
    ] = None,
) -> dict[str, Any]:
    return await db.scan(services.list_audit, limit=limit, before_id=before_id, target=target)


@router.get("/audit/{entry_id}/changes", response_model=AuditChanges, responses=NOT_FOUND)
async def audit_changes(
    entry_id: Annotated[int, Path(ge=1, le=2**31 - 1)],
    db: DatabaseDep,
    _: ReaderDep,
    after: Annotated[str | None, Query(max_length=MAX_USER_ID_LEN + 16)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    return await db.scan(services.audit_changes, entry_id=entry_id, after=after, limit=limit)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request, db: DatabaseDep, _: ReaderDep) -> PlainTextResponse:
    body = await db.read(request.app.state.metrics.render)
    return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)


@router.post("/tokens", status_code=status.HTTP_201_CREATED, response_model=TokenCreated)
async def create_token(body: TokenIn, db: DatabaseDep, principal: WriterDep) -> dict[str, Any]:
    created = await db.write(services.create_viewer_token, actor=principal.name, name=body.name)
    return created


@router.get("/tokens", response_model=TokenList)
async def list_tokens(db: DatabaseDep, _: WriterDep) -> dict[str, Any]:
    return {"items": await db.read(services.list_viewer_tokens)}


@router.delete("/tokens/{token_id}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND)
async def revoke_token(
    token_id: Annotated[int, Path(ge=1, le=2**31 - 1)], db: DatabaseDep, principal: WriterDep
) -> Response:
    await db.write(services.revoke_viewer_token, actor=principal.name, token_id=token_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
