"""The usage series on /metrics: per user, tokens/s and the throttled and would-throttle
fractions side by side (a fake clock, the one seam; a real registry and exposition)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from control_plane.usage.book import UsageBook
from control_plane.usage.metrics import UsageCollector
from output_rate_core import protocol as p
from tests.control_plane.factories import FakeClock


def per_user(registry: CollectorRegistry, name: str) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {
        s.labels["user"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_would_throttle_fraction_is_exported_next_to_the_throttled_one() -> None:
    clock = FakeClock()
    book = UsageBook(clock)
    registry = CollectorRegistry()
    registry.register(UsageCollector(book))
    # a: 30 steps served, 10 of them a shadow limit would have refused; b: enforced,
    # 5 served and 15 refused; c: neither.
    book.add(p.Usage("e1", 1.0, {"a": 30, "b": 5, "c": 2}, {"b": 15}, would_throttle={"a": 10}))
    throttled = per_user(registry, "output_rate_user_throttled_fraction")
    would = per_user(registry, "output_rate_user_would_throttle_fraction")
    assert throttled == {"a": 0.0, "b": 0.75, "c": 0.0}
    assert would == pytest.approx({"a": 1 / 3, "b": 0.0, "c": 0.0})
    # The same users as the throttled series (one label set each, the book's bound on
    # users), and gone with them once the window passed.
    clock.now += 11.0
    assert per_user(registry, "output_rate_user_would_throttle_fraction") == {}
    assert per_user(registry, "output_rate_user_throttled_fraction") == {}
