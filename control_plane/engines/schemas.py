"""Engine status bodies."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class EngineOut(BaseModel):
    engine_id: str
    model: str
    vllm_version: str | None = Field(
        description="vLLM version the engine core runs, as it said when it connected; "
        "null: not known (an engine whose vllm-output-rate predates it)",
    )
    applied_version: int
    connected: bool
    last_seen: datetime
    first_seen: datetime
    num_shared_users: int = Field(description="Fleet-scoped users it holds a share for")
    api_applied_version: int | None = Field(
        description="Config version the engine's API server applied (its API keys); "
        "null: no API server of this engine is connected",
    )
    home: str | None = Field(
        description="Replica (OUTPUT_RATE_REPLICA_ID) the engine core is connected to; "
        "null: no replica holds it now",
    )
    refused_claims: int = Field(
        description="Connections refused this engine id because it was live (two engines "
        "with one id), counted by the replica answering since it started",
    )
    last_refused_claim_at: datetime | None = Field(
        description="When the last such claim was refused; null: none was",
    )
    last_refused_claim_from: str | None = Field(
        description="The address the last refused claim came from ('' when unknown); "
        "null: none was refused",
    )
    implausible_demands: int = Field(
        description="Demand frames of this engine flagged implausible (more streams than any "
        "queue of its capacity, or demand for too many users), counted by the replica "
        "answering since it started",
    )
    last_implausible_demand_at: datetime | None = Field(
        description="When the last such frame came; null: none was flagged",
    )
    last_implausible_demand: str | None = Field(
        description="What the last such frame claimed, e.g. '9007199254740992 streams of "
        "one user (capacity 256)'; null: none was flagged",
    )


class EngineList(BaseModel):
    version: int
    items: list[EngineOut]
