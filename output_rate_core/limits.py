"""The effective-rate rule, the one definition both sides use.

A user's effective rate is its override if set, else its tier's rate, else the
default; ``None`` is unlimited.
"""

from __future__ import annotations

from typing import Literal

Source = Literal["override", "tier", "default"]
OVERRIDE: Source = "override"
TIER: Source = "tier"
DEFAULT: Source = "default"


def effective_rate(
    override: int | None, tier: str | None, tier_rate: int | None, default_rate: int | None
) -> tuple[int | None, Source]:
    """(effective rate, where it comes from) of a user; ``tier_rate`` is ``tier``'s rate."""
    if override is not None:
        return override, OVERRIDE
    if tier is not None:
        return tier_rate, TIER
    return default_rate, DEFAULT
