"""vLLM 0.32.0 glue that carries engine metrics to vLLM's own ``/metrics``.

The scheduler runs in the engine-core process; ``/metrics`` is served by the
API server process from prometheus_client's default registry. vLLM already
moves one object between the two every step: the ``SchedulerStats`` that
``Scheduler.make_stats()`` returns rides on ``EngineCoreOutputs`` (msgpack)
to the API server, whose ``StatLoggerManager`` hands it to every stat logger.
So (docs/metrics.md):

1. ``SchedulerStats`` (a dataclass) gets one more field, ``output_rate``
   (default ``None``), in the API server (when the flags are parsed) and in
   the engine core (scheduler constructor), so msgspec encodes and decodes
   it (``vllm_compat.add_scheduler_stats_field``).
2. The output-rate scheduler's ``make_stats`` puts a snapshot there about once
   a second (engine_ext/metrics.py).
3. In API server processes of a limited server, the stat logger factories
   AsyncLLM loads (``vllm.v1.engine.async_llm.load_stat_logger_plugin_factories``,
   the function behind the ``vllm.stat_logger_plugins`` entry point group; a
   row of ``vllm_compat.METRICS_PATCHES``) also return ``OutputRateStatLogger``,
   which feeds ``OutputRateCollector`` on the default registry. This is the
   same as declaring the entry point, but only for limited servers and with
   no change to a server without limits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from engine_ext import vllm_compat
from engine_ext.config import OutputRateConfig
from engine_ext.metrics import PAYLOAD_FIELD, EngineMetrics, OutputRateCollector, decode_snapshot

logger = logging.getLogger("vllm.output_rate." + __name__)

# One collector per process on prometheus_client's default registry.
COLLECTOR = OutputRateCollector()
_registered = False


def add_stats_field() -> bool:
    """``SchedulerStats`` carries the snapshot (idempotent). True if it round-trips."""
    return vllm_compat.add_scheduler_stats_field(PAYLOAD_FIELD)


def stat_logger_class() -> type:
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase

    class OutputRateStatLogger(AggregateStatLoggerBase):
        """Hands each engine's output-rate snapshot to the collector."""

        def __init__(self, vllm_config: Any, engine_indexes: list[int]) -> None:
            self.model_name = str(vllm_config.model_config.served_model_name)
            register_collector()

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            payload = getattr(scheduler_stats, PAYLOAD_FIELD, None)
            if payload is not None:
                COLLECTOR.update(engine_idx, self.model_name, decode_snapshot(payload))

        def log_engine_initialized(self) -> None:
            pass

    return OutputRateStatLogger


def register_collector() -> None:
    global _registered
    if _registered:
        return
    from prometheus_client import REGISTRY

    REGISTRY.register(COLLECTOR)
    _registered = True


def install_stat_logger() -> None:
    """Make AsyncLLM (API server process) load ``OutputRateStatLogger`` (idempotent)."""
    vllm_compat.apply_patches(vllm_compat.METRICS_PATCHES)


def wrap_load_stat_logger_plugin_factories(original: Callable[[], list[Any]]) -> Callable[..., Any]:
    """A row of ``vllm_compat.METRICS_PATCHES``: the factories plus the output-rate logger."""
    logger_cls = stat_logger_class()

    def load_stat_logger_plugin_factories() -> list[Any]:
        return [*original(), logger_cls]

    return load_stat_logger_plugin_factories


def engine_metrics_for(config: OutputRateConfig, log_stats: bool) -> EngineMetrics | None:
    """The scheduler's metrics (engine-core process), or None when vLLM keeps no stats."""
    if not log_stats:
        return None
    if not add_stats_field():
        logger.warning(
            "output-rate: vLLM's SchedulerStats does not carry the output_rate field; "
            "engine metrics are off"
        )
        return None
    return EngineMetrics(max_users=config.metrics_max_users, idle_s=config.metrics_idle_s)
