"""Engines whose Demand this replica flagged implausible (docs/fleet.md, "Trust";
control_plane/push/demand.py says what is): each flag is logged once per reason,
counted in the push metrics, and shown on that engine's row of GET /engines
(``implausible_demands``, ``last_implausible_demand_at``, ``last_implausible_demand``).

In memory, per replica: what GET /engines shows is what the replica answering it
flagged (the one the engine talks to). Written on the socket thread; read by REST
threads (one dict lookup).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

# Engine ids whose flags are kept; the least recently flagged goes first beyond it.
MAX_FLAGGED_IDS = 1024


@dataclass(frozen=True)
class Flagged:
    """What GET /engines shows of the implausible demand of one engine id."""

    # Frames that flagged it, and the last one's time and reason.
    num_flagged: int
    last_at: datetime
    last_reason: str


class FlaggedDemands:
    """Engine ids whose Demand this replica flagged implausible, for GET /engines."""

    def __init__(self) -> None:
        # engine id -> its flags, least recently flagged first (insertion order)
        self._by_id: dict[str, Flagged] = {}

    def of(self, engine_id: str) -> Flagged | None:
        """The flags of this engine id (any thread)."""
        return self._by_id.get(engine_id)

    def note(self, engine_id: str, reason: str) -> None:
        old = self._by_id.pop(engine_id, None)
        num = (old.num_flagged if old is not None else 0) + 1
        self._by_id[engine_id] = Flagged(num, datetime.now(UTC), reason)
        if len(self._by_id) > MAX_FLAGGED_IDS:
            del self._by_id[next(iter(self._by_id))]
