"""API shapes every domain shares: the strict request body, the error body, and what the
OpenAPI schema says about errors and merge-patch bodies."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Path
from pydantic import BaseModel, ConfigDict, Field

from output_rate_core.ids import MAX_USER_ID_LEN, USER_ID_PATTERN

# A user id in a route's path (output_rate_core/ids.py).
UserPath = Annotated[str, Path(min_length=1, max_length=MAX_USER_ID_LEN, pattern=USER_ID_PATTERN)]


class Body(BaseModel):
    """A request body: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class FieldError(BaseModel):
    field: str
    msg: str
    type: str
    line: int | None = Field(
        default=None, description="A text body's line (1-based, blank lines counted)"
    )


class ErrorOut(BaseModel):
    """Every error response: a message naming the field, and the field itself."""

    detail: str
    field: str | None = None
    errors: list[FieldError] | None = None


class PreconditionFailedOut(ErrorOut):
    """412: a versioned write's If-Match is not the record's version; nothing was written."""

    current_version: int | None = Field(
        description="The record's version now, as its ETag names it (null: no such record)"
    )


class SessionOut(BaseModel):
    name: str = Field(description='"admin" or "viewer:<token name>"')
    can_write: bool


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: Literal["ready", "unready"]
    database: Literal["ok", "unreachable"]
    # This replica's id and whether it runs the fleet-wide work now (None: not served).
    replica: str | None
    leader: bool | None


# OpenAPI: the errors of every route (each domain's router), and of some.
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorOut, "description": "The body could not be read (e.g. not UTF-8)"},
    401: {"model": ErrorOut, "description": "Missing or wrong bearer token"},
    403: {"model": ErrorOut, "description": "A viewer token tried to write"},
    422: {"model": ErrorOut, "description": "Invalid input, naming the field"},
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorOut}}
CONFLICT: dict[int | str, dict[str, Any]] = {409: {"model": ErrorOut}}
PRECONDITION_FAILED: dict[int | str, dict[str, Any]] = {
    412: {
        "model": PreconditionFailedOut,
        "description": "If-Match names a version that is no longer the record's: nothing "
        "was written (the ETag header is the current one)",
    }
}

MERGE_PATCH = "application/merge-patch+json"


def merge_patch_body(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI: the body is accepted as application/json and as a JSON merge patch."""
    ref = {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": ref, MERGE_PATCH: ref},
        }
    }
