"""The effective-rate rule."""

from __future__ import annotations

from output_rate_core.limits import DEFAULT, OVERRIDE, TIER, effective_rate


def test_override_then_tier_then_default() -> None:
    assert effective_rate(7, "pro", 100, 20) == (7, OVERRIDE)
    assert effective_rate(None, "pro", 100, 20) == (100, TIER)
    assert effective_rate(None, "pro", None, 20) == (None, TIER)  # an unlimited tier
    assert effective_rate(None, None, None, 20) == (20, DEFAULT)
    assert effective_rate(None, None, None, None) == (None, DEFAULT)
