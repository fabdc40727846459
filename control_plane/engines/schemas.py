"""Engine status bodies."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class EngineOut(BaseModel):
    engine_id: str
    model: str
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


class EngineList(BaseModel):
    version: int
    items: list[EngineOut]
