"""One view of live usage on every replica (docs/replicas.md, "One fleet view").

Each replica's UsageBook holds the reports of the engines connected to it. Once a second
(``SHARE_INTERVAL_S``), one thread per replica writes, in one transaction, each of its
engines' window of reports (what its book holds of the last 10 s: one ``live_usage`` row
per engine, rewritten in place), deletes its rows of engines it no longer holds, and reads
the other replicas' rows written within ``FRESH_S`` (database time): a replica that died
stops counting after that, and its engines count again once they report to their new
replica. GET /usage, the usage series of /metrics and the received rate of GET
/limits/{user} merge these windows with the local book's, engine by engine, and compute
the figures as one book holding all of them would (``combine``): an engine's reports that
arrived on two replicas (it moved) are one window, not two rates. A remote window is taken
as of the moment it was written (its reports' ages then), so a replica shows another's
engines as they were at most about ``SHARE_INTERVAL_S`` + ``FRESH_S`` earlier.

Write load: one row per engine a second (an upsert; nothing for an engine without reports
in the window) and one transaction per replica a second, whatever its number of engines.
SQLite (one replica) does none of it: the book is the view.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol

import msgspec
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Connection, delete, func, select, text
from sqlalchemy.dialects.postgresql import insert

from control_plane.db import Database, service
from control_plane.deps import UserUsage
from control_plane.fencing import LEADER, Term, current_token, database_now
from control_plane.models import FleetSharesRow, LiveUsageRow, ReplicaLease, table
from control_plane.usage.book import (
    WINDOW_S,
    EngineWindow,
    Interval,
    UsageBook,
    combine,
    rate_1s_of,
)
from output_rate_core import protocol as p

logger = logging.getLogger(__name__)

live_rows = table(LiveUsageRow)
shares_rows = table(FleetSharesRow)
leases = table(ReplicaLease)

SHARE_INTERVAL_S = 1.0
# Rows not rewritten for this long are a stopped replica's: they no longer count.
FRESH_S = 3.0
# ... and are deleted (by any replica) after this long.
KEEP_S = 60.0
# The sharing transaction gives up on a lock held this long (by a stopped replica).
LOCK_TIMEOUT_MS = 500


class _Report(msgspec.Struct, array_like=True, frozen=True):
    """One report (its parts together): seconds before the write it arrived, its interval,
    its tokens, and per user the tokens granted, steps refused, steps a shadow limit would
    have refused, tokens borrowed. Fields are appended last with a default: a replica of
    an older build ignores the ones it does not know, and decodes the rest."""

    age: float
    interval_s: float
    tokens: int
    granted: dict[str, int]
    throttled: dict[str, int]
    would_throttle: dict[str, int]
    borrowed: dict[str, int] = {}


class _Window(msgspec.Struct, array_like=True, frozen=True):
    # Seconds before the write the engine's last report arrived.
    last_report_age: float
    reports: list[_Report]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Window)


def _merged(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in counts:
        for user, n in part.items():
            out[user] = out.get(user, 0) + n
    return out


def encode_window(window: EngineWindow) -> bytes:
    at = window.at
    return _encoder.encode(
        _Window(
            at - window.last_report_at,
            [
                _Report(
                    at - i.received,
                    i.interval_s,
                    i.tokens,
                    _merged(part.granted for part in i.parts),
                    _merged(part.throttled for part in i.parts),
                    _merged(part.would_throttle for part in i.parts),
                    _merged(part.borrowed_counts for part in i.parts),
                )
                for i in window.intervals
            ],
        )
    )


def decode_window(engine_id: str, body: bytes, at: float) -> EngineWindow:
    """The window a body describes, as of `at` (this process's clock: when it was written)."""
    window = _decoder.decode(body)
    return EngineWindow(
        tuple(
            Interval(
                at - r.age,
                r.interval_s,
                (
                    p.Usage(
                        engine_id,
                        r.interval_s,
                        r.granted,
                        r.throttled,
                        would_throttle=r.would_throttle,
                        borrowed=r.borrowed,
                    ),
                ),
                r.tokens,
            )
            for r in window.reports
        ),
        at,
        at - window.last_report_age,
    )


class Allocating(Protocol):
    """What the leader's coordinator tells of its shares (fleet/coordinator.py)."""

    def shares_table(self) -> tuple[dict[str, dict[str, int]], dict[str, int]]: ...


@dataclass(frozen=True)
class RemoteRow:
    replica: str
    engine_id: str
    body: bytes
    # Seconds since it was written (database time).
    age_s: float


class SharesTable(msgspec.Struct, array_like=True, frozen=True):
    """The leader's shares: user -> engine id -> milli-tokens/s it may be enforcing, and
    engine id -> the users it holds a share for (control_plane/deps.py, FleetView)."""

    shares: dict[str, dict[str, int]] = {}
    num_shared: dict[str, int] = {}

    def shares_of(self, user: str) -> dict[str, int]:
        return dict(self.shares.get(user, {}))

    def num_shared_users(self, engine_id: str) -> int:
        return self.num_shared.get(engine_id, 0)


_shares_encoder = msgspec.msgpack.Encoder()
_shares_decoder = msgspec.msgpack.Decoder(SharesTable)
NO_SHARES = SharesTable()


@dataclass(frozen=True)
class Shared:
    """What one transaction read: the other replicas' fresh rows, and the current
    leader's shares (None: no fresh row of the token holding the lease)."""

    rows: list[RemoteRow]
    shares: bytes | None


@service("write_batch")
def share_usage(
    conn: Connection,
    *,
    replica: str,
    bodies: dict[str, bytes],
    shares: tuple[int, bytes] | None = None,
    fresh_s: float = FRESH_S,
    keep_s: float = KEEP_S,
) -> Shared:
    """Write this replica's windows (engine id -> body), drop its rows of other engines
    and rows nobody rewrote for ``keep_s``; with ``shares`` (the leader's token, its
    table), write them while that token holds the lease. Read the other replicas' rows
    written within ``fresh_s``, and the shares of the token holding the lease. One
    transaction, that waits for no lock held by another replica (a stopped one may hold
    it for ever): it fails instead, and the next second tries again."""
    conn.execute(text(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT_MS}ms'"))
    now = database_now(conn)
    c = live_rows.c
    if bodies:
        statement = insert(live_rows)
        conn.execute(
            statement.on_conflict_do_update(
                index_elements=[c.replica, c.engine_id],
                set_={"body": statement.excluded.body, "updated_at": statement.excluded.updated_at},
            ),
            [
                {"replica": replica, "engine_id": engine_id, "body": body, "updated_at": now}
                for engine_id, body in bodies.items()
            ],
        )
    conn.execute(delete(live_rows).where(c.replica == replica, c.engine_id.not_in(bodies)))
    conn.execute(delete(live_rows).where(c.updated_at < now - timedelta(seconds=keep_s)))
    rows = conn.execute(
        select(
            c.replica,
            c.engine_id,
            c.body,
            func.extract("epoch", now - c.updated_at).label("age_s"),
        ).where(c.replica != replica, c.updated_at >= now - timedelta(seconds=fresh_s))
    ).all()
    s = shares_rows.c
    # Older terms' rows are left to expire (deleting them could wait on a stopped former
    # leader's lock); readers take only the current token's.
    conn.execute(delete(shares_rows).where(s.updated_at < now - timedelta(seconds=keep_s)))
    if shares is not None:
        # The fence, last: the lease row is share-locked only for the end of the transaction.
        leader = current_token(conn, name=LEADER)
        if shares[0] == leader:
            statement = insert(shares_rows)
            conn.execute(
                statement.on_conflict_do_update(
                    index_elements=[s.token],
                    set_={
                        "body": statement.excluded.body,
                        "updated_at": statement.excluded.updated_at,
                    },
                ),
                [{"token": leader, "holder": replica, "body": shares[1], "updated_at": now}],
            )
    else:
        leader = unlocked_token(conn, now)
    current = None
    if leader is not None:
        current = conn.execute(
            select(s.body).where(
                s.token == leader, s.updated_at >= now - timedelta(seconds=fresh_s)
            )
        ).scalar_one_or_none()
    return Shared(
        [RemoteRow(r.replica, r.engine_id, r.body, float(r.age_s)) for r in rows], current
    )


def unlocked_token(conn: Connection, now: datetime) -> int | None:
    """The token holding the leader lease at ``now`` (None: expired), read without a
    lock: what a follower shows needs no fence."""
    row = conn.execute(
        select(leases.c.token, leases.c.expires_at).where(leases.c.name == LEADER)
    ).one_or_none()
    return int(row.token) if row is not None and row.expires_at > now else None


@dataclass
class _Remote:
    """What the last read found of the other replicas: their engines' windows, as of
    when each was written (this process's clock), and when the read was."""

    read_at: float = float("-inf")
    windows: list[tuple[str, EngineWindow]] = field(default_factory=list)


class FleetUsage:
    """The usage source of a replica (control_plane/deps.py, UsageSource): its own
    book merged with the other replicas' windows."""

    def __init__(
        self,
        db: Database,
        book: UsageBook,
        *,
        replica_id: str,
        interval_s: float = SHARE_INTERVAL_S,
        fresh_s: float = FRESH_S,
        clock: Callable[[], float] = time.monotonic,
        term: Callable[[], Term | None] = lambda: None,
        allocator: Callable[[], Allocating | None] = lambda: None,
    ) -> None:
        """``clock``: the book's; ``term`` and ``allocator``: this replica's leadership
        and the coordinator it runs (the leader writes its shares for the others)."""
        self._db = db
        self._term = term
        self._allocator = allocator
        # The leader's shares as last read (followers show them: `shares`).
        self._shares: tuple[float, SharesTable] = (float("-inf"), NO_SHARES)
        self._clock = clock
        self._book = book
        self.replica_id = replica_id
        self._interval_s = interval_s
        self._fresh_s = fresh_s
        self._remote = _Remote()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="output-rate-live-usage", daemon=True
        )
        self.num_rows_written = 0
        self.num_transactions = 0

    # ---- what readers see ---------------------------------------------------------

    def _windows(self) -> list[EngineWindow]:
        """Every engine's window: the local book's and the fresh remote ones, one per
        engine (reports of an engine on several replicas together)."""
        now, local = self._book.windows()
        remote = self._remote
        by_engine: dict[str, list[EngineWindow]] = {k: [w] for k, w in local.items()}
        if now - remote.read_at <= self._fresh_s:
            for engine_id, window in remote.windows:
                by_engine.setdefault(engine_id, []).append(window)
        merged = []
        for windows in by_engine.values():
            if len(windows) == 1:
                merged.append(windows[0])
                continue
            intervals = sorted((i for w in windows for i in w.intervals), key=lambda i: i.received)
            merged.append(
                EngineWindow(
                    tuple(intervals),
                    max(w.at for w in windows),
                    max(w.last_report_at for w in windows),
                )
            )
        return merged

    def totals(self) -> list[UserUsage]:
        return combine(self._windows())

    def rate_1s(self, user: str) -> float | None:
        windows = self._windows()
        named = any(
            user in part.granted or user in part.throttled or user in part.would_throttle
            for w in windows
            for i in w.intervals
            if i.received >= w.at - WINDOW_S
            for part in i.parts
        )
        return rate_1s_of(windows, user) if named else None

    def report_ages(self) -> dict[str, float]:
        ages = self._book.report_ages()
        remote = self._remote
        now = self._clock()
        if now - remote.read_at <= self._fresh_s:
            for engine_id, window in remote.windows:
                age = now - window.last_report_at
                ages[engine_id] = min(age, ages.get(engine_id, age))
        return ages

    # ---- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.share_once()
            except Exception as e:  # the database is away: the next second tries again
                logger.warning("live usage: %s", e)
            self._stop.wait(max(0.0, started + self._interval_s - time.monotonic()))

    def shares(self) -> SharesTable:
        """The fleet shares as the current leader last wrote them (none once stale)."""
        read_at, table_ = self._shares
        return table_ if self._clock() - read_at <= self._fresh_s else NO_SHARES

    def share_once(self) -> None:
        _, local = self._book.windows()
        bodies = {engine_id: encode_window(w) for engine_id, w in local.items()}
        term, allocator = self._term(), self._allocator()
        shares = None
        if term is not None and allocator is not None:
            table_ = SharesTable(*allocator.shares_table())
            shares = (term.token, _shares_encoder.encode(table_))
        shared = self._db.run_now(
            share_usage,
            replica=self.replica_id,
            bodies=bodies,
            shares=shares,
            fresh_s=self._fresh_s,
        )
        rows = shared.rows
        read_at = self._clock()
        shares_now = NO_SHARES
        if shared.shares is not None:
            try:
                shares_now = _shares_decoder.decode(shared.shares)
            except (msgspec.DecodeError, ValueError) as e:
                logger.warning("fleet shares row unreadable: %s", e)
        self._shares = (read_at, shares_now)
        self.num_transactions += 1
        # The leader's shares row counts as one more (written unless it was fenced).
        self.num_rows_written += len(bodies) + (shares is not None)
        windows = []
        for row in rows:
            try:
                window = decode_window(row.engine_id, row.body, read_at - row.age_s)
            except (msgspec.DecodeError, ValueError) as e:
                logger.warning(
                    "live usage row of %r from %r unreadable: %s", row.engine_id, row.replica, e
                )
                continue
            windows.append((row.engine_id, window))
        self._remote = _Remote(read_at, windows)


class LiveUsageCollector(Collector):
    """The load the shared view puts on PostgreSQL (docs/metrics.md)."""

    def __init__(self, live: FleetUsage) -> None:
        self._live = live

    def collect(self) -> Iterator[Metric]:
        rows = CounterMetricFamily(
            "output_rate_live_usage_rows_written",
            "live_usage rows this replica wrote (one per engine with reports, a second; on "
            "the leader, one more for its fleet_shares row)",
        )
        rows.add_metric([], self._live.num_rows_written)
        yield rows
        transactions = CounterMetricFamily(
            "output_rate_live_usage_transactions",
            "live_usage transactions of this replica (one a second: write and read, usage "
            "and fleet shares)",
        )
        transactions.add_metric([], self._live.num_transactions)
        yield transactions
