"""Engine metrics: bounded user cardinality, token intervals, the snapshot and its rendering."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine_ext.metrics import (
    INTERVAL_BUCKETS,
    NO_TIER,
    OTHER_USER,
    EngineMetrics,
    MetricsSnapshot,
    OutputRateCollector,
    SchedulerFigures,
    decode_snapshot,
    encode_snapshot,
)

MS = 1_000_000


class FakeClock:
    def __init__(self) -> None:
        self.ns = 1_000 * MS

    def __call__(self) -> int:
        return self.ns


def make_metrics(max_users: int = 3, idle_s: float = 60.0) -> tuple[EngineMetrics, FakeClock]:
    clock = FakeClock()
    return EngineMetrics(max_users=max_users, idle_s=idle_s, clock_ns=clock), clock


def figures(**overrides: Any) -> SchedulerFigures:
    args: dict[str, Any] = {
        "rate_of": lambda user: 20 if user.startswith("slow") else None,
        "default_rate": None,
        "is_unlimited": False,
        "num_reclaims": 0,
        "num_reclaimed_tokens": 0,
        "config_version": None,
        "connected": None,
        "tier_of": lambda user: None,
    }
    return SchedulerFigures(**{**args, **overrides})


def snapshot(metrics: EngineMetrics, **overrides: Any) -> MetricsSnapshot:
    # Through the bytes the engine-core process sends, as the API server gets them.
    return decode_snapshot(encode_snapshot(metrics.snapshot(figures(**overrides))))


def samples(payload: MetricsSnapshot, clock: Any = None) -> dict[str, dict[tuple, float]]:
    """name -> {sorted label items: value}, as Prometheus would scrape them."""
    collector = OutputRateCollector(clock=clock or (lambda: 0.0))
    collector.update(0, "tiny", payload)
    registry = CollectorRegistry()
    registry.register(collector)
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def user_values(rendered: dict[str, dict[tuple, float]], name: str) -> dict[str, float]:
    return {dict(labels)["user"]: v for labels, v in rendered.get(name, {}).items()}


def test_more_users_than_k_fold_into_other_and_counts_add_up() -> None:
    metrics, _ = make_metrics(max_users=3)
    granted = {f"u{i}": 10 * (i + 1) for i in range(6)}  # u5 most active
    metrics.add_usage(granted, {"u0": 4})
    rendered = samples(snapshot(metrics))
    values = user_values(rendered, "vllm:output_rate_granted_tokens_total")
    # The three most active users get series; the rest are one value.
    assert set(values) == {"u5", "u4", "u3", OTHER_USER}
    assert values[OTHER_USER] == 10 + 20 + 30
    assert sum(values.values()) == sum(granted.values())
    throttled = user_values(rendered, "vllm:output_rate_throttled_steps_total")
    assert throttled[OTHER_USER] == 4 and throttled["u5"] == 0
    assert rendered["vllm:output_rate_tracked_users"] == {
        (("engine", "0"), ("model_name", "tiny")): 3
    }


def test_series_are_cumulative_and_a_slot_frees_when_a_user_goes_idle() -> None:
    metrics, clock = make_metrics(max_users=1, idle_s=10)
    metrics.add_usage({"a": 5}, {})
    clock.ns += 1_000 * MS
    metrics.add_usage({"a": 7, "b": 3}, {})
    values = user_values(samples(snapshot(metrics)), "vllm:output_rate_granted_tokens_total")
    assert values == {"a": 12, OTHER_USER: 3}
    clock.ns += 11_000 * MS  # a idle for 11 s
    values = user_values(samples(snapshot(metrics)), "vllm:output_rate_granted_tokens_total")
    assert values == {OTHER_USER: 3}
    metrics.add_usage({"b": 2}, {})
    values = user_values(samples(snapshot(metrics)), "vllm:output_rate_granted_tokens_total")
    assert values == {"b": 2, OTHER_USER: 3}


def test_collector_drops_users_idle_since_the_last_snapshot() -> None:
    """An idle engine sends no stats; the API server ages the last snapshot itself."""
    metrics, _ = make_metrics(idle_s=10)
    metrics.add_usage({"a": 5}, {})
    payload = snapshot(metrics)
    now = [100.0]
    collector = OutputRateCollector(clock=lambda: now[0])
    collector.update(0, "tiny", payload)
    registry = CollectorRegistry()
    registry.register(collector)
    assert 'user="a"' in generate_latest(registry).decode()
    now[0] += 11
    assert 'user="a"' not in generate_latest(registry).decode()


def test_a_user_named_like_the_fold_value_is_folded() -> None:
    metrics, _ = make_metrics(max_users=3)
    metrics.add_usage({OTHER_USER: 2, "a": 1}, {})
    values = user_values(samples(snapshot(metrics)), "vllm:output_rate_granted_tokens_total")
    assert values == {"a": 1, OTHER_USER: 2}


def test_intervals_of_throttled_users_only_per_tier() -> None:
    metrics, clock = make_metrics()
    tiers = {"slow": "bronze"}
    metrics.add_usage({"slow": 1, "fast": 1}, {"slow": 3}, tiers.get)
    # on_step gets the scheduler's running counts since the last add_usage.
    for i in range(1, 6):  # one token every 50 ms for both users
        clock.ns += 50 * MS
        metrics.on_step({"slow": i, "fast": i}, 2)
    clock.ns += 50 * MS
    metrics.on_step({"slow": 8, "fast": 5}, 0)  # 3 streams in one step: an interval, 2 zeros
    clock.ns += 10 * MS
    metrics.on_step({"slow": 8, "fast": 6}, 0)  # no token for slow: nothing recorded
    rendered = samples(snapshot(metrics))
    counts = rendered["vllm:output_rate_token_interval_seconds_count"]
    assert counts == {(("engine", "0"), ("model_name", "tiny"), ("tier", "bronze")): 4 + 1 + 2}
    buckets = {
        dict(labels)["le"]: v
        for labels, v in rendered["vllm:output_rate_token_interval_seconds_bucket"].items()
    }
    assert buckets["0.025"] == 2  # the zeros
    assert buckets["0.05"] == 7 and buckets["+Inf"] == 7
    total = rendered["vllm:output_rate_token_interval_seconds_sum"]
    assert abs(next(iter(total.values())) - 5 * 0.05) < 1e-9
    assert rendered["vllm:output_rate_throttled_requests"] == {
        (("engine", "0"), ("model_name", "tiny")): 0
    }


def test_a_user_not_throttled_for_two_intervals_is_no_longer_watched() -> None:
    metrics, clock = make_metrics()
    metrics.add_usage({}, {"slow": 1})
    metrics.on_step({"slow": 1}, 0)
    metrics.add_usage({"slow": 1}, {})  # still watched (throttled one interval ago)
    metrics.add_usage({}, {})  # no longer
    clock.ns += 3_000 * MS
    metrics.on_step({"slow": 1}, 0)
    rendered = samples(snapshot(metrics))
    assert next(iter(rendered["vllm:output_rate_token_interval_seconds_count"].values())) == 0
    # Users without a tier are labelled NO_TIER.
    labels = dict(next(iter(rendered["vllm:output_rate_token_interval_seconds_count"])))
    assert labels["tier"] == NO_TIER


def test_limits_versions_and_reclaims_are_rendered() -> None:
    metrics, _ = make_metrics()
    metrics.add_usage({"slow-1": 1, "fast": 1}, {})
    rendered = samples(
        snapshot(
            metrics,
            default_rate=500,
            num_reclaims=3,
            num_reclaimed_tokens=120,
            config_version=7,
            connected=True,
        )
    )
    assert user_values(rendered, "vllm:output_rate_user_limit_tokens_per_second") == {"slow-1": 20}
    engine = (("engine", "0"), ("model_name", "tiny"))
    assert rendered["vllm:output_rate_default_limit_tokens_per_second"] == {engine: 500}
    assert rendered["vllm:output_rate_slot_reclaims_total"] == {engine: 3}
    assert rendered["vllm:output_rate_reclaimed_tokens_total"] == {engine: 120}
    assert rendered["vllm:output_rate_config_version"] == {engine: 7}
    assert rendered["vllm:output_rate_control_plane_connected"] == {engine: 1}
    # Without a control plane neither series exists.
    rendered = samples(snapshot(metrics))
    assert "vllm:output_rate_config_version" not in rendered
    assert "vllm:output_rate_control_plane_connected" not in rendered


def test_buckets_are_sorted() -> None:
    assert list(INTERVAL_BUCKETS) == sorted(INTERVAL_BUCKETS)


def test_fleet_figures_are_rendered_only_with_a_control_plane() -> None:
    metrics, _ = make_metrics()
    engine = (("engine", "0"), ("model_name", "tiny"))
    rendered = samples(snapshot(metrics, fleet_size=3, num_shares=2, shares_leased=False))
    assert rendered["vllm:output_rate_fleet_engines"] == {engine: 3}
    assert rendered["vllm:output_rate_fleet_shares"] == {engine: 2}
    assert rendered["vllm:output_rate_fleet_lease_valid"] == {engine: 0}
    assert "vllm:output_rate_fleet_engines" not in samples(snapshot(metrics))


def test_would_throttle_steps_are_counted_per_user_under_the_label_cap() -> None:
    metrics, _ = make_metrics(max_users=2)
    granted = {"s1": 50, "s2": 40, "s3": 5}
    metrics.add_usage(granted, {}, would_throttle={"s1": 30, "s3": 4})
    metrics.add_usage({"s1": 10}, {}, would_throttle={"s1": 2})
    rendered = samples(snapshot(metrics))
    would = user_values(rendered, "vllm:output_rate_would_throttle_steps_total")
    assert would == {"s1": 32, "s2": 0, OTHER_USER: 4}  # s3 folded, as its tokens are
    assert user_values(rendered, "vllm:output_rate_throttled_steps_total")["s1"] == 0


def test_borrowed_tokens_are_counted_per_user_under_the_label_cap() -> None:
    metrics, _ = make_metrics(max_users=2)
    metrics.add_usage({"b1": 50, "b2": 40, "b3": 5}, {}, borrowed={"b1": 30, "b3": 4})
    metrics.add_usage({"b1": 10}, {}, borrowed={"b1": 2})
    rendered = samples(snapshot(metrics))
    borrowed = user_values(rendered, "vllm:output_rate_borrowed_tokens_total")
    assert borrowed == {"b1": 32, "b2": 0, OTHER_USER: 4}  # b3 folded, as its tokens are
    granted = user_values(rendered, "vllm:output_rate_granted_tokens_total")
    assert granted == {"b1": 60, "b2": 40, OTHER_USER: 5}  # borrowed ones are granted too
