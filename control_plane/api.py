"""REST routes. Thin: parse, call a service, commit once."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response, status

from control_plane import services
from control_plane.auth import ReaderDep, WriterDep
from control_plane.deps import SessionDep, commit
from control_plane.schemas import (
    TIER_NAME_PATTERN,
    USER_ID_PATTERN,
    BulkIn,
    DefaultIn,
    LimitIn,
    TierIn,
    TokenIn,
)

router = APIRouter()

UserPath = Annotated[str, Path(min_length=1, max_length=256, pattern=USER_ID_PATTERN)]
TierPath = Annotated[str, Path(pattern=TIER_NAME_PATTERN)]


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/limits")
def list_limits(
    session: SessionDep,
    _: ReaderDep,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    tier: Annotated[str | None, Query(pattern=TIER_NAME_PATTERN)] = None,
    q: Annotated[str | None, Query(max_length=256, pattern=USER_ID_PATTERN)] = None,
) -> dict[str, Any]:
    return services.list_limits(session, offset=offset, limit=limit, tier=tier, prefix=q)


@router.post("/limits:bulk")
def bulk_put_limits(
    body: BulkIn, request: Request, session: SessionDep, principal: WriterDep
) -> dict[str, Any]:
    items = [(i.user, i.output_tokens_per_second, i.tier) for i in body.items]
    result = services.bulk_put_limits(session, actor=principal.name, items=items)
    commit(request, session)
    return result


@router.get("/limits/{user}")
def get_limit(user: UserPath, session: SessionDep, _: ReaderDep) -> dict[str, Any]:
    return services.get_limit(session, user=user)


@router.put("/limits/{user}")
def put_limit(
    user: UserPath, body: LimitIn, request: Request, session: SessionDep, principal: WriterDep
) -> dict[str, Any]:
    view = services.put_limit(
        session,
        actor=principal.name,
        user=user,
        rate=body.output_tokens_per_second,
        tier=body.tier,
    )
    commit(request, session)
    return view


@router.delete("/limits/{user}", status_code=status.HTTP_204_NO_CONTENT)
def delete_limit(
    user: UserPath, request: Request, session: SessionDep, principal: WriterDep
) -> Response:
    services.delete_limit(session, actor=principal.name, user=user)
    commit(request, session)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/tiers")
def list_tiers(session: SessionDep, _: ReaderDep) -> dict[str, Any]:
    return {"items": services.list_tiers(session)}


@router.get("/tiers/{name}")
def get_tier(name: TierPath, session: SessionDep, _: ReaderDep) -> dict[str, Any]:
    return services.get_tier(session, name=name)


@router.put("/tiers/{name}")
def put_tier(
    name: TierPath, body: TierIn, request: Request, session: SessionDep, principal: WriterDep
) -> dict[str, Any]:
    view = services.put_tier(
        session,
        actor=principal.name,
        name=name,
        rate=body.output_tokens_per_second,
        description=body.description,
    )
    commit(request, session)
    return view


@router.delete("/tiers/{name}", status_code=status.HTTP_204_NO_CONTENT)
def delete_tier(
    name: TierPath, request: Request, session: SessionDep, principal: WriterDep
) -> Response:
    services.delete_tier(session, actor=principal.name, name=name)
    commit(request, session)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/default-limit")
def get_default(session: SessionDep, _: ReaderDep) -> dict[str, Any]:
    return services.get_default(session)


@router.put("/default-limit")
def put_default(
    body: DefaultIn, request: Request, session: SessionDep, principal: WriterDep
) -> dict[str, Any]:
    view = services.put_default(session, actor=principal.name, rate=body.output_tokens_per_second)
    commit(request, session)
    return view


@router.get("/engines")
def list_engines(request: Request, session: SessionDep, _: ReaderDep) -> dict[str, Any]:
    timeout_s = request.app.state.settings.engine_timeout_s
    return services.list_engines(session, timeout_s=timeout_s)


@router.get("/usage")
def usage(request: Request, session: SessionDep, _: ReaderDep) -> dict[str, Any]:
    return {"items": request.app.state.usage_source.usage_items(session)}


@router.get("/audit")
def audit(
    session: SessionDep, _: ReaderDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> dict[str, Any]:
    return {"items": services.list_audit(session, limit=limit)}


@router.post("/tokens", status_code=status.HTTP_201_CREATED)
def create_token(
    body: TokenIn, request: Request, session: SessionDep, _: WriterDep
) -> dict[str, Any]:
    created = services.create_viewer_token(session, name=body.name)
    session.commit()
    return created


@router.get("/tokens")
def list_tokens(session: SessionDep, _: WriterDep) -> dict[str, Any]:
    return {"items": services.list_viewer_tokens(session)}


@router.delete("/tokens/{token_id}", status_code=status.HTTP_204_NO_CONTENT)
def revoke_token(
    token_id: Annotated[int, Path(ge=1, le=2**31)], session: SessionDep, _: WriterDep
) -> Response:
    services.revoke_viewer_token(session, token_id=token_id)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
