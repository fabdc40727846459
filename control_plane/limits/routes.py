"""Routes of users' limits, tiers and the default limit. Thin: parse, run one service."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from control_plane.auth import ReaderDep, WriterDep
from control_plane.db import Service
from control_plane.deps import DatabaseDep, FleetDep, UsageSourceDep
from control_plane.errors import DomainError
from control_plane.limits import csv_items, service
from control_plane.limits.plans import BulkInput, UserItem
from control_plane.limits.preview import Preview
from control_plane.limits.schemas import (
    MAX_PREVIEW_ITEMS,
    BulkIn,
    BulkOut,
    ChangePreview,
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
from control_plane.preconditions import ETAG, IF_MATCH, IfMatch, etag, parse_if_match
from control_plane.schemas import (
    CONFLICT,
    ERRORS,
    NOT_FOUND,
    PRECONDITION_FAILED,
    UserPath,
    merge_patch_body,
)
from output_rate_core.ids import MAX_USER_ID_LEN, TIER_NAME_PATTERN, USER_ID_PATTERN

router = APIRouter(responses=ERRORS)

TierPath = Annotated[str, Path(pattern=TIER_NAME_PATTERN)]


class DryRun:
    """A limit write's `?dry_run=true&items_limit=N`: when `wanted`, the route answers
    what the write would change instead of making it."""

    def __init__(
        self,
        db: DatabaseDep,
        dry_run: Annotated[
            bool,
            Query(
                description="true: write nothing; answer what the write would change (a "
                "ChangePreview, 200), with the write's own validation and errors"
            ),
        ] = False,
        items_limit: Annotated[
            int,
            Query(ge=0, le=MAX_PREVIEW_ITEMS, description="With dry_run: the items listed at most"),
        ] = MAX_PREVIEW_ITEMS,
    ) -> None:
        self.wanted = dry_run
        self._db = db
        self._items_limit = items_limit

    async def preview(self, compute: Service[..., Preview], **kw: Any) -> Response:
        """The preview `compute` makes in one read transaction, encoded as is: validating
        its up to 10,000 items again against ChangePreview (which documents it) would cost
        more than computing them."""
        result = await self._db.run(compute, items_limit=self._items_limit, **kw)
        return Response(msgspec.json.encode(result), media_type="application/json")


DryRunDep = Annotated[DryRun, Depends()]


def _if_match(
    value: Annotated[
        str | None,
        Header(
            alias=IF_MATCH,
            description='The ETag the record had when read (e.g. "57"), or *: the write '
            "(or its preview) is refused with 412, and nothing written, unless the record "
            "is still at that version",
        ),
    ] = None,
) -> IfMatch | None:
    return parse_if_match(value)


IfMatchDep = Annotated[IfMatch | None, Depends(_if_match)]

# OpenAPI of a GET that answers a record's ETag.
ETAG_200: dict[int | str, dict[str, Any]] = {
    200: {
        "headers": {
            ETAG: {
                "description": 'The record\'s version, quoted ("57"): send it as If-Match '
                "with a write of the record",
                "schema": {"type": "string"},
            }
        }
    }
}


def _with_etag(response: Response, version: int | None) -> None:
    if version is not None:
        response.headers[ETAG] = etag(version)


# OpenAPI of a write that answers 204 (DELETE): the preview's 200.
PREVIEW_200: dict[int | str, dict[str, Any]] = {
    200: {"model": ChangePreview, "description": "dry_run=true: what the write would change"}
}
CSV = "text/csv"


def _inlined(schema: Any, defs: dict[str, Any]) -> Any:
    """`schema` with its local references (#/$defs/...) replaced by what they name."""
    if isinstance(schema, dict):
        ref = schema.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inlined(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inlined(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inlined(v, defs) for v in schema]
    return schema


# The bulk route reads its body itself (JSON or CSV), so FastAPI does not list BulkIn:
# its schema is given here, whole.
_BULK_SCHEMA = BulkIn.model_json_schema()
BULK_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": _inlined(_BULK_SCHEMA, _BULK_SCHEMA.get("$defs", {}))},
            # Any text is a CSV body: the schema says nothing a client could violate (its
            # rules, all reported by line, are in the description and the docs).
            CSV: {
                "schema": {
                    "description": "Lines of user,tier,output_tokens_per_second,scope,"
                    "enforcement,ceiling_output_tokens_per_second (an optional header "
                    "line; quoted fields allowed; trailing fields may be left out)"
                },
                "example": "user,tier,output_tokens_per_second,scope,enforcement,"
                "ceiling_output_tokens_per_second\n"
                'alice,pro,,,,\n"bob",,50,engine,shadow,80\n',
            },
        },
    }
}


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


