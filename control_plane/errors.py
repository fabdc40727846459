"""Domain errors raised by services; mapped to HTTP in one place (app.py)."""

from __future__ import annotations

import math


class DomainError(Exception):
    status_code = 400

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
