"""The path of engine metrics through vLLM: SchedulerStats field, make_stats, stat logger."""

from __future__ import annotations

import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine_ext import stat_logger
from engine_ext.metrics import (
    PAYLOAD_FIELD,
    EngineMetrics,
    OutputRateCollector,
    decode_snapshot,
    encode_snapshot,
)
from engine_ext.push_client import PushClient
from harness.scheduler import FakeClock, drive, make_request, make_scheduler
from harness.scripted_server import ScriptedServer
from output_rate_core import protocol as p
from tests.engine_ext.test_metrics import figures, samples


def test_stats_field_survives_vllms_engine_output_encoding_and_is_added_once() -> None:
    from vllm.v1.metrics.stats import SchedulerStats

    assert stat_logger.add_stats_field()
    fields = dict(SchedulerStats.__dataclass_fields__)
    assert stat_logger.add_stats_field()
    assert SchedulerStats.__dataclass_fields__ == fields
    assert SchedulerStats().output_rate is None  # type: ignore[attr-defined]


def test_install_stat_logger_is_idempotent_and_adds_one_factory() -> None:
    import vllm.v1.engine.async_llm as async_llm

    original = async_llm.load_stat_logger_plugin_factories
    try:
        stat_logger.install_stat_logger()
        stat_logger.install_stat_logger()
        factories = async_llm.load_stat_logger_plugin_factories()
        names = [f.__name__ for f in factories]
        assert names.count("OutputRateStatLogger") == 1
    finally:
        async_llm.load_stat_logger_plugin_factories = original


def test_stat_logger_feeds_the_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase
    from vllm.v1.metrics.stats import SchedulerStats

    collector = OutputRateCollector()
    monkeypatch.setattr(stat_logger, "COLLECTOR", collector)
    monkeypatch.setattr(stat_logger, "_registered", True)
    cls = stat_logger.stat_logger_class()
    assert issubclass(cls, AggregateStatLoggerBase)

    class Config:
        class model_config:
            served_model_name = "tiny"

    logger: Any = cls(Config(), [0])
    stat_logger.add_stats_field()
    metrics = EngineMetrics()
    metrics.add_usage({"a": 3}, {"a": 1})
    stats = SchedulerStats()
    logger.record(stats, None)  # no payload: nothing recorded
    setattr(
        stats,
        PAYLOAD_FIELD,
        encode_snapshot(metrics.snapshot(figures(rate_of=lambda user: 5))),
    )
    logger.record(stats, None, engine_idx=0)
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert (
        'vllm:output_rate_granted_tokens_total{engine="0",model_name="tiny",user="a"} 3.0' in text
    )


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_scheduler_counts_match_tokens_and_only_the_limited_user_is_throttled(
    async_scheduling: bool,
) -> None:
    clock = FakeClock()
    sched: Any = make_scheduler(
        async_scheduling=async_scheduling, user_rates={"slow": 20}, clock=clock
    )
    # make_scheduler builds it with log_stats=False (also in the KV cache manager).
    from vllm.v1.metrics.stats import PrefixCacheStats

    sched.log_stats = True
    sched.kv_cache_manager.make_prefix_cache_stats = PrefixCacheStats
    assert stat_logger.add_stats_field()
    sched.output_rate_metrics = EngineMetrics(clock_ns=clock)
    sched.output_rate_planner.count_granted = True  # as the constructor does with metrics
    slow = [make_request("slow", max_tokens=1000) for _ in range(2)]
    fast = [make_request("fast", max_tokens=1000)]
    for request in slow + fast:
        sched.add_request(request)
    trace = drive(sched, num_steps=300, clock=clock, step_ms=10)  # 3 s
    sched._next_usage_report_ns = 0  # flush the last interval's counts
    drive(sched, num_steps=1, clock=clock)
    # make_stats attaches a snapshot at most once a second.
    clock.advance_ms(1000)
    stats = sched.make_stats()
    payload = decode_snapshot(getattr(stats, PAYLOAD_FIELD))
    assert getattr(sched.make_stats(), PAYLOAD_FIELD) is None
    users = payload.users
    slow_tokens = len(trace.times_of({r.request_id for r in slow}))
    fast_tokens = len(trace.times_of({r.request_id for r in fast}))
    # Granted counts equal sampled tokens (the last step's grants are sampled after the trace).
    assert users["slow"].num_granted - slow_tokens in (0, 1, 2)
    assert users["fast"].num_granted - fast_tokens in (0, 1)
    assert users["slow"].num_throttled > 0 and users["fast"].num_throttled == 0
    assert users["slow"].rate == 20 and users["fast"].rate is None
    assert payload.num_throttled_resident in (1, 2)
    # Intervals: only the throttled user, spaced 1/20 s on engine time.
    ((tier, values),) = payload.intervals.items()
    assert tier == "(none)"
    counts, total = values.counts, values.sum_s
    # Watched from the first usage report on (after 1 s): ~2 s at 20 tok/s.
    assert sum(counts) > 30
    assert 0.045 < total / sum(counts) < 0.055
    # Limits lifted: schedule() takes upstream's path; nobody is throttled any more.
    sched.output_rate_limiter.replace_all(None, {})
    drive(sched, num_steps=3, clock=clock)
    clock.advance_ms(1000)
    last = decode_snapshot(getattr(sched.make_stats(), PAYLOAD_FIELD))
    assert last.num_throttled_resident == 0


def test_an_idle_engine_publishes_its_link_to_the_control_plane_when_it_changes() -> None:
    """A refused engine id is seen on /metrics while no request runs: the idle engine sends
    its figures when the refusals (or its sync) change, and nothing when they do not."""
    clock = FakeClock()
    sched: Any = make_scheduler(default_rate=5, clock=clock)
    from vllm.v1.metrics.stats import PrefixCacheStats

    sched.log_stats = True
    sched.kv_cache_manager.make_prefix_cache_stats = PrefixCacheStats
    assert stat_logger.add_stats_field()
    sched.output_rate_metrics = EngineMetrics(clock_ns=clock)
    published: list[Any] = []
    sched.output_rate_publish_stats = published.append
    server = ScriptedServer()
    client = PushClient(
        endpoints=[server.endpoint], engine_id="dup", model="tiny", server_public_key=None
    )
    client.start()
    try:
        sched.attach_push_client(client)
        identity, _ = server.recv(p.Hello)
        assert not sched.has_requests()  # idle: its first figures go out
        assert [decode_snapshot(getattr(s, PAYLOAD_FIELD)).refusals for s in published] == [{}]
        assert not sched.has_requests()
        assert len(published) == 1  # nothing changed: nothing sent
        server.send(identity, p.Refused("engine_id_in_use", "another live connection holds it"))
        deadline = time.monotonic() + 10
        while not client.refusals:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not sched.has_requests()
        payload = decode_snapshot(getattr(published[-1], PAYLOAD_FIELD))
        assert payload.refusals == {"engine_id_in_use": 1}
        assert payload.connected is False
        # Rendered with every reason, so the first refusal is an increase from 0.
        rendered = samples(payload)["vllm:output_rate_control_plane_refusals_total"]
        assert {dict(labels)["reason"]: v for labels, v in rendered.items()} == {
            "engine_id_in_use": 1,
            "engine_id_not_allowed": 0,
            "server_full": 0,
        }
    finally:
        client.close()
        server.close()
        sched.shutdown()