async def _bulk_body(request: Request) -> BulkInput:
    """The items of a JSON body (BulkIn), or of a CSV one (csv_items) with their lines."""
    body = await request.body()
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type == CSV:
        try:
            text = body.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise DomainError("body: not valid UTF-8", field="body") from None
        parsed = csv_items.parse(text)
        return BulkInput(parsed.items, parsed.lines, parsed.problems)
    try:
        bulk = BulkIn.model_validate_json(body)
    except ValidationError as e:
        raise RequestValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in e.errors()]
        ) from None
    return BulkInput([UserItem(i.user, i.tier, i.policy) for i in bulk.items])


@router.post(
    "/limits:bulk",
    response_model=BulkOut | ChangePreview,
    openapi_extra=BULK_BODY,
    summary="Replace the records of up to 10,000 users as one version (JSON or CSV)",
)
async def bulk_put_limits(
    request: Request,
    db: DatabaseDep,
    principal: WriterDep,
    dry_run: DryRunDep,
) -> BulkOut | Response:
    bulk = await _bulk_body(request)
    kw: dict[str, Any] = {"items": bulk.items, "lines": bulk.lines, "problems": bulk.problems}
    if dry_run.wanted:
        return await dry_run.preview(service.bulk_put_limits.preview, **kw)
    change = await db.run(service.bulk_put_limits, actor=principal.name, **kw)
    return change.result


@router.get("/limits/{user}", response_model=LimitDetail, responses=ETAG_200)
async def get_limit(
    user: UserPath,
    response: Response,
    db: DatabaseDep,
    fleet: FleetDep,
    usage: UsageSourceDep,
    _: ReaderDep,
) -> LimitDetail:
    detail = await db.run(service.get_limit_detail, user=user, fleet=fleet, usage=usage)
    _with_etag(response, detail.version)
    return detail.view


@router.put(
    "/limits/{user}", response_model=LimitOut | ChangePreview, responses=PRECONDITION_FAILED
)
async def put_limit(
    user: UserPath,
    body: LimitIn,
    response: Response,
    db: DatabaseDep,
    principal: WriterDep,
    dry_run: DryRunDep,
    if_match: IfMatchDep,
) -> LimitOut | Response:
    kw: dict[str, Any] = {
        "user": user,
        "rate": body.output_tokens_per_second,
        "tier": body.tier,
        "scope": body.scope,
        "enforcement": body.enforcement,
        "ceiling": body.ceiling_output_tokens_per_second,
        "if_match": if_match,
    }
    if dry_run.wanted:
        return await dry_run.preview(service.put_limit.preview, **kw)
    change = await db.run(service.put_limit, actor=principal.name, **kw)
    _with_etag(response, change.record_version)
    return change.result


@router.patch(
    "/limits/{user}",
    response_model=LimitOut | ChangePreview,
    responses=PRECONDITION_FAILED,
    openapi_extra=merge_patch_body(LimitPatch),
    summary="Change only the fields sent (JSON merge patch, RFC 7396)",
)
async def patch_limit(
    user: UserPath,
    body: LimitPatch,
    response: Response,
    db: DatabaseDep,
    principal: WriterDep,
    dry_run: DryRunDep,
    if_match: IfMatchDep,
) -> LimitOut | Response:
    kw: dict[str, Any] = {
        "user": user,
        "changes": body.model_dump(include=body.model_fields_set),
        "if_match": if_match,
    }
    if dry_run.wanted:
        return await dry_run.preview(service.patch_limit.preview, **kw)
    change = await db.run(service.patch_limit, actor=principal.name, **kw)
    _with_etag(response, change.record_version)
    return change.result


