"""Request bodies. Strict: a rate is a JSON integer 1..1,000,000 or null."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from output_rate_core.ids import (
    ENGINE_ID_PATTERN,
    MAX_ENGINE_ID_LEN,
    MAX_USER_ID_LEN,
    TIER_NAME_PATTERN,
    USER_ID_PATTERN,
)
from output_rate_core.rates import MAX_RATE, MIN_RATE

__all__ = ["ENGINE_ID_PATTERN", "MAX_ENGINE_ID_LEN", "TIER_NAME_PATTERN", "USER_ID_PATTERN"]

# Viewer token names: free text on one line.
TOKEN_NAME_PATTERN = r"^[^\x00-\x1f\x7f]+$"
# Free text: tabs and line breaks are fine, other control characters (NUL!) are not.
TEXT_PATTERN = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f]*$"

Rate = Annotated[int, Field(strict=True, ge=MIN_RATE, le=MAX_RATE)]
TierName = Annotated[str, Field(strict=True, pattern=TIER_NAME_PATTERN)]
UserId = Annotated[
    str, Field(strict=True, min_length=1, max_length=MAX_USER_ID_LEN, pattern=USER_ID_PATTERN)
]
Description = Annotated[str, Field(strict=True, max_length=1000, pattern=TEXT_PATTERN)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LimitIn(_Body):
    output_tokens_per_second: Rate | None = None
    tier: TierName | None = None


class BulkItem(LimitIn):
    user: UserId


class BulkIn(_Body):
    items: Annotated[list[BulkItem], Field(max_length=10_000)]


class TierIn(_Body):
    output_tokens_per_second: Rate | None = None
    description: Description | None = None


class LimitPatch(_Body):
    """JSON merge patch (RFC 7396) of a user's record: only the fields sent change;
    null clears the field (no override = the tier's or default rate; no tier)."""

    output_tokens_per_second: Rate | None = None
    tier: TierName | None = None


class TierPatch(_Body):
    """JSON merge patch of a tier: only the fields sent change; a rate of null is
    unlimited, a description of null is empty."""

    output_tokens_per_second: Rate | None = None
    description: Description | None = None


class DefaultIn(_Body):
    output_tokens_per_second: Rate | None = None


class TokenIn(_Body):
    name: Annotated[
        str, Field(strict=True, min_length=1, max_length=128, pattern=TOKEN_NAME_PATTERN)
    ]


# ---- responses (documented in OpenAPI, checked by the fuzz test) -------------


class LimitOut(BaseModel):
    user: str
    tier: str | None
    output_tokens_per_second: int | None = Field(description="The user's override, or null")
    effective_output_tokens_per_second: int | None = Field(description="null: unlimited")
    source: Literal["override", "tier", "default"]
    version: int


class LimitPage(BaseModel):
    items: list[LimitOut]
    total: int


class BulkOut(BaseModel):
    version: int
    num_changed: int


class TierOut(BaseModel):
    name: str
    output_tokens_per_second: int | None
    description: str
    num_users: int
    version: int


class TierList(BaseModel):
    items: list[TierOut]


class DefaultOut(BaseModel):
    output_tokens_per_second: int | None
    version: int


class EngineOut(BaseModel):
    engine_id: str
    model: str
    applied_version: int
    connected: bool
    last_seen: datetime
    first_seen: datetime


class EngineList(BaseModel):
    version: int
    items: list[EngineOut]


class UsageList(BaseModel):
    items: list[dict[str, Any]]


class HistorySeries(BaseModel):
    user: str
    output_tokens_per_second: list[float | None] = Field(
        description="Per bucket: tokens/s while reported; null = nothing reported (a gap)"
    )
    throttled_fraction: list[float | None]
    limit: list[int | None] = Field(description="Per bucket: the limit then; null = unlimited")
    tokens: int
    throttled: int


class UsageHistoryOut(BaseModel):
    since: int = Field(description="Unix time (s) of the first bucket")
    until: int
    step: int = Field(description="Seconds per bucket")
    retention_days: int
    times: list[int] = Field(description="Unix time (s) each bucket starts")
    items: list[HistorySeries]


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


class FieldError(BaseModel):
    field: str
    msg: str
    type: str


class ErrorOut(BaseModel):
    """Every error response: a message naming the field, and the field itself."""

    detail: str
    field: str | None = None
    errors: list[FieldError] | None = None


class SessionOut(BaseModel):
    name: str = Field(description='"admin" or "viewer:<token name>"')
    can_write: bool


class Health(BaseModel):
    status: str
