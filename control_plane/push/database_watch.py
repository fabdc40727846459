"""Whether this replica reaches its database (replicas only; docs/replicas.md, "Failover").

A replica cut off from PostgreSQL (its connections terminated and refused, or black-holed)
serves its engines a configuration that no longer follows the database: changes and key
revocations written through the other replicas never reach them. So the push endpoint
watches the database: a thread of its own runs one round trip every PING_INTERVAL_S; when
none has succeeded for CUT_OFF_AFTER_S, the socket thread says Goodbye to every engine
(they move to the next replica at once) and turns new ones away with a Goodbye until a
round trip succeeds again.

A round trip that hangs (a black-holed connection) is not waited for: the watch judges by
the age of the last one that succeeded, and starts no second one meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

PING_INTERVAL_S = 0.5
# Two round trips missed, and a third late: a database away this long is taken for gone.
# Well under the heartbeat timeout (SERVER_SILENCE_S, 3.5 s): engines move on sooner than
# they would from a replica that died.
CUT_OFF_AFTER_S = 1.5


class DatabaseWatch:
    def __init__(
        self,
        ping: Callable[[], None],
        *,
        interval_s: float = PING_INTERVAL_S,
        cut_off_after_s: float = CUT_OFF_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``ping``: one round trip, raising when the database does not answer. The
        socket thread asks ``changed`` at every turn of its loop (at least every 100 ms)."""
        self._ping = ping
        self._interval_s = interval_s
        self._cut_off_after_s = cut_off_after_s
        self._clock = clock
        # When the last successful round trip started (it is as fresh as that).
        self._last_ok = clock()
        self._reachable = True
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="output-rate-database-watch", daemon=True
        )
        self.num_cut_offs = 0

    @property
    def reachable(self) -> bool:
        """Whether a round trip succeeded within CUT_OFF_AFTER_S (any thread)."""
        return self._clock() - self._last_ok <= self._cut_off_after_s

    def start(self) -> None:
        self._last_ok = self._clock()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        # A hung round trip is not waited for: the thread is a daemon.
        self._thread.join(timeout=self._interval_s * 2)

    def changed(self) -> bool | None:
        """On the socket thread: True when the database became reachable again since the
        last call, False when it was lost, None when nothing changed."""
        reachable = self.reachable
        if reachable == self._reachable:
            return None
        self._reachable = reachable
        if reachable:
            logger.warning("the database answers again: engines are welcome again")
        else:
            self.num_cut_offs += 1
            logger.error(
                "no answer from the database for %.1fs: saying goodbye to this replica's "
                "engines (they move to another replica) and turning new ones away until "
                "it answers",
                self._cut_off_after_s,
            )
        return reachable

    def _run(self) -> None:
        while not self._stop.is_set():
            started = self._clock()
            try:
                self._ping()
            except Exception as e:
                logger.debug("database round trip failed: %s", e)
            else:
                self._last_ok = started
            self._stop.wait(self._interval_s)
