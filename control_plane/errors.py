"""Domain errors raised by services; mapped to HTTP in one place (app.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from output_rate_core.ids import PATTERN_RULES


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

    @property
    def extra(self) -> dict[str, Any]:
        """Fields of the error body besides detail, field and errors (app.py)."""
        return {}


class NotFound(DomainError):
    status_code = 404


class Conflict(DomainError):
    status_code = 409


class InvalidInput(DomainError):
    status_code = 422


# A field as an operator names it (any other: its name with spaces).
_FIELD_WORDS = {
    "user": "user id",
    "output_tokens_per_second": "rate",
    "engine_id": "engine id",
    "target_kind": "target kind",
    "before_id": "before id",
    "items_limit": "items limit",
}


def field_words(loc: Sequence[Any]) -> str:
    """("body", "items", 3, "user") -> "user id": the innermost named field, in words."""
    names = [p for p in loc if isinstance(p, str) and p not in ("body", "path", "query")]
    name = names[-1] if names else "request body"
    return _FIELD_WORDS.get(name, name.replace("_", " "))


def _rule(kind: str, ctx: Mapping[str, Any], msg: str) -> str:
    """The rule a value broke, in words ("must be at least 1"), from pydantic's error."""
    if kind == "string_pattern_mismatch":
        return PATTERN_RULES.get(ctx.get("pattern", ""), "holds characters that are not allowed")
    bounds = {
        "greater_than_equal": ("must be at least", "ge"),
        "greater_than": ("must be more than", "gt"),
        "less_than_equal": ("must be at most", "le"),
        "less_than": ("must be less than", "lt"),
        "string_too_long": ("must be at most {:,} characters", "max_length"),
        "too_long": ("may hold at most {:,} items", "max_length"),
        "string_too_short": ("must be at least {:,} characters", "min_length"),
        "too_short": ("must hold at least {:,} items", "min_length"),
    }
    if kind in bounds and bounds[kind][1] in ctx:
        words, key = bounds[kind]
        value = ctx[key]
        if kind == "string_too_short" and value == 1:
            return "may not be empty"
        return words.format(value) if "{}" in words else f"{words} {value:,}"
    fixed = {
        "missing": "is required",
        "extra_forbidden": "is not a field of this request",
        "int_parsing": "must be a whole number",
        "int_type": "must be a whole number",
        "int_from_float": "must be a whole number",
        "string_type": "must be text",
        "bool_parsing": "must be true or false",
        "bool_type": "must be true or false",
        "json_invalid": "is not valid JSON",
        "model_attributes_type": "must be a JSON object",
        "dict_type": "must be a JSON object",
        "model_type": "must be a JSON object",
        "list_type": "must be a list",
        "float_parsing": "must be a number",
        "float_type": "must be a number",
        "datetime_parsing": "must be a date and time (ISO 8601)",
        "datetime_from_date_parsing": "must be a date and time (ISO 8601)",
        "datetime_type": "must be a date and time (ISO 8601)",
    }
    if kind in fixed:
        return fixed[kind]
    if kind in ("literal_error", "enum"):
        return f"must be {ctx.get('expected', 'one of the allowed values')}"
    return msg.removeprefix("Value error, ")


def rule_words(error: Mapping[str, Any]) -> str:
    """A pydantic error as an operator says it, the field then the rule: "rate must be at
    least 1", "user id may not contain '/', ..." (never a pattern or pydantic's wording)."""
    subject = field_words(error.get("loc", ()))
    rule = _rule(str(error.get("type", "")), error.get("ctx") or {}, str(error.get("msg", "")))
    # A validator's own message may name the field already.
    return rule if rule.startswith(subject) else f"{subject} {rule}"


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
