"""Rate bounds, the one definition: integers 1 ... 1,000,000 tokens/s, or None = unlimited.

Pure Python; the limiter, the wire protocol, the engine's flags, the REST
schemas and the database checks all use these.
"""

from __future__ import annotations

MIN_RATE = 1
MAX_RATE = 1_000_000


def validate_rate(rate: object, *, field: str = "rate") -> int | None:
    """Return ``rate`` if it is a valid limit (int in range, or None = unlimited)."""
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, int):
        raise TypeError(f"{field} must be an integer or null, got {type(rate).__name__}")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(f"{field} must be between {MIN_RATE} and {MAX_RATE} tokens/s, got {rate}")
    return rate
