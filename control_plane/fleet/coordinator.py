"""The fleet allocator at work: fed the limit model and what engines say, on the push
server's thread; read by REST threads (it is their ``FleetView``).

The push server calls it for every bound engine's message (``heard``, ``on_demand``,
``on_ack``), after it reads the change log (``catch_up``) and on every loop turn
(``step``), and sends the ``Shares`` frames it returns. The limit model is the one both
sides use (output_rate_core.limits.LimitModel), kept at the change log's newest
version by a log follower (control_plane/config/follower.py); only users some engine
reported demand for are given to the allocator.

Epochs: each time an engine (re)joins the allocator it gets a fresh epoch, so its
share sequence starts over and the engine takes the first full table of the new epoch
whatever sequence number it held (docs/fleet.md).

Quiet start: a coordinator that takes over from another (a new leader replica,
docs/replicas.md) knows nothing of the shares its predecessor gave out, which engines
enforce until their lease ends. Until ``quiet_until`` it listens (demand, engines) and
sends nothing, so every engine is on its safe shares, or on its predecessor's, never on
a mix of both allocators' shares. It is also told the engines the fleet had
(``await_engines``): they count in the fleet size at once, and it stays quiet until each
has said its whole demand (or ``SEED_WAIT_S`` passed), since one it has not heard yet
may be serving any user on its safe share.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable

from control_plane.config.follower import Catchup, LogFollower
from control_plane.fleet.allocator import FleetAllocator, ShareUpdate
from output_rate_core import protocol as p
from output_rate_core.limits import EVERYONE, FLEET
from output_rate_core.outage import DEFAULT_OUTAGE, OutagePolicy

# Users nobody reports demand for any more are dropped from the tracked set this often.
TRACKED_SWEEP_INTERVAL_S = 30.0
# A successor's quiet start outlasts its predecessor's last lease by this much: the
# delivery of the predecessor's last message (a relayed one waits for its batch).
TAKEOVER_MARGIN_S = 1.0
# How long a new coordinator waits for the whole demand of the engines the fleet had: an
# engine whose replica stopped moves to the next after SERVER_SILENCE_S (3.5 s) and
# says its whole demand after its snapshot; one still connected restates it every 5 s.
SEED_WAIT_S = 15.0


def quiet_until(predecessor_stopped_at: float, lease_s: float, kept_s: float = 0.0) -> float:
    """When a coordinator may send its first shares: every lease its predecessor, which
    sent nothing after ``predecessor_stopped_at`` (monotonic), gave out has ended, and the
    time engines keep their shares past it (``kept_s``: the "keep" outage policy)."""
    return predecessor_stopped_at + lease_s + kept_s + TAKEOVER_MARGIN_S


class FleetCoordinator:
    def __init__(
        self,
        *,
        lease_s: float,
        gone_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        quiet_until: float = -math.inf,
        outage: OutagePolicy = DEFAULT_OUTAGE,
    ) -> None:
        self._clock = clock
        self.quiet_until = quiet_until
        self._allocator = FleetAllocator(
            clock=clock, lease_s=lease_s, gone_after_s=gone_after_s, outage=outage
        )
        # Every Shares frame carries the outage policy (engines apply it at lease end).
        self._outage = outage
        self._outage_keep_ms = round(outage.keep_s * 1000)
        self._lock = threading.Lock()
        self._limits = LogFollower()
        # Users the allocator was given a limit for.
        self._tracked: set[str] = set()
        self._next_sweep = clock() + TRACKED_SWEEP_INTERVAL_S
        # Ordered across coordinators (a restart, a new leader): microseconds of the wall
        # clock at its start, one more per join. An engine refuses a full table of a lower
        # epoch while its lease holds (a delayed frame of an allocator that is gone); a
        # clock behind makes the new one wait for that lease, no more (docs/fleet.md).
        self._epochs = itertools.count(time.time_ns() // 1000)
        # engine id -> the epoch of its current membership
        self._epoch_of: dict[str, int] = {}
        # Engines of the fleet not heard with their whole demand yet, and until when
        # the coordinator waits for them.
        self._awaited: set[str] = set()
        self._awaited_until = -math.inf

    # ---- the push thread ------------------------------------------------------

    @property
    def num_engines(self) -> int:
        return max(1, self._allocator.num_engines)

    @property
    def gone_after_s(self) -> float:
        return self._allocator.gone_after_s

    def size_with(self, joining: Iterable[str]) -> int:
        """The fleet size once ``joining`` are in it (those it knows count once)."""
        with self._lock:
            known = self._allocator.knows_engine
            return max(1, self._allocator.num_engines + sum(not known(e) for e in set(joining)))

    def catch_up(self, catchup: Catchup) -> None:
        """Bring the limit model to the change log's newest version (`catchup`: read by the
        push server's log reader at the model's version); the users it tracks whose limit a
        change may have moved get their new limit."""
        if catchup.up_to_date:
            return
        changed: set[str] | None = set()

        def note(users: set[str] | None) -> None:
            nonlocal changed
            changed = None if users is EVERYONE or changed is None else changed | users

        self._limits.apply(catchup, note)
        with self._lock:
            self._retarget(self._tracked if changed is None else changed & self._tracked)

    def await_engines(self, engine_ids: Iterable[str], *, wait_s: float = SEED_WAIT_S) -> None:
        """The fleet had these engines: count them now, stay quiet until each said its
        whole demand (at most ``wait_s``)."""
        with self._lock:
            for engine_id in engine_ids:
                self._join(engine_id)
                self._awaited.add(engine_id)
            self._awaited_until = self._clock() + wait_s

    def heard(self, engine_id: str) -> None:
        with self._lock:
            self._join(engine_id)

    def on_demand(self, engine_id: str, demand: p.Demand) -> list[tuple[str, p.Shares]]:
        with self._lock:
            self._join(engine_id)
            for user, num_streams in demand.streams.items():
                if num_streams and user not in self._tracked:
                    self._tracked.add(user)
                    self._allocator.set_limit(user, self._limit_of(user))
            self._allocator.set_demand(
                engine_id,
                demand.streams,
                full=demand.full,
                over_capacity=demand.over_capacity,
                stalled=demand.stalled,
                evidenced=demand.evidenced,
            )
            if demand.full:
                self._awaited.discard(engine_id)
            if self.quiet:
                return []  # the first step after the quiet start sends full tables
            frames = self._frames(self._allocator.step())
            if demand.full:
                # After a snapshot or a gap the engine asks for everything it holds.
                frames.append(self._frame(engine_id, self._allocator.full_update(engine_id)))
            return frames

    def leave(self, engine_id: str) -> list[tuple[str, p.Shares]]:
        """The engine stopped cleanly (it said Leaving): out of the fleet now. Its parts go
        to the engines still serving each of its users and every engine's safe share
        grows with the smaller fleet, in the frames returned (none while quiet: the
        first step after it sends full tables)."""
        with self._lock:
            self._allocator.remove_engine(engine_id)
            self._epoch_of.pop(engine_id, None)
            self._awaited.discard(engine_id)
            if self.quiet:
                return []
            return self._frames(self._allocator.step())

    def on_ack(self, engine_id: str, ack: p.ShareAck) -> bool:
        """False: an ack of another epoch (a membership this engine no longer has)."""
        with self._lock:
            if self._epoch_of.get(engine_id) != ack.epoch:
                return False
            self._allocator.acked(engine_id, ack.seq)
            return True

    @property
    def quiet(self) -> bool:
        now = self._clock()
        return now < self.quiet_until or (bool(self._awaited) and now < self._awaited_until)

    def step(self) -> list[tuple[str, p.Shares]]:
        with self._lock:
            if self.quiet:
                return []
            frames = self._frames(self._allocator.step())
            now = self._clock()
            if now >= self._next_sweep:
                self._next_sweep = now + TRACKED_SWEEP_INTERVAL_S
                self._tracked = {u for u in self._tracked if self._allocator.knows_user(u)}
                self._epoch_of = {
                    e: epoch
                    for e, epoch in self._epoch_of.items()
                    if self._allocator.knows_engine(e)
                }
            return frames

    # ---- FleetView (any thread) ---------------------------------------------------

    def shares_of(self, user: str) -> dict[str, int]:
        with self._lock:
            return self._allocator.shares_of(user)

    def num_shared_users(self, engine_id: str) -> int:
        with self._lock:
            return self._allocator.num_shared_users(engine_id)

    def shares_table(self) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        with self._lock:
            return self._allocator.shares_table()

    # ---- internals (under the lock) ---------------------------------------------------

    def _join(self, engine_id: str) -> None:
        if not self._allocator.knows_engine(engine_id):
            self._epoch_of[engine_id] = next(self._epochs)
        self._allocator.engine_heard(engine_id)

    def _limit_of(self, user: str) -> int | None:
        effective = self._limits.model.effective(user)
        return effective.rate if effective.scope == FLEET else None

    def _retarget(self, users: Iterable[str]) -> None:
        for user in list(users):
            self._allocator.set_limit(user, self._limit_of(user))

    def _frames(self, updates: dict[str, ShareUpdate]) -> list[tuple[str, p.Shares]]:
        return [self._frame(engine_id, update) for engine_id, update in updates.items()]

    def _frame(self, engine_id: str, update: ShareUpdate) -> tuple[str, p.Shares]:
        epoch = self._epoch_of.get(engine_id)
        if epoch is None:  # an engine the allocator took on by itself (not heard here)
            epoch = self._epoch_of[engine_id] = next(self._epochs)
        message = p.Shares(
            epoch=epoch,
            seq=update.seq,
            lease_ms=max(1, int(update.lease_s * 1000)),
            num_engines=max(1, update.num_engines),
            full=update.full,
            shares=update.shares,
            outage=self._outage.mode,
            outage_keep_ms=self._outage_keep_ms,
            outage_fraction=self._outage.fraction,
            serving=update.serving,
        )
        return engine_id, message
