"""A pytest plugin that runs vLLM's own scheduler tests with the output-rate schedulers.

Used as ``-p harness.upstream_tests`` on the tests of a vLLM source release
(``tests/v1/core`` of its sdist, unpacked by scripts/setup.sh; scripts/test_vllm_releases.sh
runs them).
vLLM's tests build their schedulers through ``Scheduler`` / ``AsyncScheduler``
(module globals of their helpers and test modules) and their models through
``ModelConfig``; after collection this plugin rebinds those names:

- ``Scheduler`` / ``AsyncScheduler``: the output-rate subclasses, with the limits
  of ``OUTPUT_RATE_UPSTREAM_LIMIT`` (``none``: no limit configured, the plugin's
  straight path; ``not-binding``: a default of 1,000,000 tok/s, so the planner, the
  admission gate and settle run on every step while no request is ever refused).
  ``OUTPUT_RATE_UPSTREAM_SCHEDULER=upstream`` keeps vLLM's own classes: the baseline
  that tells a failure of the plugin from one of this environment.
- ``ModelConfig``: the tests' default model (``facebook/opt-125m``, from the model
  hub, which this machine cannot reach) becomes the local tiny Llama; the scheduler
  reads only the model's lengths and kind from it. A test that asks for any other
  hub model is skipped, naming it.

vLLM's root conftest (models, images, servers: nothing the scheduler tests use) is not
loaded (``--noconftest``); the one fixture of it they use, ``caplog_vllm``, is below. On a
CUDA wheel without a GPU the platform is "unspecified"; it is given the CPU as its device.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from engine_ext.config import CONFIG_KEY, OutputRateConfig
from engine_ext.scheduler import OutputRateAsyncScheduler, OutputRateScheduler
from harness.scheduler import TINY_MODEL
from harness.vllm_release import check_expected_vllm, header

HUB_MODEL = "facebook/opt-125m"
LIMITS = {
    "none": OutputRateConfig(),
    "not-binding": OutputRateConfig(default_rate=1_000_000),
}


def _limits() -> OutputRateConfig:
    return LIMITS[os.environ.get("OUTPUT_RATE_UPSTREAM_LIMIT", "none")]


# How many output-rate schedulers the session built (named in its summary).
NUM_BUILT = {"sync": 0, "async": 0}


class LimitedScheduler(OutputRateScheduler):
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        vllm_config.additional_config[CONFIG_KEY] = _limits().to_dict()
        super().__init__(vllm_config, *args, **kwargs)
        NUM_BUILT["sync"] += 1


class LimitedAsyncScheduler(OutputRateAsyncScheduler):
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        vllm_config.additional_config[CONFIG_KEY] = _limits().to_dict()
        super().__init__(vllm_config, *args, **kwargs)
        NUM_BUILT["async"] += 1


def _local_model_config(model_config_cls: Any) -> Any:
    def model_config(*args: Any, model: str = HUB_MODEL, **kwargs: Any) -> Any:
        if os.path.isdir(model):  # a model the test wrote itself
            return model_config_cls(*args, model=model, **kwargs)
        if model != HUB_MODEL:
            pytest.skip(f"needs {model} from the model hub (not reachable here)")
        kwargs.setdefault("tokenizer", str(TINY_MODEL))
        return model_config_cls(*args, model=str(TINY_MODEL), **kwargs)

    return model_config


@pytest.fixture
def caplog_vllm(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog for vLLM's own loggers, which do not propagate to the root logger."""
    vllm_logger = logging.getLogger("vllm")
    propagate = vllm_logger.propagate
    vllm_logger.propagate = True
    try:
        with caplog.at_level(logging.INFO):
            yield caplog
    finally:
        vllm_logger.propagate = propagate


def pytest_report_header(config: pytest.Config) -> list[str]:
    scheduler = os.environ.get("OUTPUT_RATE_UPSTREAM_SCHEDULER", "plugin")
    limit = os.environ.get("OUTPUT_RATE_UPSTREAM_LIMIT", "none")
    return [f"{header()}: its own tests; scheduler: {scheduler}, limit: {limit}"]


def pytest_configure(config: pytest.Config) -> None:
    check_expected_vllm()
    from vllm.platforms import current_platform

    # vLLM's CUDA wheels find no platform on this machine, and their tests' configs ask
    # it for the device ("auto"). The device is the CPU (vLLM's CPU platform itself,
    # VLLM_TARGET_DEVICE=cpu, wants triton-cpu from 0.34 on); the scheduler never uses it.
    if current_platform.is_unspecified():
        current_platform.device_type = "cpu"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(
        f"output-rate schedulers built: {NUM_BUILT['sync']} sync, {NUM_BUILT['async']} async"
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    from vllm.config import ModelConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    swap = os.environ.get("OUTPUT_RATE_UPSTREAM_SCHEDULER", "plugin") == "plugin"
    replacements: dict[type, Any] = {ModelConfig: _local_model_config(ModelConfig)}
    if swap:
        replacements |= {Scheduler: LimitedScheduler, AsyncScheduler: LimitedAsyncScheduler}
    for name, module in list(sys.modules.items()):
        if not name.startswith("tests.") or module is None:
            continue
        for attribute, value in list(vars(module).items()):
            replacement = replacements.get(value) if isinstance(value, type) else None
            if replacement is not None:
                setattr(module, attribute, replacement)
