"""Audit log pages."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

from control_plane.audit.targets import TargetKind


class AuditChange(BaseModel):
    target: str
    before: Any
    after: Any


class AuditOut(BaseModel):
    id: int
    at: datetime
    version: int
    actor: str
    action: str
    target_kind: TargetKind = Field(
        description="What `target` names: a user, a tier, the default, a viewer token (its "
        'id), or a bulk change of many users (`target` is then "<n> users")'
    )
    target: str
    before: Any
    after: Any
    truncated: bool = Field(
        False, description="before/after too large to inline: GET /audit/{id}/changes"
    )
    change: AuditChange | None = Field(
        None,
        description="A bulk entry listed for a user (GET /audit?target=<user>): what it did "
        "to that user, even when before/after are truncated",
    )


class AuditList(BaseModel):
    items: list[AuditOut]
    next_before_id: int | None = None


class AuditChanges(BaseModel):
    id: int
    version: int
    action: str
    target_kind: TargetKind
    items: list[AuditChange]
    next_after: str | None
