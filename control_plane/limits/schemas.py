"""Limit, tier and default-limit bodies. Strict: a rate is a JSON integer 1..1,000,000
or null; a scope is "fleet", "engine" or null (inherit); an enforcement is "enforce",
"shadow" or null (inherit); a ceiling is a JSON integer 1..1,000,000 or null (inherit;
the default's: no borrowing). That a ceiling is not below the rate is the plans' check
(control_plane/limits/plans.py): it needs the rate the write resolves to."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from control_plane.schemas import Body
from output_rate_core.ids import MAX_USER_ID_LEN, TIER_NAME_PATTERN, USER_ID_PATTERN
from output_rate_core.limits import Source
from output_rate_core.policy import Enforcement, Policy, Scope
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

CEILING = "ceiling_output_tokens_per_second"
OwnCeiling = Annotated[
    Rate | None,
    Field(
        description="Output tokens/s the user may reach by borrowing capacity no other "
        "user needs: at least the effective rate (below it: 422); equal to it, or at or "
        "below a rate set later, borrows nothing; null: inherit (the tier's, else the "
        "default's)"
    ),
]


class LimitIn(Body):
    output_tokens_per_second: Rate | None = None
    tier: TierName | None = None
    scope: OwnScope = None
    enforcement: OwnEnforcement = None
    ceiling_output_tokens_per_second: OwnCeiling = None

    @property
    def policy(self) -> Policy:
        """The user's own policy, as the body gives it."""
        return Policy(
            self.output_tokens_per_second,
            self.scope,
            self.enforcement,
            self.ceiling_output_tokens_per_second,
        )


class BulkItem(LimitIn):
    user: UserId


class BulkIn(Body):
    items: Annotated[list[BulkItem], Field(max_length=MAX_BULK_ITEMS)]


class TierIn(Body):
    output_tokens_per_second: Rate | None = None
    description: Description | None = None
    scope: OwnScope = None
    enforcement: OwnEnforcement = None
    ceiling_output_tokens_per_second: OwnCeiling = None


class LimitPatch(Body):
    """JSON merge patch (RFC 7396) of a user's record: only the fields sent change;
    null clears the field (no override = the tier's or default rate; no tier; inherit the
    scope, enforcement or ceiling)."""

    output_tokens_per_second: Rate | None = None
    tier: TierName | None = None
    scope: OwnScope = None
    enforcement: OwnEnforcement = None
    ceiling_output_tokens_per_second: OwnCeiling = None


class TierPatch(Body):
    """JSON merge patch of a tier: only the fields sent change; a rate of null is
    unlimited, a description of null is empty, a scope, enforcement or ceiling of null
    inherits the default's."""

    output_tokens_per_second: Rate | None = None
    description: Description | None = None
    scope: OwnScope = None
    enforcement: OwnEnforcement = None
    ceiling_output_tokens_per_second: OwnCeiling = None


class DefaultIn(Body):
    output_tokens_per_second: Rate | None = None
    scope: Annotated[Scope | None, Field(description='null: "fleet"')] = None
    enforcement: Annotated[Enforcement | None, Field(description='null: "enforce"')] = None
    ceiling_output_tokens_per_second: Annotated[
        Rate | None,
        Field(
            description="Output tokens/s users may borrow up to, at least the default rate; "
            "null: no borrowing"
        ),
    ] = None


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
    ceiling_output_tokens_per_second: int | None = Field(
        description="The user's own ceiling, or null (inherited)"
    )
    effective_ceiling_output_tokens_per_second: int | None = Field(
        description="Output tokens/s the user may reach by borrowing capacity no other user "
        "needs; null: none (the effective rate is a hard limit)"
    )
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
    ceiling_output_tokens_per_second: int | None = Field(
        description="The tier's own ceiling, or null (the default's)"
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
    ceiling_output_tokens_per_second: int | None = Field(description="null: no borrowing")
    version: int


# ---- previews (?dry_run=true on every limit write) -------------------------

# ?items_limit= of a preview: the items listed at most (the counts always cover them all).
MAX_PREVIEW_ITEMS = 10_000

Change = Literal["down", "up", "same"]


class ItemState(BaseModel):
    """A user's record and what it resolves to, before or after a change."""

    tier: str | None
    output_tokens_per_second: int | None = Field(description="The user's override, or null")
    effective_output_tokens_per_second: int | None = Field(description="null: unlimited")
    effective_scope: Scope
    effective_enforcement: Enforcement
    effective_ceiling_output_tokens_per_second: int | None = Field(description="null: no borrowing")


class LastHour(BaseModel):
    """The user's stored usage over the minutes of the last hour, against the rate the
    change would hold it to (each minute's tokens summed over engines, / 60)."""

    peak_output_tokens_per_second: float
    num_minutes_over_new_limit: int
    max_over_new_limit_output_tokens_per_second: float = Field(
        description="The most a minute exceeded the new held rate by (0: none did)"
    )


class PreviewItem(BaseModel):
    user: str
    change: Change = Field(
        description="How the held rate moves: the effective rate where the effective "
        "enforcement is enforce, unlimited under shadow"
    )
    created: bool = Field(description="The change creates the user's record")
    override_dropped: bool = Field(description="The user's override would be cleared")
    before: ItemState | None = Field(description="null: no record (the default applies)")
    after: ItemState | None = Field(description="null: no record (deleted, or never made)")
    last_hour: LastHour | None = Field(description="null: no usage stored in the last hour")


class ChangePreview(BaseModel):
    """What a write would change (?dry_run=true): nothing is written."""

    dry_run: Literal[True] = True
    version: int = Field(description="The config version the preview was computed at")
    num_users: int = Field(description="Users listed, or whose record or effective limit changes")
    num_down: int
    num_up: int
    num_same: int
    num_created: int
    num_overrides_dropped: int
    num_records_unchanged: int = Field(
        description="Listed users whose stored record (tier, override, scope, enforcement) "
        "the write leaves as it is, such as a bulk line equal to it"
    )
    num_over_new_limit: int = Field(
        description="Of the users whose held rate falls: those that used more than the new "
        "rate in some minute of the last hour"
    )
    items: list[PreviewItem] = Field(
        description="Cuts first (largest relative cut first), then raises, then unchanged"
    )
    items_truncated: bool = Field(description="More users than ?items_limit=; counts are exact")
