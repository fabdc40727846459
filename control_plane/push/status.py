"""This replica's engine rows (GET /engines), written by a thread of its own.

The socket thread says what changed (``touch``, ``disconnect``, ``claim``) and hands the
due status rows over in one batch at most every STATUS_FLUSH_INTERVAL_S; the thread
writes everything in the order it was handed over, so one engine's writes (the claim of
its bind, its status, its disconnect, the let-go at shutdown) land in the order they were
made. What the database answers that concerns a connection (a claim refused, a row
refused, an engine claimed by another replica since) comes back to the socket thread.

The claim is the fleet-wide half of a bind (docs/replicas.md): with replicas, an engine
id is bound on one replica at a time, and the engines row names its home.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from sqlalchemy.exc import IntegrityError

from control_plane.db import Database
from control_plane.engines import service as engines
from control_plane.fencing import NotLeader, Term, fleet_work_token
from control_plane.push.drops import DropLog
from control_plane.push.peers import Peer, PeerTable
from control_plane.push.worker import DatabaseWorker
from output_rate_core import protocol as p

logger = logging.getLogger(__name__)

# Engine status rows are written at most this often (batched).
STATUS_FLUSH_INTERVAL_S = 0.2
# A row whose version and model are unchanged is rewritten only this often: enough for
# last_seen and for the fleet-wide bind (a home heard within the engine timeout, 5 s by
# default), while every usage report or heartbeat no longer costs a row update.
STATUS_REFRESH_S = 1.0
# An engine id homed at another replica that has not rewritten its row for this long is
# free to claim (its home stopped hearing it, or stopped): a live home rewrites the row of
# every engine it hears at least every STATUS_REFRESH_S (+ a flush). An engine with several
# replicas leaves a silent one after SERVER_SILENCE_S, a second after it last heard it
# (its heartbeat), so the row of a replica that died is this old by then and the next
# replica binds the engine at once (docs/replicas.md, "Failover"). A home whose writes lag
# more than the difference (1.3 s) may lose an engine to a clashing claim; its next write
# lets go of it (moved).
HOME_SILENT_AFTER_S = p.SERVER_SILENCE_S - p.HEARTBEAT_INTERVAL_S
assert HOME_SILENT_AFTER_S > STATUS_REFRESH_S + STATUS_FLUSH_INTERVAL_S
# A claim refused because another replica holds the id is asked again this often, for
# HOME_SILENT_AFTER_S (the bind waits meanwhile): an engine that left a replica cut off
# from its database arrives before that replica's row is old enough, and must not be told
# of a clash (one that is real stays refused: its home keeps writing).
CLAIM_RETRY_S = 0.25
# Engine rows not seen for the retention are deleted this often.
RETENTION_SWEEP_INTERVAL_S = 60.0
ROLES: tuple[p.Role, ...] = (p.ENGINE_ROLE, p.API_ROLE)


@dataclass(frozen=True)
class Written:
    """What a batch of status rows came to."""

    num_written: int
    # (engine id, role) -> why the database refused its row
    refused: dict[tuple[str, p.Role], str]
    # Homed at another replica (it claimed them since): not written.
    moved: set[tuple[str, p.Role]]


class StatusWriter:
    def __init__(
        self,
        db: Database,
        *,
        peers: PeerTable,
        drops: DropLog,
        wake: Callable[[], None],
        replica_id: str | None,
        engine_timeout_s: float,
        engine_retention_s: float,
        term: Callable[[], Term | None] | None,
    ) -> None:
        """``replica_id``: this replica's name, with replicas (binds are claimed in the
        database first); ``term``: its leadership, which alone deletes expired rows."""
        self._db = db
        self._peers = peers
        self._drops = drops
        self._worker = DatabaseWorker("output-rate-engine-rows", wake)
        self._replica_id = replica_id
        self._engine_timeout_s = engine_timeout_s
        self._engine_retention_s = engine_retention_s
        self._term = term
        # Identities whose row may be due (a message came, a bind, a proof).
        self._dirty: set[bytes] = set()
        self._last_flush = 0.0
        # (engine id, role) -> the connection of the batch being written (None: none is)
        self._batch: dict[tuple[str, p.Role], tuple[bytes, Peer]] | None = None
        self._next_sweep = 0.0
        self.num_status_rows_written = 0
        # Engine ids refused because another replica holds them.
        self.num_binds_refused_elsewhere = 0
        # Claims refused and to be asked again: (when, engine id, role, then, first asked)
        self._claim_retries: list[tuple[float, str, p.Role, Callable[[bool | None], None], float]]
        self._claim_retries = []

    @property
    def claims(self) -> bool:
        """A bind waits for the database's claim (replicas: another may hold the id)."""
        return self._replica_id is not None

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> set[str]:
        """On the starting thread: the engines (and API servers) this replica held before
        are not connected (with replicas, the others' are theirs to say). Returns the
        engine ids that applied a version here before."""
        for role in ROLES:
            self._db.run_now(
                engines.disconnect_engines, engine_ids=None, role=role, replica=self._replica_id
            )
        known: set[str] = self._db.run_now(engines.applied_engine_ids)
        self._worker.start()
        return known

    def close(self, bound: list[Peer]) -> None:
        """After the writes handed over, let go of the ``bound`` engines (replicas: the
        next replica binds them at once), and wait for it."""
        if self._replica_id is not None:
            for role in ROLES:
                ids = [peer.engine_id for peer in bound if peer.role == role and peer.proven]
                self._worker.submit(partial(self._let_go, ids, role))
        self._worker.close(finish=True)

    def deliver(self) -> None:
        self._worker.deliver()

    # ---- the socket thread ---------------------------------------------------------

    def claim(self, engine_id: str, role: p.Role, then: Callable[[bool | None], None]) -> None:
        """``then(claimed)``: whether this replica may bind (engine_id, role), None when
        the database did not answer; a refusal (after HOME_SILENT_AFTER_S of asking
        again) is logged and counted."""
        self._ask_claim(engine_id, role, then, time.monotonic())

    def _ask_claim(
        self, engine_id: str, role: p.Role, then: Callable[[bool | None], None], first: float
    ) -> None:
        self._worker.submit(
            partial(self._claim, engine_id, role),
            partial(self._claimed, engine_id, role, then, first),
        )

    def touch(self, identity: bytes) -> None:
        self._dirty.add(identity)

    def disconnect(self, engine_id: str, role: p.Role) -> None:
        self._worker.submit(partial(self._disconnect, [engine_id], role))

    def flush(self, now: float) -> None:
        """Hand the due rows over, one batch at a time (while the database is slow they
        stay due instead of piling up)."""
        if self._claim_retries and self._claim_retries[0][0] <= now:
            due_claims = [retry for retry in self._claim_retries if retry[0] <= now]
            self._claim_retries = [retry for retry in self._claim_retries if retry[0] > now]
            for _, engine_id, role, then, first in due_claims:
                self._ask_claim(engine_id, role, then, first)
        if not self._dirty or self._batch is not None:
            return
        if now - self._last_flush < STATUS_FLUSH_INTERVAL_S:
            return
        self._last_flush = now
        due = self._due(now)
        if not due:
            return
        for _, peer in due:
            peer.written_status = (peer.model, peer.applied_version)
            peer.status_written_at = now
        # One row per engine_id, written by its engine core and its API server (one
        # connection per engine id and role).
        self._batch = {(peer.engine_id, peer.role): (identity, peer) for identity, peer in due}
        seen = [
            engines.EngineSeen(
                engine_id=peer.engine_id,
                model=peer.model,
                applied_version=peer.applied_version,
                first_seen=peer.first_seen,
                role=peer.role,
                vllm_version=peer.vllm_version,
            )
            for _, peer in self._batch.values()
        ]
        self._worker.submit(partial(self._write, seen), self._written, self._unwritten)

    def sweep(self, now: float) -> None:
        """Delete the rows past their retention, at most every RETENTION_SWEEP_INTERVAL_S
        (with replicas, the leader does, fenced)."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + RETENTION_SWEEP_INTERVAL_S
        may_sweep, fence = fleet_work_token(self._term)
        if may_sweep:
            self._worker.submit(partial(self._forget_expired, fence))

    def _due(self, now: float) -> list[tuple[bytes, Peer]]:
        """The dirty peers whose row is written now: a changed version or model at once,
        an unchanged one once STATUS_REFRESH_S passed; the others stay dirty."""
        due, waiting = [], set()
        for identity in self._dirty:
            peer = self._peers.get(identity)
            if peer is None or not peer.proven:
                continue
            if (
                peer.written_status != (peer.model, peer.applied_version)
                or now - peer.status_written_at >= STATUS_REFRESH_S
            ):
                due.append((identity, peer))
            else:
                waiting.add(identity)
        self._dirty = waiting
        return due

    def _claimed(
        self,
        engine_id: str,
        role: p.Role,
        then: Callable[[bool | None], None],
        first: float,
        claimed: bool | None,
    ) -> None:
        now = time.monotonic()
        if claimed is False and now - first < HOME_SILENT_AFTER_S:
            self._claim_retries.append((now + CLAIM_RETRY_S, engine_id, role, then, first))
            return
        if claimed is False:
            self.num_binds_refused_elsewhere += 1
            self._drops.note("engine id live on another replica", f"{engine_id!r} ({role})")
        then(claimed)

    def _written(self, written: Written) -> None:
        batch, self._batch = self._batch, None
        assert batch is not None
        self.num_status_rows_written += written.num_written
        for engine, error in written.refused.items():
            self._drops.note("engine status row refused by the database", error)
            self._let_go_of(*batch[engine])
        for engine_id, role in written.moved:
            # Another replica claimed it since (this replica was paused, or cut off): what
            # still arrives from it here is old. Its row is the other replica's to write.
            self._drops.note("engine bound on another replica since", f"{engine_id!r} ({role})")
            self._let_go_of(*batch[engine_id, role])

    def _unwritten(self) -> None:
        self._batch = None

    def _let_go_of(self, identity: bytes, peer: Peer) -> None:
        if self._peers.get(identity) is peer:
            self._peers.forget(identity)

    # ---- the status thread -------------------------------------------------------------

    def _claim(self, engine_id: str, role: p.Role) -> bool | None:
        assert self._replica_id is not None, "claims are for replicas"
        try:
            claimed: bool = self._db.run_now(
                engines.claim_engine,
                engine_id=engine_id,
                replica=self._replica_id,
                timeout_s=min(self._engine_timeout_s, HOME_SILENT_AFTER_S),
                role=role,
            )
        except IntegrityError as e:
            # A claim racing another replica's (one row per engine id): the other has it.
            logger.debug("claim of %r failed: %s", engine_id, e)
            return False
        except Exception as e:
            # No answer (the database is away, a transaction that failed): the engine is
            # sent on to another replica rather than told of a clash that is none.
            logger.warning("claim of %r: no answer from the database: %s", engine_id, e)
            return None
        return claimed

    def _write(self, seen: list[engines.EngineSeen]) -> Written:
        try:
            moved = self._db.run_now(engines.record_engines, seen=seen, replica=self._replica_id)
            return Written(len(seen), {}, moved)
        except Exception:
            # One row the database refuses must not keep every other engine's row stale:
            # write them one by one and let go of the engines whose row fails.
            num_written, refused = 0, {}
            moved = set()
            for engine in seen:
                try:
                    moved_one: set[tuple[str, p.Role]] = self._db.run_now(
                        engines.record_engines, seen=[engine], replica=self._replica_id
                    )
                    moved |= moved_one
                    num_written += 1
                except Exception as e:
                    refused[engine.engine_id, engine.role] = str(e)[:200]
            return Written(num_written, refused, moved)

    def _forget_expired(self, fence: int | None) -> None:
        with contextlib.suppress(NotLeader):  # the lease moved: the new leader sweeps
            self._db.run_now(
                engines.forget_engines, retention_s=self._engine_retention_s, fence=fence
            )

    def _disconnect(self, engine_ids: list[str], role: p.Role) -> None:
        self._db.run_now(
            engines.disconnect_engines, engine_ids=engine_ids, role=role, replica=self._replica_id
        )

    def _let_go(self, engine_ids: list[str], role: p.Role) -> None:
        try:
            self._disconnect(engine_ids, role)
        except Exception as e:  # the database is away: claimable after the timeout
            logger.warning("could not let go of this replica's engines: %s", e)
