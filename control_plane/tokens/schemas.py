"""Viewer token bodies."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import BaseModel, Field

from control_plane.schemas import Body

# Viewer token names: free text on one line.
TOKEN_NAME_PATTERN = r"^[^\x00-\x1f\x7f]+$"


class TokenIn(Body):
    name: Annotated[
        str, Field(strict=True, min_length=1, max_length=128, pattern=TOKEN_NAME_PATTERN)
    ]


class TokenCreated(BaseModel):
    id: int
    name: str
    token: str = Field(description="The bearer token; shown only in this response")


class TokenOut(BaseModel):
    id: int
    name: str
    created_at: datetime
    revoked: bool


class TokenList(BaseModel):
    items: list[TokenOut]
