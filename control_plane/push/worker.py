"""A thread that runs the push server's database work, so that the socket thread never
waits on the database.

The socket thread submits a job with what to do with its result; the worker runs the
jobs one at a time, in the order submitted, and hands each result back through a queue,
waking the socket thread, which applies it (``deliver``). So a job reads or writes rows
and nothing else: peers are only ever touched on the socket thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# After a job fails (a database hiccup), the next one waits this long.
ERROR_BACKOFF_S = 0.5
# How long closing waits for the jobs it finishes.
CLOSE_TIMEOUT_S = 10.0

# (the job, what the socket thread does with its result, and what it does if it raised)
_Job = tuple[Callable[[], Any], Callable[[Any], None] | None, Callable[[], None] | None]


class DatabaseWorker:
    def __init__(self, name: str, wake: Callable[[], None]) -> None:
        """``wake``: makes the socket thread look at what came back (any thread)."""
        self._wake = wake
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # Results, as calls for the socket thread to make, in the order the jobs ran.
        self._done: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def submit(
        self,
        job: Callable[[], T],
        then: Callable[[T], None] | None = None,
        failed: Callable[[], None] | None = None,
    ) -> None:
        """Run ``job`` on the worker, then ``then(result)`` on the socket thread (None: a
        write whose result nobody needs); if the job raises (logged), ``failed()`` there
        instead. Any thread."""
        self._jobs.put((job, then, failed))

    def ready(self, result: T, then: Callable[[T], None]) -> None:
        """``then(result)`` on the socket thread for a result that needed no job (it was
        in memory): handed back as a job's is, behind the results handed back before it.
        Any thread."""
        self._hand_back(partial(then, result))

    def deliver(self) -> None:
        """The socket thread: apply the results that came back, in order (one that
        raises leaves the rest for the next call)."""
        while True:
            try:
                apply = self._done.get_nowait()
            except queue.Empty:
                return
            apply()

    def start(self) -> None:
        self._thread.start()

    def close(self, *, finish: bool) -> None:
        """Stop once the jobs submitted so far ran (``finish``), or once the running one
        did (the rest are dropped). Their results are not delivered."""
        if not finish:
            self._stopping.set()
            while True:
                try:
                    self._jobs.get_nowait()
                except queue.Empty:
                    break
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=CLOSE_TIMEOUT_S)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, then, failed = item
            try:
                result = job()
            except Exception:
                logger.exception("output-rate push: database work failed")
                if failed is not None:
                    self._hand_back(failed)
                self._stopping.wait(ERROR_BACKOFF_S)
                continue
            if then is not None:
                self._hand_back(partial(then, result))

    def _hand_back(self, apply: Callable[[], None]) -> None:
        self._done.put(apply)
        self._wake()
