"""Claims of a live engine id this replica refused: two engines with one id (docs/live-push.md,
"Engine ids").

A second engine that claims an id another live connection holds is refused (the first
keeps it: it is the one the fleet and GET /engines know). Such a clash is an operator's
mistake that must not go unseen: each refusal is logged as an error naming both peers
(the claimant's and the holder's addresses), counted per engine id, and shown on that
engine's row of GET /engines (``refused_claims``, ``last_refused_claim_at``,
``last_refused_claim_from``). The refused engine is told why (a ``Refused`` frame) and
says so in its own log and metrics.

In memory, per replica: what GET /engines shows is what the replica answering it refused
(an engine retries on the replica it talks to, so the one that refuses it keeps
refusing it). Written on the socket thread; read by REST threads (one dict lookup).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

logger = logging.getLogger(__name__)

# Engine ids whose refusals are kept; the least recently refused goes first beyond it.
MAX_CLAIMED_IDS = 1024
# A refused engine claims again with every heartbeat (1 s): one log line per id this
# often, with the number of refusals since the last.
LOG_INTERVAL_S = 5.0


@dataclass(frozen=True)
class RefusedClaim:
    """What GET /engines shows of the refused claims of one engine id."""

    num_refused: int
    last_at: datetime
    # The address of the connection refused last ("" when unknown, e.g. ipc).
    last_from: str


class RefusedClaims:
    def __init__(self) -> None:
        # engine id -> its refusals, least recently refused first (insertion order)
        self._by_id: dict[str, RefusedClaim] = {}
        # engine id -> (when it may be logged again, refusals not logged since)
        self._log_due: dict[str, tuple[float, int]] = {}
        self.total = 0

    def of(self, engine_id: str) -> RefusedClaim | None:
        """The refusals of this engine id (any thread)."""
        return self._by_id.get(engine_id)

    def note(self, engine_id: str, role: str, *, claimant: str, holder: str, held_for: str) -> None:
        """A claim of ``engine_id`` from the address ``claimant`` was refused: the live
        connection from ``holder`` has it (``held_for``: since when it was heard, or
        which replica holds it)."""
        self.total += 1
        old = self._by_id.pop(engine_id, None)
        self._by_id[engine_id] = RefusedClaim(
            (old.num_refused if old is not None else 0) + 1, datetime.now(UTC), claimant
        )
        if len(self._by_id) > MAX_CLAIMED_IDS:
            forgotten = next(iter(self._by_id))
            del self._by_id[forgotten]
            self._log_due.pop(forgotten, None)
        now = time.monotonic()
        due, num_unlogged = self._log_due.get(engine_id, (0.0, 0))
        if now < due:
            self._log_due[engine_id] = (due, num_unlogged + 1)
            return
        self._log_due[engine_id] = (now + LOG_INTERVAL_S, 0)
        since = f" ({num_unlogged} more since the last line)" if num_unlogged else ""
        logger.error(
            "refused engine id %r (%s) to the connection from %s: the live connection from "
            "%s holds it (%s)%s; two engines share this id: give each a unique "
            "--output-rate-engine-id",
            engine_id,
            role,
            claimant or "?",
            holder or "?",
            held_for,
            since,
        )
