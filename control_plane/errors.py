"""Domain errors raised by services; mapped to HTTP in one place (app.py)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple


class DomainError(Exception):
    status_code = 400
    # Several errors at once (the error body's "errors"), or None: only `field`.
    errors: list[dict[str, Any]] | None = None

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    @property
    def headers(self) -> dict[str, str]:
        """Headers of the HTTP response (app.py)."""
        return {}


class NotFound(DomainError):
    status_code = 404


class Conflict(DomainError):
    status_code = 409


class InvalidInput(DomainError):
    status_code = 422


class LineProblem(NamedTuple):
    """What is wrong with one line of a text body (a CSV bulk import)."""

    line: int  # 1-based, counting every line as the operator wrote it
    field: str
    reason: str


class InvalidLines(InvalidInput):
    """Bad lines of a text body: every one named by its line (the first MAX_REPORTED)."""

    MAX_REPORTED = 50

    def __init__(self, problems: list[LineProblem]) -> None:
        problems = sorted(problems)
        shown = problems[: self.MAX_REPORTED]
        messages = [f"line {p.line}: {p.field}: {p.reason}" for p in shown]
        more = len(problems) - len(shown)
        detail = "; ".join(messages) + (f"; and {more} more errors" if more else "")
        super().__init__(detail, field="items")
        self.errors = [
            {"field": p.field, "line": p.line, "msg": m, "type": "invalid_line"}
            for p, m in zip(shown, messages, strict=True)
        ]


class TooManyRequests(DomainError):
    """A rate bound was hit; the client may retry after `retry_after_s`."""

    status_code = 429

    def __init__(self, message: str, *, retry_after_s: float, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        # Retry-After takes whole seconds: rounded up, so a retry then succeeds.
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class ConfigurationError(Exception):
    """The server was asked to start in an unsafe or impossible configuration."""
