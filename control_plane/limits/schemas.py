"""Limit, tier and default-limit bodies. Strict: a rate is a JSON integer 1..1,000,000
or null; a scope is "fleet", "engine" or null (inherit); an enforcement is "enforce",
"shadow" or null (inherit)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from control_plane.schemas import Body
from output_rate_core.ids import MAX_USER_ID_LEN, TIER_NAME_PATTERN, USER_ID_PATTERN
from output_rate_core.limits import Enforcement, Scope, Source
from output_rate_core.rates import MAX_RATE, MIN_RATE

# POST /limits:bulk: items per request.
MAX_BULK_ITEMS = 10_000
# Free text: tabs and line breaks are fine, other control characters (NUL!) are not.
TEXT_PATTERN = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f]*$"

Rate = Annotated[int, Field(strict=True, ge=MIN_RATE, le=MAX_RATE)]
TierName = Annotated[str, Field(strict=True, pattern=TIER_NAME_PATTERN)]
UserId = Annotated[
    str, Field(strict=True, min_length=1, max_length=MAX_USER_ID_LEN, pattern=USER_ID_PATTERN)
]
Description = Annotated[str, Field(strict=True, max_length=1000, pattern=TEXT_PATTERN)]
OwnScope = Annotated[
    Scope | None,
    Field(
        description='"fleet": the limit is summed over every engine; "engine": each engine '
        "enforces it in full; null: inherit (the tier's, else the default's)"
    ),
]
OwnEnforcement = Annotated[
    Enforcement | None,
    Field(
        description='"enforce": the limit holds the user back; "shadow": what it would refuse '
        "is counted (would_throttle_fraction in GET /usage) and nothing is refused; null: "
        "inherit (the tier's, else the default's)"
    ),
]


class LimitIn(Body):
    output_tokens_per_second: Rate | None = None
    tier: TierName | None = None
    scope: OwnScope = None
    enforcement: OwnEnforcement = None


class BulkItem(LimitIn):
    user: UserId


class BulkIn(Body):
    items: Annotated[list[BulkItem], Field(max_length=MAX_BULK_ITEMS)]


class TierIn(Body):
    output_tokens_per_second: Rate | None = None
    description: Description | None = None
    scope: OwnScope = None
    enforcement: OwnEnforcement = None


class LimitPatch(Body):
    """JSON merge patch (RFC 7396) of a user's record: only the fields sent change;
    null clears the field (no override = the tier's or default rate; no tier; inherit the
    scope or enforcement)."""

    output_tokens_per_second: Rate | None = None
    tier: TierName | None = None
    scope: OwnScope = None
    enforcement: OwnEnforcement = None


class TierPatch(Body):
    """JSON merge patch of a tier: only the fields sent change; a rate of null is
    unlimited, a description of null is empty, a scope or enforcement of null inherits the
    default's."""

    output_tokens_per_second: Rate | None = None
    description: Description | None = None
    scope: OwnScope = None
    enforcement: OwnEnforcement = None


class DefaultIn(Body):
    output_tokens_per_second: Rate | None = None
    scope: Annotated[Scope | None, Field(description='null: "fleet"')] = None
    enforcement: Annotated[Enforcement | None, Field(description='null: "enforce"')] = None


class ShareOut(BaseModel):
    engine_id: str
    output_tokens_per_second: float = Field(description="The share this engine may enforce")


class LimitOut(BaseModel):
    user: str
    tier: str | None
    output_tokens_per_second: int | None = Field(description="The user's override, or null")
    effective_output_tokens_per_second: int | None = Field(description="null: unlimited")
    source: Source
    scope: Scope | None = Field(description="The user's own scope, or null (inherited)")
    enforcement: Enforcement | None = Field(
        description="The user's own enforcement, or null (inherited)"
    )
    effective_enforcement: Enforcement = Field(
        description='"shadow": the limit is counted, not enforced'
    )
    effective_scope: Scope
    shares: list[ShareOut] = Field(
        default=[],
        description="A fleet-scoped limit's shares per engine, by engine id; filled by "
        "GET /limits/{user} only ([] in lists and in write responses)",
    )
    version: int


class LimitDetail(LimitOut):
    """GET /limits/{user}: the view with what engines report right now."""

    received_output_tokens_per_second: float | None = Field(
        description="The user's output tokens/s over the last second, summed over engines "
        "(null: no engine reported the user recently)"
    )


class LimitPage(BaseModel):
    items: list[LimitOut]
    total: int


class BulkOut(BaseModel):
    version: int
    num_changed: int


class TierOut(BaseModel):
    name: str
    output_tokens_per_second: int | None
    scope: Scope | None = Field(description="The tier's own scope, or null (the default's)")
    enforcement: Enforcement | None = Field(
        description="The tier's own enforcement, or null (the default's)"
    )
    description: str
    num_users: int
    version: int


class TierList(BaseModel):
    items: list[TierOut]


class DefaultOut(BaseModel):
    output_tokens_per_second: int | None
    scope: Scope | None = Field(description='null: "fleet"')
    enforcement: Enforcement | None = Field(description='null: "enforce"')
    version: int
