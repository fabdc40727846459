"""Live usage and usage history bodies."""

from __future__ import annotations

from pydantic import BaseModel, Field


class UsageOut(BaseModel):
    user: str
    output_tokens_per_second_1s: float
    output_tokens_per_second_10s: float
    borrowed_output_tokens_per_second_1s: float = Field(
        description="Of output_tokens_per_second_1s, the tokens lent beyond the user's limit "
        "(borrowed idle capacity, up to its ceiling); the rest were within its limit"
    )
    borrowed_output_tokens_per_second_10s: float = Field(description="The same over the last 10 s")
    limit: int | None = Field(description="The user's effective limit; null: unlimited")
    ceiling: int | None = Field(
        description="The user's effective ceiling (tokens/s it may reach by borrowing); "
        "null: no borrowing"
    )
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
    borrowed_output_tokens_per_second: list[float | None] = Field(
        description="Per bucket: of output_tokens_per_second, the tokens/s lent beyond the "
        "user's limit (borrowed up to its ceiling); null = nothing reported"
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
    borrowed: int = Field(description="Of tokens, those borrowed beyond the limit")


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
