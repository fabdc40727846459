"""Request bodies. Strict: a rate is a JSON integer 1..1,000,000 or null."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

MAX_RATE = 1_000_000
USER_ID_PATTERN = r"^[^\x00-\x1f\x7f]+$"
TIER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"

Rate = Annotated[int, Field(strict=True, ge=1, le=MAX_RATE)]
TierName = Annotated[str, Field(strict=True, pattern=TIER_NAME_PATTERN)]
UserId = Annotated[str, Field(strict=True, min_length=1, max_length=256, pattern=USER_ID_PATTERN)]


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
    description: Annotated[str, Field(strict=True, max_length=1000)] | None = None


class DefaultIn(_Body):
    output_tokens_per_second: Rate | None = None


class TokenIn(_Body):
    name: Annotated[str, Field(strict=True, min_length=1, max_length=128, pattern=USER_ID_PATTERN)]
