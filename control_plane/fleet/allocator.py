"""The fleet share allocator: splits each fleet-scoped user's limit into per-engine shares.

Pure Python: imports nothing but the standard library and ``output_rate_core``, and reads time
only through the injected ``clock``, so tests drive it with a fake one.

A share is an integer in milli-tokens/s. For every fleet user the allocator keeps, per engine,
what it sent and what the engine acknowledged, and accounts the engine as *holding* the largest
value it may be enforcing right now (see ``_held``). It sends a lowering at once and a raise only
up to the headroom ``1000 x L - sum(held)``, so the sum of what engines may enforce never exceeds
the limit because of anything the allocator sent. docs/fleet.md states the bound and its slack.

What an engine must do with the ``ShareUpdate`` messages (the allocator's accounting relies on it):

- apply a message only if its ``seq`` is one more than the last it applied, or if it is ``full``
  with a larger ``seq``; anything else means a message was lost: drop it and ask for a full update
  (the caller answers with ``full_update``). Ack every ``seq`` it applied.
- ``full``: the shares replace all it holds; otherwise each listed user is set, ``0`` removes it.
- enforce its shares until ``lease_s`` after the message arrived (``keep_s`` more with the
  "keep" outage policy); for a fleet user it serves but holds no share for, enforce
  ``safe_share(1000 x L, num_engines)``; once the lease (and the keep) ended, enforce
  ``outage_share`` of the policy with the serving count sent with the user's last share. A
  lapsed engine keeps its shares: the next message renews them.
- report its active streams per fleet user (``set_demand``): a user appearing at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from output_rate_core.limits import (
    DELIVERY_MARGIN_S,
    min_gone_after_s,
    outage_share,
    safe_share,
)
from output_rate_core.outage import DEFAULT_OUTAGE, OutagePolicy
from output_rate_core.protocol import MILLI
from output_rate_core.rates import validate_rate


def split(budget: int, streams: Mapping[str, int]) -> dict[str, int]:
    """``budget`` split over engines in proportion to their streams (all >= 0; all 0: evenly),
    largest remainder first (ties by engine id); the parts sum to ``budget`` exactly and each is
    at least 1. With less than 1 per engine to give, each gets exactly 1."""
    if budget <= len(streams):
        return dict.fromkeys(streams, 1)
    total = sum(streams.values())
    if total == 0:
        return split(budget, dict.fromkeys(streams, 1))
    # engine -> its part
    parts: dict[str, int] = {}
    by_remainder: list[tuple[int, str]] = []
    for engine_id, num_streams in streams.items():
        quota, remainder = divmod(budget * num_streams, total)
        parts[engine_id] = quota
        by_remainder.append((-remainder, engine_id))
    by_remainder.sort()
    for _, engine_id in by_remainder[: budget - sum(parts.values())]:
        parts[engine_id] += 1
    # One stream next to a crowd can round down to 0; an engine that serves the user must
    # never sit at zero, so it takes 1 from the largest part (which has >= 2, as budget > n).
    for engine_id, part in parts.items():
        if part == 0:
            largest = max(parts, key=parts.__getitem__)
            parts[largest] -= 1
            parts[engine_id] = 1
    return parts


def weigh_by_evidence(demand: dict[str, int], evidenced: Collection[str]) -> dict[str, int]:
    """The streams each engine weighs in a user's split (``demand``: engine id -> streams),
    where ``evidenced`` engines' usage bore out their claims (tokens granted to the streams
    claimed, or throttled steps: control_plane/push/demand.py): every other engine weighs
    no more than the busiest of them.

    Streams are only a count: a rogue claiming its whole capacity (within it, so never cut)
    would otherwise take ``c / (c + d)`` of the limit beside an honest engine with ``d``
    streams. An honest engine running the user's streams is evidenced by its first usage
    report (it serves them, or its share holds them back), so its weight is unchanged; one
    whose claim its usage does not bear out weighs at most an even split with the busiest
    engine that does. With no engine evidenced the split is by streams, as before."""
    if not evidenced or len(evidenced) == len(demand):
        return demand
    busiest = max(demand[e] for e in evidenced)
    return {e: d if e in evidenced else min(d, busiest) for e, d in demand.items()}


@dataclass(frozen=True, slots=True)
class ShareUpdate:
    """One message to one engine; with no shares it is a lease renewal."""

    seq: int
    # Engines in the fleet, for the engine's safe share.
    num_engines: int
    # How long after this message arrives the engine may enforce its shares.
    lease_s: float
    # True: ``shares`` is all the engine holds (users not listed: no share).
    full: bool
    # user -> share in milli-tokens/s (0: the engine holds no share for that user any more)
    shares: dict[str, int]
    # user -> the engines serving it, for each user of ``shares`` with a share > 0: the
    # engine's outage share divides the limit by it.
    serving: dict[str, int]


class _Cell:
    """One (user, engine) pair: the engine's demand and what it may hold."""

    __slots__ = (
        "acked",
        "acked_serving",
        "demand",
        "evidenced",
        "over_capacity",
        "pending",
        "stalled",
    )

    def __init__(self) -> None:
        self.demand = 0
        # The engine claimed more streams than its capacity for the user (cut to it).
        self.over_capacity = False
        # The engine holds requests of the user but can run none of them (saturated).
        self.stalled = False
        # Its last usage report naming the user bore out the streams claimed (none until
        # a report shows it).
        self.evidenced = False
        # The value the engine acknowledged last (0: none), and the last serving count it
        # acknowledged (0: none; the engine keeps it when its share goes to 0).
        self.acked = 0
        self.acked_serving = 0
        # (seq, value, serving count) sent after it, not yet acknowledged; the engine may
        # be enforcing any.
        self.pending: list[tuple[int, int, int]] = []

    @property
    def sent(self) -> int:
        return self.pending[-1][1] if self.pending else self.acked

    @property
    def sent_serving(self) -> int:
        return self.pending[-1][2] if self.pending else self.acked_serving

    def least_serving(self) -> int | None:
        """The smallest serving count the engine may hold (None: none it was sent by this
        allocator): its largest outage share."""
        counts = [count for _, value, count in self.pending if value]
        if self.acked_serving:
            counts.append(self.acked_serving)
        return min(counts) if counts else None

    def is_idle(self) -> bool:
        return self.demand == 0 and self.acked == 0 and not self.pending


