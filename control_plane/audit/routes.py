"""Routes of the audit log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from control_plane.audit import service
from control_plane.audit.schemas import AuditChanges, AuditList
from control_plane.audit.targets import TargetKind
from control_plane.auth import ReaderDep
from control_plane.deps import DatabaseDep
from control_plane.schemas import ERRORS, NOT_FOUND
from output_rate_core.ids import MAX_USER_ID_LEN, USER_ID_PATTERN

router = APIRouter(responses=ERRORS)


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
            max_length=MAX_USER_ID_LEN,
            pattern=USER_ID_PATTERN,
            description="Only entries about this target. Without target_kind a user id: the "
            "user's own entries and the bulk changes that touched it",
        ),
    ] = None,
    target_kind: Annotated[
        TargetKind | None,
        Query(
            description="Only entries about this kind of target (user: without the bulk "
            "changes; bulk with a target: the bulk changes that touched that user; token: "
            "target is the token's id)"
        ),
    ] = None,
) -> AuditList:
    return await db.run(
        service.list_audit, limit=limit, before_id=before_id, target=target, kind=target_kind
    )


@router.get("/audit/{entry_id}/changes", response_model=AuditChanges, responses=NOT_FOUND)
async def audit_changes(
    entry_id: Annotated[int, Path(ge=1, le=2**31 - 1)],
    db: DatabaseDep,
    _: ReaderDep,
    after: Annotated[str | None, Query(max_length=MAX_USER_ID_LEN + 16)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> AuditChanges:
    return await db.run(service.audit_changes, entry_id=entry_id, after=after, limit=limit)
