"""Domain errors raised by services; mapped to HTTP in one place (app.py)."""

from __future__ import annotations


class DomainError(Exception):
    status_code = 400

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class NotFound(DomainError):
    status_code = 404


class Conflict(DomainError):
    status_code = 409


class InvalidInput(DomainError):
    status_code = 422


class ConfigurationError(Exception):
    """The server was asked to start in an unsafe or impossible configuration."""
