"""The vLLM server with the output-rate plugin but upstream's idle spin.

Baseline for bench/idle_cpu_bench.py only: the plugin's idle wait is replaced
by a no-op, so an all-throttled engine loops on upstream's 1 ms sleep, as it
would without the EngineCore patch. The replacement is at module level
because vLLM spawns the engine process, which re-imports this module as
``__mp_main__`` (the ``__main__`` block does not run there).
"""

from __future__ import annotations

import runpy
import sys

import engine_ext.engine_core as engine_core
from engine_ext.plugin import register

engine_core.idle_wait_after_step = lambda *args, **kwargs: None  # type: ignore[assignment]

if __name__ == "__main__":
    register()
    sys.argv[0] = "vllm.entrypoints.openai.api_server"
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
