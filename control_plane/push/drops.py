"""Engine messages the push server drops: counted by reason, logged without flooding."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# Malformed or refused engine messages: the first of each kind is logged, then one
# summary line per this interval with the counts.
DROP_LOG_INTERVAL_S = 60.0


class DropLog:
    """Counts dropped engine messages by reason; logs the first of each reason at once
    and then one summary per interval (a flood of bad frames is not a flood of lines).
    Used on the socket thread only; other threads read ``total``."""

    def __init__(self, interval_s: float = DROP_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.total = 0
        self._seen: set[str] = set()
        # reason -> drops since the last summary
        self._pending: dict[str, int] = {}
        self._next_summary = 0.0

    def note(self, reason: str, detail: str = "") -> None:
        self.total += 1
        if reason not in self._seen:
            self._seen.add(reason)
            shown = f" ({detail})" if detail else ""
            logger.warning("dropped an engine message: %s%s", reason, shown)
            return
        self._pending[reason] = self._pending.get(reason, 0) + 1

    def flush(self, now: float) -> None:
        if now < self._next_summary:
            return
        self._next_summary = now + self.interval_s
        if self._pending:
            counts = ", ".join(f"{n} {reason}" for reason, n in sorted(self._pending.items()))
            logger.warning("dropped engine messages in the last %.0fs: %s", self.interval_s, counts)
            self._pending.clear()
