"""Audit log pages."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field


class AuditOut(BaseModel):
    id: int
    at: datetime
    version: int
    actor: str
    action: str
    target: str
    before: Any
    after: Any
    truncated: bool = Field(
        False, description="before/after too large to inline: GET /audit/{id}/changes"
    )


class AuditList(BaseModel):
    items: list[AuditOut]
    next_before_id: int | None = None


class AuditChange(BaseModel):
    target: str
    before: Any
    after: Any


class AuditChanges(BaseModel):
    id: int
    version: int
    action: str
    items: list[AuditChange]
    next_after: str | None
