"""Startup verification on real vLLM configurations (tiny local model, no server).

Options vLLM accepts on this CPU are given on the real command line and go
through the plugin's ``create_engine_config``. Model kinds (multimodal,
encoder-decoder, hybrid, attention-free, diffusion) need models that are not
on this machine, so a real ``VllmConfig`` of the tiny model is changed at the
exact attribute vLLM derives the kind from (its HF config or model-registry
entry) and passed to ``verify_config``. A few of these also fail a real server
start in tests/e2e.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from vllm.config import MultiModalConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from engine_ext import vllm_compat
from engine_ext.config import OutputRateConfig
from engine_ext.plugin import register
from engine_ext.verify import OutputRateConfigError, verify_config
from harness.scheduler import TINY_MODEL

BASE = ["--model", str(TINY_MODEL), "--max-model-len", "512", "--enforce-eager"]
LIMIT = ["--default-user-output-tokens-per-second", "10"]


def engine_config(*flags: str) -> Any:
    register()
    args = vllm_compat.make_arg_parser(FlexibleArgumentParser()).parse_args([*BASE, *flags])
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def test_plain_configuration_passes() -> None:
    verify_config(engine_config(*LIMIT))


@pytest.mark.parametrize(
    ("flags", "option"),
    [
        (["--kv-offloading-size", "1"], "--kv-offloading-size"),
        (
            [
                "--ec-transfer-config",
                '{"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer"}',
            ],
            "--ec-transfer-config",
        ),
        (["--scheduler-cls", "vllm.v1.core.sched.scheduler.Scheduler"], "--scheduler-cls"),
    ],
)
def test_options_are_rejected_on_the_command_line(flags: list[str], option: str) -> None:
    with pytest.raises(OutputRateConfigError) as failure:
        engine_config(*LIMIT, *flags)
    message = str(failure.value)
    assert option in message
    assert "--default-user-output-tokens-per-second" in message


def test_the_same_options_without_limit_flags_are_left_to_vllm() -> None:
    config = engine_config("--kv-offloading-size", "1")
    assert config.kv_transfer_config is not None  # vLLM's own handling, untouched


def _multimodal(config: Any) -> None:
    config.model_config.multimodal_config = MultiModalConfig()


def _hf_flag(name: str, value: object, *, derived: str) -> Any:
    def change(config: Any) -> None:
        setattr(config.model_config.hf_config, name, value)
        config.model_config.__dict__.pop(derived, None)  # drop vLLM's cached_property value

    return change


def _registry_flag(name: str) -> Any:
    def change(config: Any) -> None:
        model = config.model_config
        model._model_info = dataclasses.replace(model._model_info, **{name: True})

    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_multimodal, "multimodal model"),
        (
            _hf_flag("is_encoder_decoder", True, derived="is_encoder_decoder"),
            "encoder-decoder model",
        ),
        (_registry_flag("is_hybrid"), "hybrid"),
        (_registry_flag("is_attention_free"), "attention-free model"),
        (_hf_flag("canvas_length", 16, derived="is_diffusion"), "diffusion model"),
    ],
)
def test_model_kinds_are_rejected(change: Any, message: str) -> None:
    config = engine_config(*LIMIT)
    change(config)
    with pytest.raises(OutputRateConfigError) as failure:
        verify_config(config)
    assert message in str(failure.value)
    assert "--model" in str(failure.value)


def test_one_message_names_the_first_problem_only() -> None:
    config = engine_config(*LIMIT)
    _multimodal(config)
    with pytest.raises(OutputRateConfigError) as failure:
        verify_config(config, user_scheduler_cls="my.Scheduler")
    assert "multimodal" in str(failure.value)
    assert "--scheduler-cls" not in str(failure.value)


def test_data_parallel_needs_a_control_plane_and_then_names_each_rank() -> None:
    with pytest.raises(OutputRateConfigError) as failure:
        engine_config(*LIMIT, "--data-parallel-size", "2")
    assert "--data-parallel-size > 1 without --control-plane-endpoint" in str(failure.value)
    endpoint = ["--control-plane-endpoint", "tcp://127.0.0.1:5557"]
    config = engine_config(
        *endpoint, "--output-rate-engine-id", "gpu-a", "--data-parallel-size", "2"
    )
    rate_config = OutputRateConfig.from_vllm_config(config)
    assert rate_config.data_parallel_size == 2
    assert [rate_config.engine_id_of_rank(r) for r in (0, 1)] == ["gpu-a-dp0", "gpu-a-dp1"]
    single = OutputRateConfig.from_vllm_config(
        engine_config(*endpoint, "--output-rate-engine-id", "gpu-a")
    )
    assert single.engine_id_of_rank(0) == "gpu-a"