@router.delete(
    "/limits/{user}",
    status_code=status.HTTP_204_NO_CONTENT,
    responses={**PREVIEW_200, **PRECONDITION_FAILED},
)
async def delete_limit(
    user: UserPath,
    db: DatabaseDep,
    principal: WriterDep,
    dry_run: DryRunDep,
    if_match: IfMatchDep,
) -> Response:
    if dry_run.wanted:
        return await dry_run.preview(service.delete_limit.preview, user=user, if_match=if_match)
    await db.run(service.delete_limit, actor=principal.name, user=user, if_match=if_match)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/tiers", response_model=TierList)
async def list_tiers(db: DatabaseDep, _: ReaderDep) -> TierList:
    return await db.run(service.list_tiers)


@router.get("/tiers/{name}", response_model=TierOut, responses={**NOT_FOUND, **ETAG_200})
async def get_tier(name: TierPath, response: Response, db: DatabaseDep, _: ReaderDep) -> TierOut:
    tier = await db.run(service.get_tier, name=name)
    _with_etag(response, tier.version)
    return tier.view


@router.put("/tiers/{name}", response_model=TierOut | ChangePreview, responses=PRECONDITION_FAILED)
async def put_tier(
    name: TierPath,
    body: TierIn,
    response: Response,
    db: DatabaseDep,
    principal: WriterDep,
    dry_run: DryRunDep,
    if_match: IfMatchDep,
) -> TierOut | Response:
    kw: dict[str, Any] = {
        "name": name,
        "rate": body.output_tokens_per_second,
        "scope": body.scope,
        "enforcement": body.enforcement,
        "ceiling": body.ceiling_output_tokens_per_second,
        "description": body.description,
        "if_match": if_match,
    }
    if dry_run.wanted:
        return await dry_run.preview(service.put_tier.preview, **kw)
    change = await db.run(service.put_tier, actor=principal.name, **kw)
    _with_etag(response, change.record_version)
    return change.result


@router.patch(
    "/tiers/{name}",
    response_model=TierOut | ChangePreview,
    responses={**NOT_FOUND, **PRECONDITION_FAILED},
    openapi_extra=merge_patch_body(TierPatch),
    summary="Change only the fields sent (JSON merge patch, RFC 7396)",
)
async def patch_tier(
    name: TierPath,
    body: TierPatch,
    response: Response,
    db: DatabaseDep,
    principal: WriterDep,
    dry_run: DryRunDep,
    if_match: IfMatchDep,
) -> TierOut | Response:
    kw: dict[str, Any] = {
        "name": name,
        "changes": body.model_dump(include=body.model_fields_set),
        "if_match": if_match,
    }
    if dry_run.wanted:
        return await dry_run.preview(service.patch_tier.preview, **kw)
    change = await db.run(service.patch_tier, actor=principal.name, **kw)
    _with_etag(response, change.record_version)
    return change.result


@router.delete(
    "/tiers/{name}",
    status_code=status.HTTP_204_NO_CONTENT,
    responses={**NOT_FOUND, **CONFLICT, **PREVIEW_200, **PRECONDITION_FAILED},
)
async def delete_tier(
    name: TierPath,
    db: DatabaseDep,
    principal: WriterDep,
    dry_run: DryRunDep,
    if_match: IfMatchDep,
) -> Response:
    if dry_run.wanted:
        return await dry_run.preview(service.delete_tier.preview, name=name, if_match=if_match)
    await db.run(service.delete_tier, actor=principal.name, name=name, if_match=if_match)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/default-limit", response_model=DefaultOut, responses=ETAG_200)
async def get_default(response: Response, db: DatabaseDep, _: ReaderDep) -> DefaultOut:
    default = await db.run(service.get_default)
    _with_etag(response, default.version)
    return default.view


@router.put(
    "/default-limit", response_model=DefaultOut | ChangePreview, responses=PRECONDITION_FAILED
)
async def put_default(
    body: DefaultIn,
    response: Response,
    db: DatabaseDep,
    principal: WriterDep,
    dry_run: DryRunDep,
    if_match: IfMatchDep,
) -> DefaultOut | Response:
    kw: dict[str, Any] = {
        "rate": body.output_tokens_per_second,
        "scope": body.scope,
        "enforcement": body.enforcement,
        "ceiling": body.ceiling_output_tokens_per_second,
        "if_match": if_match,
    }
    if dry_run.wanted:
        return await dry_run.preview(service.put_default.preview, **kw)
    change = await db.run(service.put_default, actor=principal.name, **kw)
    _with_etag(response, change.record_version)
    return change.result
