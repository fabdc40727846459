"""Startup verification: reject modes the per-user accounting cannot support.

Each check names the option that enabled the mode, so the operator knows what
to remove. The reasons: every data-parallel rank has its own
scheduler, so without a control plane each rank would be a budget of its own (with
one, every rank is a member of the fleet and fleet limits are shared,
docs/fleet.md); pipeline parallelism, non-standard attention models and
KV/EC connectors change scheduling or KV lifetimes in ways the skip, preempt
and refund logic was not built for.
"""

from __future__ import annotations

from typing import Any


class OutputRateConfigError(ValueError):
    """A vLLM configuration that per-user output-rate limiting rejects."""


def _problems(
    vllm_config: Any, *, user_scheduler_cls: object, has_control_plane: bool
) -> list[str]:
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    # KV offload is implemented as a KV connector, so it is checked first to
    # name the option the operator actually gave.
    checks: list[tuple[bool, str]] = [
        (
            parallel.data_parallel_size > 1 and not has_control_plane,
            "--data-parallel-size > 1 without --control-plane-endpoint (every rank would "
            "enforce its own budget; with a control plane the ranks share fleet limits)",
        ),
        (
            parallel.pipeline_parallel_size > 1,
            "--pipeline-parallel-size > 1 keeps several batches in flight",
        ),
        (model.is_multimodal_model, "a multimodal model (--model)"),
        (model.is_encoder_decoder, "an encoder-decoder model (--model)"),
        (model.is_hybrid, "a hybrid attention + SSM model (--model)"),
        (model.is_attention_free, "an attention-free model (--model)"),
        (model.is_diffusion, "a diffusion model (--model)"),
        (cache.kv_offloading_size is not None, "KV offload (--kv-offloading-size)"),
        (
            vllm_config.kv_transfer_config is not None,
            "a KV connector (--kv-transfer-config)",
        ),
        (
            vllm_config.ec_transfer_config is not None,
            "an EC connector (--ec-transfer-config)",
        ),
        (
            user_scheduler_cls is not None,
            f"a custom scheduler (--scheduler-cls {user_scheduler_cls})",
        ),
    ]
    return [message for failed, message in checks if failed]


def verify_config(
    vllm_config: Any, *, user_scheduler_cls: object = None, has_control_plane: bool = False
) -> None:
    """Raise ``OutputRateConfigError`` naming the first unsupported option."""
    problems = _problems(
        vllm_config, user_scheduler_cls=user_scheduler_cls, has_control_plane=has_control_plane
    )
    if problems:
        raise OutputRateConfigError(
            "per-user output-rate limiting (--default-user-output-tokens-per-second, "
            "--user-output-tokens-per-second, --control-plane-endpoint) cannot run with "
            + problems[0]
            + "; remove that option or the output-rate flags"
        )
