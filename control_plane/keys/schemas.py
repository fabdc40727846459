"""API key bodies. Only the response of a creation carries the key itself."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from control_plane.schemas import Body


class KeyIn(Body):
    """POST /users/{user}/keys takes no fields: no body, or an empty JSON object."""


class KeyCreated(BaseModel):
    id: str = Field(description="The key id (public; DELETE /keys/{id} names it)")
    key: str = Field(description="The API key; shown only in this response")
    user: str
    created_at: datetime


class KeyOut(BaseModel):
    id: str
    prefix: str = Field(description="What identifies the key to a person (no secret)")
    created_at: datetime
    last_used_at: datetime | None = Field(
        description="When an engine's API server last accepted it (to the minute; null: never)"
    )


class KeyList(BaseModel):
    items: list[KeyOut]
