"""REST routes. Thin: parse, call a service, commit once."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response, status
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from control_plane import services
from control_plane.auth import ReaderDep, WriterDep
from control_plane.deps import SessionDep
from control_plane.schemas import (
    TIER_NAME_PATTERN,
    USER_ID_PATTERN,
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
    TierIn,
    TierList,
    TierOut,
    TokenCreated,
    TokenIn,
    TokenList,
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

UserPath = Annotated[str, Path(min_length=1, max_length=256, pattern=USER_ID_PATTERN)]
TierPath = Annotated[str, Path(pattern=TIER_NAME_PATTERN)]


@router.get("/healthz", response_model=Health)
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/limits", response_model=LimitPage)
def list_limits(
    session: SessionDep,
    _: ReaderDep,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    tier: Annotated[str | None, Query(pattern=TIER_NAME_PATTERN)] = None,
    q: Annotated[str | None, Query(max_length=256, pattern=USER_ID_PATTERN)] = None,
) -> dict[str, Any]:
    return services.list_limits(session, offset=offset, limit=limit, tier=tier, prefix=q)


@router.post("/limits:bulk", response_model=BulkOut)
def bulk_put_limits(body: BulkIn, session: SessionDep, principal: WriterDep) -> dict[str, Any]:
    items = [(i.user, i.output_tokens_per_second, i.tier) for i in body.items]
    result = services.bulk_put_limits(session, actor=principal.name, items=items)
    return result


@router.get("/limits/{user}", response_model=LimitOut)
def get_limit(user: UserPath, session: SessionDep, _: ReaderDep) -> dict[str, Any]:
    return services.get_limit(session, user=user)


@router.put("/limits/{user}", response_model=LimitOut)
def put_limit(
    user: UserPath, body: LimitIn, session: SessionDep, principal: WriterDep
) -> dict[str, Any]:
    view = services.put_limit(
        session,
        actor=principal.name,
        user=user,
        rate=body.output_tokens_per_second,
        tier=body.tier,
    )
    return view


@router.delete("/limits/{user}", status_code=status.HTTP_204_NO_CONTENT)
def delete_limit(user: UserPath, session: SessionDep, principal: WriterDep) -> Response:
    services.delete_limit(session, actor=principal.name, user=user)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/tiers", response_model=TierList)
def list_tiers(session: SessionDep, _: ReaderDep) -> dict[str, Any]:
    return {"items": services.list_tiers(session)}


@router.get("/tiers/{name}", response_model=TierOut, responses=NOT_FOUND)
def get_tier(name: TierPath, session: SessionDep, _: ReaderDep) -> dict[str, Any]:
    return services.get_tier(session, name=name)


@router.put("/tiers/{name}", response_model=TierOut)
def put_tier(
    name: TierPath, body: TierIn, session: SessionDep, principal: WriterDep
) -> dict[str, Any]:
    view = services.put_tier(
        session,
        actor=principal.name,
        name=name,
        rate=body.output_tokens_per_second,
        description=body.description,
    )
    return view


@router.delete(
    "/tiers/{name}", status_code=status.HTTP_204_NO_CONTENT, responses={**NOT_FOUND, **CONFLICT}
)
def delete_tier(name: TierPath, session: SessionDep, principal: WriterDep) -> Response:
    services.delete_tier(session, actor=principal.name, name=name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/default-limit", response_model=DefaultOut)
def get_default(session: SessionDep, _: ReaderDep) -> dict[str, Any]:
    return services.get_default(session)


@router.put("/default-limit", response_model=DefaultOut)
def put_default(body: DefaultIn, session: SessionDep, principal: WriterDep) -> dict[str, Any]:
    view = services.put_default(session, actor=principal.name, rate=body.output_tokens_per_second)
    return view


@router.get("/engines", response_model=EngineList)
def list_engines(request: Request, session: SessionDep, _: ReaderDep) -> dict[str, Any]:
    timeout_s = request.app.state.settings.engine_timeout_s
    return services.list_engines(session, timeout_s=timeout_s)


@router.get("/usage", response_model=UsageList)
def usage(request: Request, session: SessionDep, _: ReaderDep) -> dict[str, Any]:
    return {"items": request.app.state.usage_source.usage_items(session)}


@router.get("/audit", response_model=AuditList)
def audit(
    session: SessionDep, _: ReaderDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> dict[str, Any]:
    return {"items": services.list_audit(session, limit=limit)}


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(request: Request, session: SessionDep, _: ReaderDep) -> PlainTextResponse:
    body = request.app.state.metrics.render(session)
    return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)


@router.post("/tokens", status_code=status.HTTP_201_CREATED, response_model=TokenCreated)
def create_token(body: TokenIn, session: SessionDep, principal: WriterDep) -> dict[str, Any]:
    created = services.create_viewer_token(session, actor=principal.name, name=body.name)
    return created


@router.get("/tokens", response_model=TokenList)
def list_tokens(session: SessionDep, _: WriterDep) -> dict[str, Any]:
    return {"items": services.list_viewer_tokens(session)}


@router.delete("/tokens/{token_id}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND)
def revoke_token(
    token_id: Annotated[int, Path(ge=1, le=2**31 - 1)], session: SessionDep, principal: WriterDep
) -> Response:
    services.revoke_viewer_token(session, actor=principal.name, token_id=token_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
