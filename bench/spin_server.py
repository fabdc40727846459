"""The vLLM server with the output-rate plugin but upstream's idle spin.

Baseline for bench/idle_cpu_bench.py only. ``BENCH_UPSTREAM`` (a comma list,
default ``engine,worker``) names the plugin's idle patches replaced by no-ops:

- ``engine``: the EngineCore idle wait, so an all-throttled engine loops on
  upstream's 1 ms sleep;
- ``worker``: the worker's short input-reader busy window, so the worker
  busy-polls for vLLM's 1 s after every step.

The replacement is at module level because vLLM spawns the engine process and
the engine spawns its worker; both re-import this module as ``__mp_main__``
(the ``__main__`` block does not run there) and inherit the variable.
"""

from __future__ import annotations

import os
import runpy
import sys

import engine_ext.engine_core as engine_core
import engine_ext.worker_spin as worker_spin
from engine_ext.plugin import register

UPSTREAM_ENV = "BENCH_UPSTREAM"
_upstream = set(os.environ.get(UPSTREAM_ENV, "engine,worker").split(","))
if "engine" in _upstream:
    engine_core.idle_wait_after_step = lambda *args, **kwargs: None  # type: ignore[assignment]
if "worker" in _upstream:
    worker_spin.park_idle_worker = lambda *args, **kwargs: None  # type: ignore[assignment]

if __name__ == "__main__":
    register()
    sys.argv[0] = "vllm.entrypoints.openai.api_server"
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
