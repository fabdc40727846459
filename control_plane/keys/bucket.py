"""The bound on how fast this process creates API keys: a token bucket."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class TokenBucket:
    """`burst` tokens at most, refilled at `per_minute` a minute. Thread-safe: key
    creations run on the event loop or the writer thread (control_plane/db.py)."""

    def __init__(
        self, *, per_minute: int, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._rate_per_s = per_minute / 60.0
        self._burst = float(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()
        self._lock = threading.Lock()

    def take(self) -> float:
        """Take a token: 0.0 when one was there, else the seconds until one is (none taken)."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate_per_s)
            self._at = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return 0.0
            return (1.0 - self._tokens) / self._rate_per_s