class _Sent:
    """A message not yet acknowledged."""

    __slots__ = ("full", "lease_end", "num_engines", "seq", "users")

    def __init__(
        self, seq: int, num_engines: int, lease_end: float, users: list[str], full: bool
    ) -> None:
        self.seq = seq
        self.num_engines = num_engines
        self.lease_end = lease_end
        self.users = users
        self.full = full


class _Engine:
    __slots__ = (
        "acked_lease_end",
        "acked_seq",
        "cells",
        "expired",
        "kept",
        "lapsing",
        "last_heard",
        "min_num_engines",
        "needs_full",
        "seq",
        "unacked",
    )

    def __init__(self, now: float) -> None:
        self.seq = 0
        self.acked_seq = 0
        self.last_heard = now
        # Until this instant (allocator clock) the engine's lease surely holds: it ends no
        # earlier than the lease of the latest message it acknowledged.
        self.acked_lease_end = -math.inf
        # The smallest fleet size the engine may be using (its largest safe share).
        self.min_num_engines: int | None = None
        # Its lease may end within renew_s (as of the last step): a healthy engine acks each
        # renewal long before that, so it has missed one. From then on it is accounted as on
        # its safe share, and the other engines are lowered before its lease really ends.
        self.lapsing = True
        # Silent for more than the lease: it is sent nothing more.
        self.expired = False
        # Its next message must be a full update (it is new to this allocator).
        self.needs_full = True
        # Messages sent and not yet acknowledged, oldest first.
        self.unacked: list[_Sent] = []
        # user -> cell (the engine -> users index)
        self.cells: dict[str, _Cell] = {}
        # user -> (the serving count the engine may keep past its share, until when): the
        # engine keeps a count when its share is withdrawn, for kept_count_ttl_ns, while
        # its cell here goes once idle; if it begins serving the user again with its lease
        # ending, it may enforce the outage share of that count.
        self.kept: dict[str, tuple[int, float]] = {}


def _frozen(engine: _Engine) -> bool:
    """Its shares no longer follow demand (they stay what it may hold): it is silent, or it has
    acked before and its lease may be ending. A new engine (nothing acked yet) is on its safe
    shares anyway and gets its first shares with its first (full) update."""
    return engine.expired or (engine.lapsing and engine.acked_seq > 0)


