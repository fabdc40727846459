"""Worker patch: a multiproc worker of a throttled engine parks between steps.

With the multiproc executor (vLLM's CPU platform always uses it; GPUs with
tensor parallelism too) the model runs in worker processes that read every
step from a shared-memory ``MessageQueue``. Its reader (``SpinCondition``)
busy-polls with ``sched_yield`` for ``busy_loop_s`` = 1 s after each read
before it parks on a ZMQ notify socket; vLLM 0.32.0 passes no other value and
no setting changes it. An engine whose requests are all throttled still sends
a step at least every 50 ms (the idle wait's cap, or sooner when a budget
returns), so the worker never parks and burns a whole core.

With limiting on, the worker's own input reader gets a short busy window,
counted from the moment the worker starts waiting for the next step (upstream
counts from the last read, i.e. it includes the model's run time). Under load
the next step arrives within the engine core's own gap between steps (output
processing and ``schedule()``: well under a millisecond with async scheduling,
a few ms with large sync batches), so the worker spins exactly as upstream
does. A longer gap means the engine core is idle or waiting, and then parking
costs one ZMQ wake-up (tens of microseconds) on a gap of milliseconds.

After a step that scheduled no token there is no window at all: the engine
core sends such a step only when every request was refused (it then waits
for a budget to return, up to 50 ms), so the worker parks at once.

Only the worker's input reader of an engine with limiting on is touched; the
engine core's reader of worker results and every other queue keep vLLM's
behaviour. If vLLM's internals differ from what this expects, the patch logs
a warning and leaves the reader as it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from engine_ext import vllm_compat
from engine_ext.config import OutputRateConfig
from engine_ext.vllm_compat import PATCHED_MARK

# A child of the "vllm" logger, so messages go through vLLM's own log configuration.
logger = logging.getLogger("vllm.output_rate." + __name__)

# Long enough to cover the engine core's gap between back-to-back steps under
# load, short enough that a throttled engine's steps (tens of ms apart) leave
# the worker parked most of the time.
BUSY_WINDOW_S = 0.005


def shorten_reader_spin(
    spin: Any,
    busy_window_s: float = BUSY_WINDOW_S,
    *,
    park_at_once: Callable[[], bool] = lambda: False,
) -> bool:
    """Make a ``SpinCondition`` reader spin ``busy_window_s`` from the start of each wait,
    or not at all when ``park_at_once()`` says so at the start of the wait.

    Returns False (and changes nothing) if ``spin`` does not look like vLLM
    0.32.0's reader: a reader flag, float ``busy_loop_s`` and ``last_read``, a
    callable ``wait``. Idempotent.
    """
    if getattr(spin, PATCHED_MARK, False):
        return True
    if not (
        getattr(spin, "is_reader", False) is True
        and isinstance(getattr(spin, "busy_loop_s", None), (int, float))
        and isinstance(getattr(spin, "last_read", None), float)
        and callable(getattr(spin, "wait", None))
    ):
        return False
    original_wait = spin.wait
    # The last_read value this wrapper wrote; any other value means a read
    # finished since (upstream's record_read), so a new wait period begins.
    seen = [spin.last_read]

    def wait(*args: Any, **kwargs: Any) -> Any:
        if spin.last_read != seen[0]:
            # Upstream measures the window from the read, before the model ran;
            # measuring from here makes it independent of the model's step time.
            now = time.monotonic()
            if park_at_once():
                now -= busy_window_s + 1.0  # the window is already over
            spin.last_read = seen[0] = now
        return original_wait(*args, **kwargs)

    spin.busy_loop_s = busy_window_s
    spin.wait = wait
    setattr(spin, PATCHED_MARK, True)
    return True


def park_idle_worker(worker_proc: Any) -> None:
    """Shorten the busy window of a ``WorkerProc``'s input reader when limiting is on."""
    vllm_config = getattr(getattr(worker_proc, "worker", None), "vllm_config", None)
    if not OutputRateConfig.from_vllm_config(vllm_config).enabled:
        return
    spins, spin = vllm_compat.worker_input_reader(worker_proc)
    if not spins:
        return
    upstream_s = getattr(spin, "busy_loop_s", None)
    # [whether the last step the worker ran scheduled no token]
    last_step_empty = [False]
    if not shorten_reader_spin(spin, park_at_once=lambda: last_step_empty[0]):
        logger.warning(
            "output-rate: the worker's input queue reader is not the expected SpinCondition "
            "(vLLM internals changed?); it keeps vLLM's busy-poll while the engine is throttled"
        )
        return
    _note_empty_steps(worker_proc.worker, last_step_empty)
    logger.info(
        "output-rate: worker input reader spins %.1f ms from the start of each wait "
        "(vLLM: %s s from each read), then parks; after a step with no token it parks at once",
        spin.busy_loop_s * 1000,
        upstream_s,
    )


def _note_empty_steps(worker: Any, last_step_empty: list[bool]) -> None:
    """Wrap ``worker.execute_model`` (once) to set ``last_step_empty[0]`` for each step.

    Without that method (vLLM internals changed) the flag stays False: the worker keeps
    the short window after every step.
    """
    execute_model = getattr(worker, "execute_model", None)
    if not callable(execute_model) or getattr(execute_model, PATCHED_MARK, False):
        return

    def execute_model_noting_empty(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        num_tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        last_step_empty[0] = num_tokens == 0
        return execute_model(scheduler_output, *args, **kwargs)

    setattr(execute_model_noting_empty, PATCHED_MARK, True)
    worker.execute_model = execute_model_noting_empty


def wrap_worker_busy_loop(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``WorkerProc.worker_busy_loop`` (a row of vllm_compat.PATCHES).

    General plugins are loaded in a worker from ``init_worker`` inside
    ``WorkerProc.__init__``, before its message queues exist; the busy loop
    starts after they do, so the reader is adjusted there, in the worker.
    """

    def worker_busy_loop(self: Any) -> Any:
        try:
            park_idle_worker(self)
        except Exception:  # never let an optimisation stop a worker from serving
            logger.exception("output-rate: could not adjust the worker's input reader")
        return original(self)

    return worker_busy_loop
