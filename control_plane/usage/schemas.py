"""Live usage and usage history bodies."""

from __future__ import annotations

from pydantic import BaseModel, Field


class UsageOut(BaseModel):
    user: str
    output_tokens_per_second_1s: float
    output_tokens_per_second_10s: float
    limit: int | None = Field(description="The user's effective limit; null: unlimited")
    throttled_fraction: float
    would_throttle_fraction: float = Field(
        description="Of the user's request-steps, the share a shadow limit would have "
        "refused (they were served); 0 for users held by an enforced limit or none"
    )


class UsageList(BaseModel):
    items: list[UsageOut]


class HistorySeries(BaseModel):
    user: str
    output_tokens_per_second: list[float | None] = Field(
        description="Per bucket: tokens/s while reported; null = nothing reported (a gap)"
    )
    throttled_fraction: list[float | None]
    would_throttle_fraction: list[float | None]
    limit: list[float | None] = Field(
        description="Per bucket: the limit in force, time-weighted over the seconds a limit "
        "was in force (a bucket spanning a change averages both); null = unlimited throughout"
    )
    share_of_limit: list[float | None] = Field(
        description="Per bucket: tokens granted while a limit was in force over what that "
        "limit allowed in that time (1 = at the limit); null = unlimited throughout"
    )
    limited_fraction: list[float | None] = Field(
        description="Per bucket: the share of the reported seconds a limit was in force "
        "(below 1: partly unlimited)"
    )
    tokens: int
    throttled: int
    would_throttle: int


class FleetHistory(BaseModel):
    output_tokens_per_second: list[float | None] = Field(
        description="Per bucket: every user's tokens over the seconds reported (the users "
        "the history kept); null = nothing reported"
    )
    tokens: int


class UsageHistoryOut(BaseModel):
    since: int = Field(description="Unix time (s) of the first bucket")
    until: int
    step: int = Field(description="Seconds per bucket")
    retention_days: int
    times: list[int] = Field(description="Unix time (s) each bucket starts")
    items: list[HistorySeries]
    fleet: FleetHistory = Field(description="Every user together: the fleet's tokens/s")
