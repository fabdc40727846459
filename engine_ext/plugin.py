"""vLLM general plugin (entry point group ``vllm.general_plugins``).

``register()`` runs in every vLLM process, possibly several times, so every
patch is idempotent. In the API server process it adds the output-rate flags
to vLLM's own argument parser, carries them into
``VllmConfig.additional_config["output_rate"]``, verifies the configuration
and selects the scheduler subclass matching ``async_scheduling``. In the
engine-core process it patches the idle wait; in a multiproc worker process,
the busy window of the worker's input reader (engine_ext/worker_spin.py).
Every patch is a row of ``engine_ext.vllm_compat.PATCHES``; this module only
holds the replacements for vLLM's ``EngineArgs`` and OpenAI serving methods.
With none of the flags given, nothing changes: the scheduler is upstream's.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine_ext import vllm_compat
from engine_ext.config import CONFIG_KEY, OutputRateConfig

if TYPE_CHECKING:
    from engine_ext.identity import IdentityConfig

# A child of the "vllm" logger, so messages go through vLLM's own log configuration.
logger = logging.getLogger("vllm.output_rate." + __name__)

SYNC_SCHEDULER = "engine_ext.scheduler.OutputRateScheduler"
ASYNC_SCHEDULER = "engine_ext.scheduler.OutputRateAsyncScheduler"
# Set by the API server process when limiting is on. Extra API server processes
# (--api-server-count > 1) are spawned with the parsed arguments and build
# their EngineArgs before any plugin is loaded there, so they learn it from the
# environment they inherit.
LIMITING_ENV = "VLLM_OUTPUT_RATE_LIMITING"
# Imported by every OpenAI API server process (main and extra), not by engines.
API_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"


def register() -> None:
    vllm_compat.apply_patches(vllm_compat.PATCHES)
    if limiting_on() and API_SERVER_MODULE in sys.modules:
        _reject_beam_search()  # an extra API server process
        _install_metrics()
        _guard_connections()


def limiting_on() -> bool:
    return os.environ.get(LIMITING_ENV) == "1"


# ---- EngineArgs (rows of vllm_compat.PATCHES) -------------------------------


def wrap_add_cli_args(original: Callable[..., Any]) -> Callable[..., Any]:
    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original(parser, *args, **kwargs)
        from engine_ext.flags import add_flags

        add_flags(parser)
        return parser

    return add_cli_args


def wrap_from_cli_args(original: Callable[..., Any]) -> Callable[..., Any]:
    def from_cli_args(cls: Any, args: argparse.Namespace) -> Any:
        engine_args = original(cls, args)
        from engine_ext.flags import config_from_args, identity_from_args

        rate_config = config_from_args(args)
        _install_identity(args, identity_from_args(args, rate_config), rate_config.enabled)
        if rate_config.enabled:
            vllm_compat.check_vllm_version()
            engine_args.additional_config = {
                **(engine_args.additional_config or {}),
                CONFIG_KEY: rate_config.to_dict(),
            }
            os.environ[LIMITING_ENV] = "1"
            _reject_beam_search()
            _install_metrics()
            if rate_config.control_plane_endpoints:
                # Stopped engine cores get the time to tell the control plane they leave.
                vllm_compat.apply_patches(vllm_compat.SHUTDOWN_PATCHES)
        return engine_args

    return from_cli_args


def _install_identity(args: argparse.Namespace, identity: IdentityConfig, limiting: bool) -> None:
    """Header and api-key modes: our middleware in vLLM's own --middleware list (the last
    one added is outermost: it runs before vLLM's), its settings in the environment."""
    from engine_ext.identity import IDENTITY_ENV, MIDDLEWARE

    if identity.mode == "body":
        os.environ.pop(IDENTITY_ENV, None)
        if limiting:
            logger.warning(
                "output-rate: users are not authenticated: a request's user is the "
                "vllm_xargs.output_rate_user it sends (--output-rate-identity body); put the "
                "engine behind a gateway that overwrites it, or use --output-rate-identity "
                "header or api-key (docs/identity.md)"
            )
        return
    os.environ[IDENTITY_ENV] = identity.to_env()
    middleware = list(getattr(args, "middleware", None) or [])
    if MIDDLEWARE not in middleware:
        args.middleware = [*middleware, MIDDLEWARE]
    _guard_connections()


def _guard_connections() -> None:
    """API server process: the connection guard (engine_ext/http_server.py) in uvicorn,
    in header and api-key mode (the replacement reads the mode when the server starts)."""
    from engine_ext.identity import IdentityConfig

    if IdentityConfig.from_env().mode != "body":
        vllm_compat.apply_patches(vllm_compat.HTTP_GUARD_PATCHES)


def wrap_create_engine_config(original: Callable[..., Any]) -> Callable[..., Any]:
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        vllm_config = original(self, *args, **kwargs)
        rate_config = OutputRateConfig.from_vllm_config(vllm_config)
        if not rate_config.enabled:
            return vllm_config
        from engine_ext.verify import verify_config

        verify_config(
            vllm_config,
            user_scheduler_cls=self.scheduler_cls,
            has_control_plane=bool(rate_config.control_plane_endpoints),
        )
        num_ranks = vllm_config.parallel_config.data_parallel_size
        if num_ranks > 1:
            # Every rank's engine core joins the fleet as an engine of its own.
            rate_config = dataclasses.replace(rate_config, data_parallel_size=num_ranks)
            vllm_config.additional_config[CONFIG_KEY] = rate_config.to_dict()
        scheduler_config = vllm_config.scheduler_config
        scheduler_config.scheduler_cls = (
            ASYNC_SCHEDULER if scheduler_config.async_scheduling else SYNC_SCHEDULER
        )
        logger.info(
            "output-rate: limiting on (default %s tok/s, %d per-user limits, control plane %s), "
            "scheduler %s",
            rate_config.default_rate or "unlimited",
            len(rate_config.user_rates),
            ",".join(rate_config.control_plane_endpoints) or "none",
            scheduler_config.scheduler_cls,
        )
        return vllm_config

    return create_engine_config


def _install_metrics() -> None:
    """API server process of a limited server: engine figures on its /metrics."""
    from engine_ext.stat_logger import add_stats_field, install_stat_logger

    if add_stats_field():
        install_stat_logger()
    else:
        logger.warning("output-rate: SchedulerStats cannot carry engine metrics; not exported")


# ---- beam search (rows of vllm_compat.BEAM_SEARCH_PATCHES) -----------------

BEAM_SEARCH_MESSAGE = (
    "use_beam_search is not supported while per-user output-rate limiting is on: "
    "beam candidates do not sample one token per step"
)


def _reject_beam_search() -> None:
    """Answer beam-search requests with a 400 in the OpenAI server while limiting is on.

    Installed only in API server processes of a limited server (importing the
    serving modules elsewhere would slow every engine's start); only requests
    that ask for beam search read the environment.
    """
    vllm_compat.apply_patches(vllm_compat.BEAM_SEARCH_PATCHES)


def wrap_reject_beam_search(original: Callable[..., Any]) -> Callable[..., Any]:
    async def guarded(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(request, "use_beam_search", False) and limiting_on():
            return self.create_error_response(BEAM_SEARCH_MESSAGE)
        return await original(self, request, *args, **kwargs)

    return guarded
