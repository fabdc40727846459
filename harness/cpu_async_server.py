"""Test-only launcher: the vLLM OpenAI server with ``--async-scheduling`` kept on, on CPU.

vLLM 0.32.0's CPU platform switches async scheduling off in
``CpuPlatform.check_and_update_config`` ("not required on CPU") after vLLM has
already validated the flag. To run the real ``AsyncScheduler`` and the engine's
batch queue end to end on this CPU-only machine, this launcher restores the
requested value after that one call and then runs vLLM's own server entry
point. The output-rate plugin is loaded exactly as with the plain command; this
file is not part of the product (on GPUs ``vllm serve --async-scheduling``
needs nothing).
"""

from __future__ import annotations

from typing import Any


def keep_requested_async_scheduling() -> None:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        requested = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        if requested:
            vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]


if __name__ == "__main__":
    keep_requested_async_scheduling()
    from vllm.entrypoints.launchers.api_server.entry import main

    main()