class FleetAllocator:
    """Per-engine shares of every fleet-scoped user's limit (docs/fleet.md).

    Feed it what engines say (``engine_heard``, ``set_demand``, ``acked``) and the limits
    (``set_limit``); call ``step`` right after any of them (and at least every ``renew_s``) and
    send each engine what it returns.
    """

    def __init__(
        self,
        *,
        lease_s: float,
        clock: Callable[[], float] = time.monotonic,
        gone_after_s: float | None = None,
        renew_s: float | None = None,
        outage: OutagePolicy = DEFAULT_OUTAGE,
    ) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self._clock = clock
        self._lease_s = lease_s
        # What engines do when their lease ends: sent to them (by the caller), and what the
        # accounting of a lapsing engine takes it may fall to.
        self.outage = outage
        least_gone = min_gone_after_s(lease_s, outage.kept_s)
        default_gone_after_s = max(3 * lease_s, least_gone)
        self._gone_after_s = default_gone_after_s if gone_after_s is None else gone_after_s
        self._renew_s = lease_s / 3 if renew_s is None else renew_s
        if self._gone_after_s < least_gone:
            raise ValueError(
                f"gone_after_s must be >= 2 x lease_s + keep_s + {DELIVERY_MARGIN_S} "
                f"({least_gone}), got {self._gone_after_s}"
            )
        if not 0 < self._renew_s < lease_s:
            raise ValueError(f"renew_s must be in (0, lease_s), got {self._renew_s}")
        # user -> limit in milli-tokens/s (fleet-scoped users only)
        self._limits: dict[str, int] = {}
        # engine id -> engine (live or silent, not gone)
        self._engines: dict[str, _Engine] = {}
        # user -> engine id -> cell (the user -> engines index; the same cells as _Engine.cells)
        self._users: dict[str, dict[str, _Cell]] = {}
        # Users whose shares the next step looks at again.
        self._dirty: set[str] = set()
        # Every message carries the same lease end, renewed for the whole fleet at once, so that
        # with the control plane gone all engines fall back to safe shares at the same moment.
        now = clock()
        self._lease_end = now + lease_s
        self._renewed_at = now
        self._fleet_changed = False

    # ---- what engines and the database say --------------------------------------------

    def set_limit(self, user: str, rate: int | None) -> None:
        """The user's limit in tokens/s; None: not split (unlimited, engine scope or deleted)."""
        rate = validate_rate(rate)
        if rate is None:
            if self._limits.pop(user, None) is None:
                return
        elif self._limits.get(user) == rate * MILLI:
            return
        else:
            self._limits[user] = rate * MILLI
        if user in self._users:
            self._dirty.add(user)

    def engine_heard(self, engine_id: str) -> None:
        """Any message from the engine: it is alive (an unknown engine joins the fleet)."""
        self._engine(engine_id)

    def set_demand(
        self,
        engine_id: str,
        streams: Mapping[str, int],
        *,
        full: bool,
        over_capacity: Collection[str] = (),
        stalled: Collection[str] | None = None,
        evidenced: Collection[str] | None = None,
    ) -> None:
        """Active streams (running + waiting) per fleet user on the engine; 0 = none. ``full``:
        ``streams`` lists every user it serves (the others have none). ``over_capacity``:
        users whose count the engine's replica cut to its capacity: in the split they
        weigh no more than the busiest engine of the user that claims within its own.
        ``stalled``: every user the engine holds requests of but can run none (None: as
        before): they keep 1 milli-token/s of the split while another engine of the user
        can use the rest. ``evidenced``: every user whose claim the engine's usage bore
        out (None: as before): beside such engines, the others weigh no more than the
        busiest of them (``weigh_by_evidence``)."""
        for user, num_streams in streams.items():
            if isinstance(num_streams, bool) or not isinstance(num_streams, int):
                raise TypeError(f"streams of user {user!r} must be an integer")
            if num_streams < 0:
                raise ValueError(f"streams of user {user!r} must be >= 0, got {num_streams}")
        engine = self._engine(engine_id)
        if full:
            for user, old in list(engine.cells.items()):
                if user not in streams:
                    self._set_cell_demand(engine_id, engine, user, old, 0)
        for user, num_streams in streams.items():
            cell = engine.cells.get(user)
            if cell is None:
                if num_streams == 0:
                    continue
                cell = engine.cells[user] = _Cell()
                self._users.setdefault(user, {})[engine_id] = cell
            over = user in over_capacity
            if cell.over_capacity != over:
                cell.over_capacity = over
                self._dirty.add(user)
            self._set_cell_demand(engine_id, engine, user, cell, num_streams)
        if stalled is not None:
            for user, cell in engine.cells.items():
                if cell.stalled != (user in stalled):
                    cell.stalled = not cell.stalled
                    self._dirty.add(user)
        if evidenced is not None:
            shown = set(evidenced)
            for user, cell in engine.cells.items():
                if cell.evidenced != (user in shown):
                    cell.evidenced = not cell.evidenced
                    self._dirty.add(user)

    def acked(self, engine_id: str, seq: int) -> None:
        """The engine applied every message up to ``seq``; stale or unknown seqs change nothing."""
        engine = self._engines.get(engine_id)
        if engine is None:
            return
        self._heard(engine)
        if not engine.acked_seq < seq <= engine.seq:
            return
        done = 0
        while done < len(engine.unacked) and engine.unacked[done].seq <= seq:
            done += 1
        settled, engine.unacked = engine.unacked[:done], engine.unacked[done:]
        if any(sent.full for sent in settled):
            engine.kept = {}  # a full table replaces every count the engine kept
        last = settled[-1]
        engine.acked_seq = seq
        engine.acked_lease_end = last.lease_end
        engine.min_num_engines = min(
            [last.num_engines] + [sent.num_engines for sent in engine.unacked]
        )
        for user in {user for sent in settled for user in sent.users}:
            cell = engine.cells.get(user)
            if cell is None:
                continue
            # The engine now holds the value of the last message up to seq that carried it.
            done = 0
            while done < len(cell.pending) and cell.pending[done][0] <= seq:
                done += 1
            if done:
                _, cell.acked, count = cell.pending[done - 1]
                cell.acked_serving = count or cell.acked_serving
                del cell.pending[:done]
                if cell.acked:
                    engine.kept.pop(user, None)  # the cell holds its count now
            self._dirty.add(user)
            self._drop_if_idle(engine_id, engine, user, cell)

    def remove_engine(self, engine_id: str) -> None:
        """Forget the engine now (it shut down cleanly); its part goes to the others. A
        reconnecting engine keeps its id and gets ``full_update`` instead."""
        engine = self._engines.pop(engine_id, None)
        if engine is not None:
            self._forget_cells(engine_id, engine)

    # ---- what to send -----------------------------------------------------------------

    def step(self) -> dict[str, ShareUpdate]:
        """engine id -> the message to send it now: new shares, a full update for an engine new
        to this allocator, or a lease renewal (every engine at least every ``renew_s``)."""
        now = self._clock()
        self._check_engines(now)
        renew = self._fleet_changed or now - self._renewed_at >= self._renew_s
        if renew:
            self._lease_end = now + self._lease_s
            self._renewed_at = now
            self._fleet_changed = False
        # engine id -> user -> the new share to send it
        changes: dict[str, dict[str, int]] = {}
        dirty, self._dirty = self._dirty, set()
        for user in dirty:
            self._retarget(user, changes)
        updates: dict[str, ShareUpdate] = {}
        for engine_id, engine in self._engines.items():
            if engine.expired:
                continue
            if engine.needs_full:
                updates[engine_id] = self._send_full(engine, now)
            elif renew or engine_id in changes:
                shares = changes.get(engine_id, {})
                updates[engine_id] = self._send(engine, shares, list(shares), False, now)
        return updates

    def full_update(self, engine_id: str) -> ShareUpdate:
        """Everything the engine holds, to send after a reconnect or when it reports a gap."""
        return self._send_full(self._engine(engine_id), self._clock())

    # ---- queries ----------------------------------------------------------------------

    def shares_of(self, user: str) -> dict[str, int]:
        """engine id -> the milli-tokens/s it may be enforcing for the user ({} if not split)."""
        limit = self._limits.get(user)
        if limit is None:
            return {}
        return {
            engine_id: self._held(user, cell, self._engines[engine_id], limit)
            for engine_id, cell in self._users.get(user, {}).items()
        }

    def num_shared_users(self, engine_id: str) -> int:
        """Users the engine holds a share for (or was just sent one)."""
        engine = self._engines.get(engine_id)
        if engine is None:
            return 0
        return sum(1 for user, cell in engine.cells.items() if cell.sent and user in self._limits)

    def shares_table(self) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        """Every split user's `shares_of`, and every engine's `num_shared_users` (engines
        holding none left out): what the leader shows other replicas."""
        shares = {user: self.shares_of(user) for user in self._limits if self._users.get(user)}
        shared = {e: n for e in self._engines if (n := self.num_shared_users(e))}
        return shares, shared

    @property
    def gone_after_s(self) -> float:
        """Silence after which an engine is dropped from the fleet."""
        return self._gone_after_s

    @property
    def num_engines(self) -> int:
        return len(self._engines)

    def knows_engine(self, engine_id: str) -> bool:
        """The engine is live or silent, not gone (a gone one comes back as a new engine)."""
        return engine_id in self._engines

    def knows_user(self, user: str) -> bool:
        """Some engine reports demand for the user or may hold a share of it."""
        return user in self._users

    # ---- internals --------------------------------------------------------------------

    def _engine(self, engine_id: str) -> _Engine:
        engine = self._engines.get(engine_id)
        if engine is None:
            engine = self._engines[engine_id] = _Engine(self._clock())
            # Every engine's safe share shrinks: tell all of them at the next step.
            self._fleet_changed = True
        else:
            self._heard(engine)
        return engine

    def _heard(self, engine: _Engine) -> None:
        engine.last_heard = self._clock()
        if engine.expired:
            engine.expired = False
            self._dirty.update(engine.cells)

    def _set_cell_demand(
        self, engine_id: str, engine: _Engine, user: str, cell: _Cell, num_streams: int
    ) -> None:
        if cell.demand != num_streams:
            cell.demand = num_streams
            self._dirty.add(user)
            self._drop_if_idle(engine_id, engine, user, cell)

    def _drop_if_idle(self, engine_id: str, engine: _Engine, user: str, cell: _Cell) -> None:
        if cell.is_idle():
            if cell.acked_serving:
                # The engine keeps the count for kept_count_ttl_ns from the arrival of the
                # withdrawal, which it applied before it acknowledged it (before now).
                ttl_s = min_gone_after_s(self._lease_s, self.outage.kept_s)
                engine.kept[user] = (cell.acked_serving, self._clock() + ttl_s)
            del engine.cells[user]
            by_engine = self._users[user]
            del by_engine[engine_id]
            if not by_engine:
                del self._users[user]

    def _forget_cells(self, engine_id: str, engine: _Engine) -> None:
        for user in engine.cells:
            by_engine = self._users[user]
            del by_engine[engine_id]
            if by_engine:
                self._dirty.add(user)
            else:
                del self._users[user]
        self._fleet_changed = True

    def _check_engines(self, now: float) -> None:
        for engine_id, engine in list(self._engines.items()):
            silent_s = now - engine.last_heard
            if silent_s > self._gone_after_s:
                del self._engines[engine_id]
                self._forget_cells(engine_id, engine)
                continue
            if engine.kept:
                expired_counts = [u for u, (_, until) in engine.kept.items() if until < now]
                for user in expired_counts:
                    del engine.kept[user]
                self._dirty.update(expired_counts)
            expired = silent_s > self._lease_s
            lapsing = now >= engine.acked_lease_end - self._renew_s
            if expired != engine.expired or lapsing != engine.lapsing:
                engine.expired = expired
                engine.lapsing = lapsing
                self._dirty.update(engine.cells)

    def _held(self, user: str, cell: _Cell, engine: _Engine, limit: int) -> int:
        """The largest value the engine may be enforcing for the cell's user: the acknowledged
        one or any in flight; its safe share where it serves the user with no share (a 0 among
        those); its outage share (the policy's, with the smallest serving count it may hold,
        one it kept past an earlier share too) where its lease may be ending."""
        lowest = highest = cell.acked
        for _, value, _ in cell.pending:
            lowest = min(lowest, value)
            highest = max(highest, value)
        num_engines = engine.min_num_engines or len(self._engines)
        unshared = cell.demand > 0 and lowest == 0
        if unshared:
            highest = max(highest, safe_share(limit, num_engines))
        if engine.lapsing and (cell.demand > 0 or highest > 0):
            policy = self.outage
            least = cell.least_serving()
            kept = engine.kept.get(user)
            if kept is not None:
                least = kept[0] if least is None else min(least, kept[0])
            highest = max(highest, outage_share(limit, num_engines, least, policy))
            if unshared:  # and a user it holds no share of, past the lease
                highest = max(highest, outage_share(limit, num_engines, None, policy))
        return highest

    def _retarget(self, user: str, changes: dict[str, dict[str, int]]) -> None:
        cells = self._users.get(user)
        if cells is None:
            return
        limit = self._limits.get(user)
        # engine id -> (engine, cell), for engines whose shares follow demand
        live: dict[str, tuple[_Engine, _Cell]] = {}
        # engine id -> the value it may be enforcing
        held: dict[str, int] = {}
        for engine_id, cell in cells.items():
            engine = self._engines[engine_id]
            if not _frozen(engine):
                live[engine_id] = (engine, cell)
            if limit is not None:
                held[engine_id] = self._held(user, cell, engine, limit)
        if limit is None:
            # Not split (any more): every engine drops what it holds.
            for engine_id, (_, cell) in live.items():
                if cell.sent:
                    changes.setdefault(engine_id, {})[user] = 0
            return
        # A frozen engine keeps what it may hold; the others share the rest.
        reserved = sum(held[engine_id] for engine_id in cells if engine_id not in live)
        demand = {engine_id: cell.demand for engine_id, (_, cell) in live.items() if cell.demand}
        over = [e for e, (_, cell) in live.items() if cell.demand and cell.over_capacity]
        within = [d for e, d in demand.items() if e not in over]
        if over and within:
            # A claim over an engine's capacity (a rogue's 2**53, or a queue longer than
            # the engine runs) weighs no more than the busiest claim within capacity: the
            # honest engines keep at least an even split with it.
            for engine_id in over:
                demand[engine_id] = min(demand[engine_id], max(within))
        demand = weigh_by_evidence(demand, {e for e in demand if live[e][1].evidenced})
        if any(live[e][1].stalled for e in demand) and not all(live[e][1].stalled for e in demand):
            # A saturated engine cannot use a share: it keeps 1 milli (the split's least),
            # the engines that can run the user's streams take the rest.
            demand = {e: 0 if live[e][1].stalled else d for e, d in demand.items()}
        targets = split(limit - reserved, demand) if demand else {}
        headroom = limit - sum(held.values())
        # (engine id, target) of the raises, sent only as far as the headroom allows
        raises: list[tuple[str, int]] = []
        for engine_id, (_, cell) in live.items():
            target = targets.get(engine_id, 0)
            if target == cell.sent:
                continue
            if target <= held[engine_id]:
                changes.setdefault(engine_id, {})[user] = target
            else:
                raises.append((engine_id, target))
        for engine_id, target in raises:
            if headroom <= 0:
                break
            value = min(target, held[engine_id] + headroom)
            headroom -= value - held[engine_id]
            changes.setdefault(engine_id, {})[user] = value
        # Every engine holding a share learns how many engines serve the user now (its
        # outage share divides by it), with its share or alone (a count the same share).
        num_serving = self._num_serving(user)
        for engine_id, (_, cell) in live.items():
            if cell.sent and cell.sent_serving != num_serving:
                changes.setdefault(engine_id, {}).setdefault(user, cell.sent)

    def _send_full(self, engine: _Engine, now: float) -> ShareUpdate:
        # A full update restates every cell's last sent value, so the pending value of each
        # (0 where nothing is held) covers whatever the engine held before it.
        engine.needs_full = False
        sent = {user: cell.sent for user, cell in engine.cells.items()}
        return self._send(engine, sent, list(sent), True, now)

    def _num_serving(self, user: str) -> int:
        """The engines serving the user: with demand for it, or that may hold a share of it
        (live or silent, not gone)."""
        return len(self._users.get(user, ()))

    def _send(
        self, engine: _Engine, shares: dict[str, int], users: list[str], full: bool, now: float
    ) -> ShareUpdate:
        engine.seq += 1
        num_engines = len(self._engines)
        # user -> its serving count, for the users given a share
        serving: dict[str, int] = {}
        for user, value in shares.items():
            count = self._num_serving(user) if value else 0
            if count:
                serving[user] = count
            engine.cells[user].pending.append((engine.seq, value, count))
        engine.unacked.append(_Sent(engine.seq, num_engines, self._lease_end, users, full))
        if engine.min_num_engines is None or num_engines < engine.min_num_engines:
            engine.min_num_engines = num_engines
        on_wire = {user: value for user, value in shares.items() if value} if full else shares
        return ShareUpdate(
            seq=engine.seq,
            num_engines=num_engines,
            lease_s=max(0.0, self._lease_end - now),
            full=full,
            shares=on_wire,
            serving=serving,
        )
