"""One allocator for the fleet (docs/fleet.md): the push server's fleet coordinator, the
limit model it keeps, and, with replicas, the lease-guarded term it runs in and the
relay to the other replicas.

Replicas (docs/replicas.md, "One fleet allocator"): with a ``relay``, only the replica
whose ``term`` holds the leader lease runs a fleet coordinator (a fresh one per term,
made by ``make_fleet``); the others forward their engines' fleet frames to it and
deliver its shares to their engines through control_plane/replicas/relay.py. The leader
treats an engine on another replica like one of its own: same allocator, frames through
the relay. Everything here runs on the socket thread; the reads a coordinator needs go
to the log reader and come back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from functools import partial

from control_plane.config.follower import Catchup
from control_plane.fencing import Term
from control_plane.fleet.coordinator import FleetCoordinator, quiet_until
from control_plane.push.drops import DropLog
from control_plane.push.log_reader import LogReader, TermStart
from control_plane.push.outbox import Outbox
from control_plane.push.peers import Peer, PeerTable
from control_plane.replicas.relay import DOWN, FleetRelay
from output_rate_core import protocol as p

logger = logging.getLogger(__name__)

# A home replica lists to the leader the engines it heard from within this (the leader
# takes them as heard; an engine that moved away drops off its old home's list).
LIVE_WITHIN_S = 2.5 * p.HEARTBEAT_INTERVAL_S


class FleetLeadership:
    def __init__(
        self,
        *,
        peers: PeerTable,
        outbox: Outbox,
        drops: DropLog,
        reader: LogReader,
        fleet: FleetCoordinator | None,
        relay: FleetRelay | None,
        term: Callable[[], Term | None] | None,
        make_fleet: Callable[[float], FleetCoordinator] | None,
        share_lease_s: float,
        share_kept_s: float = 0.0,
    ) -> None:
        """``term``, ``make_fleet`` (with a relay): this replica's leadership now, and a
        coordinator for a new term (given when its first shares may go out)."""
        self._peers = peers
        self._outbox = outbox
        self._drops = drops
        self._reader = reader
        # Fleet shares (docs/fleet.md); None: engines are only told the limits (or, with a
        # relay, this replica does not lead now). Read by REST threads.
        self.fleet = fleet
        self.relay = relay
        self.replica_id = None if relay is None else relay.replica_id
        self._term = term
        self._make_fleet = make_fleet
        self._share_lease_s = share_lease_s
        # How long past its lease an engine may keep its shares (the "keep" outage policy).
        self._share_kept_s = share_kept_s
        # The token of the term self.fleet was made for.
        self._fleet_token: int | None = None
        # The token of the term whose coordinator is being made (its reads are under way).
        self._starting_token: int | None = None
        # When this replica's coordinator last sent shares (monotonic): a later term of
        # its own waits their lease out like a successor's.
        self._last_shares_at = float("-inf")
        # engine id -> the replica holding its connection (engines of other replicas the
        # leader's coordinator serves through the relay)
        self._home_of: dict[str, str] = {}
        # The change-log version self.fleet's limit model is at (None: not loaded), the
        # newest the log has shown, and whether a read for the model is under way (one
        # at a time: each starts where the last one left the model).
        self._model_version: int | None = None
        self._log_version = 0
        self._model_reading = False
        # Shares frames this replica's coordinators sent (local or relayed).
        self.num_share_frames = 0

    @property
    def allocating(self) -> bool:
        """This replica runs the fleet allocator now."""
        return self.fleet is not None

    def fleet_size(self, role: p.Role, joining: Iterable[str] = ()) -> tuple[int, bool]:
        """The fleet size a snapshot for ``role`` carries (an engine's safe shares hold
        from its first request), counting the engines it goes to (``joining``) that the
        fleet does not know yet: a second engine starts at L / 2, not L. And whether the
        live engine rows of every replica count too (the reader then counts the rows and
        the joining engines together; the larger wins)."""
        if role == p.API_ROLE or (self.fleet is None and self.relay is None):
            return 1, False
        fleet = self.fleet
        if self.relay is None:
            assert fleet is not None
            return fleet.size_with(joining), False
        return (0 if fleet is None else fleet.size_with(joining)), True

    # ---- every loop turn ---------------------------------------------------------------

    def lead(self) -> None:
        """Run a coordinator while this replica leads, a fresh one per term, and keep its
        limit model at the change log's newest version."""
        if self._term is not None and self._make_fleet is not None:
            self._follow_term(self._term())
        self._refresh_model()

    def step(self) -> None:
        if self.fleet is not None:
            self._send_shares(self.fleet.step())

    def on_log(self, newest: int) -> None:
        """A read of the change log showed versions up to ``newest``."""
        self._log_version = max(self._log_version, newest)

    # ---- what engines say ----------------------------------------------------------------

    def heard(self, peer: Peer) -> None:
        if self.fleet is not None and peer.role == p.ENGINE_ROLE:
            self.fleet.heard(peer.engine_id)

    def on_frame(self, peer: Peer, message: p.Demand | p.ShareAck) -> None:
        """A fleet frame from a bound engine core."""
        if self.fleet is None and self.relay is not None:
            self.relay.up(peer.engine_id, p.encode(message))  # to the leader
        elif self.fleet is None:
            self._drops.note("fleet message while fleet shares are off")
        elif isinstance(message, p.Demand):
            self._send_shares(self.fleet.on_demand(peer.engine_id, message))
        elif not self.fleet.on_ack(peer.engine_id, message):
            self._drops.note("share ack of another epoch", repr(peer.engine_id))

    def left(self, peer: Peer) -> None:
        """An engine core said Leaving: out of the fleet now, its shares to the others
        (through the leader, with replicas)."""
        if peer.role != p.ENGINE_ROLE:
            return
        if self.fleet is None and self.relay is not None:
            self.relay.up(peer.engine_id, p.encode(p.Leaving(peer.engine_id)))
        elif self.fleet is not None:
            self._send_shares(self.fleet.leave(peer.engine_id))

    def beat(self, now: float) -> None:
        """A follower lists its live engines to the leader."""
        if self.relay is not None and self.fleet is None:
            self.relay.live(
                [
                    peer.engine_id
                    for peer in self._peers.all()
                    if peer.role == p.ENGINE_ROLE
                    and peer.proven
                    and now - peer.last_seen <= LIVE_WITHIN_S
                ]
            )

    def take_relayed(self) -> None:
        if self.relay is None:
            return
        for kind, arrived in self.relay.take():
            if kind == DOWN:
                # From the leader: shares for engines connected here.
                for engine_id, frame in arrived.batch.frames:
                    self._send_to(engine_id, frame)
                continue
            fleet = self.fleet
            if fleet is None:
                continue  # taken just before the term ended: restated within 5 s
            home = arrived.from_replica
            for engine_id in arrived.batch.live or ():
                if not self._peers.holds(engine_id, p.ENGINE_ROLE):
                    self._home_of[engine_id] = home
                    fleet.heard(engine_id)
            for engine_id, frame in arrived.batch.frames:
                try:
                    message = p.decode(frame, max_bytes=p.MAX_ENGINE_MESSAGE_BYTES)
                except p.ProtocolError as e:
                    self._drops.note("malformed relayed frame", str(e)[:200])
                    continue
                if self._peers.holds(engine_id, p.ENGINE_ROLE):
                    if home != self.replica_id:
                        continue  # older than what it says on its connection here
                else:
                    self._home_of[engine_id] = home
                if isinstance(message, p.Demand):
                    self._send_shares(fleet.on_demand(engine_id, message))
                elif isinstance(message, p.ShareAck):
                    fleet.on_ack(engine_id, message)
                elif isinstance(message, p.Leaving):
                    self._home_of.pop(engine_id, None)
                    self._send_shares(fleet.leave(engine_id))

    # ---- internals -------------------------------------------------------------------------

    def _follow_term(self, term: Term | None) -> None:
        if term is None:
            self._starting_token = None
            if self.fleet is not None:
                logger.info("replica %s no longer allocates fleet shares", self.replica_id)
                self.fleet = None
                self._fleet_token = None
                self._model_version = None
                self._home_of.clear()
            return
        if term.token in (self._fleet_token, self._starting_token):
            return
        self._starting_token = term.token
        # Engines that may be enforcing its predecessor's shares, or safe shares of a
        # fleet that counts them; and the limits now, not at the next read of the log.
        self._reader.term_start(
            self._share_lease_s,
            partial(self._start_term, term.token),
            partial(self._term_not_started, term.token),
        )

    def _start_term(self, token: int, start: TermStart) -> None:
        if self._starting_token != token:
            return  # that term ended while its reads were under way
        self._starting_token = None
        term = self._term() if self._term is not None else None
        if term is None or term.token != token:
            return
        assert self._make_fleet is not None
        stopped_at = max(term.predecessor_ended_at, self._last_shares_at)
        fleet = self._make_fleet(quiet_until(stopped_at, self._share_lease_s, self._share_kept_s))
        fleet.await_engines(start.live)
        self._refresh(fleet, Catchup(None, snapshot=start.snapshot))
        self.fleet = fleet
        self._fleet_token = token
        self._home_of.clear()
        logger.info(
            "replica %s allocates fleet shares (leader token %d): first shares in %.1fs, "
            "after the whole demand of %d engine(s) of the fleet",
            self.replica_id,
            token,
            max(0.0, fleet.quiet_until - time.monotonic()),
            len(start.live),
        )

    def _term_not_started(self, token: int) -> None:
        if self._starting_token == token:
            self._starting_token = None  # tried again at the next turn

    def _refresh_model(self) -> None:
        fleet = self.fleet
        if fleet is None or self._model_reading:
            return
        if self._model_version is not None and self._model_version >= self._log_version:
            return
        self._model_reading = True
        self._reader.model(
            self._model_version, partial(self._model_read, fleet), self._model_not_read
        )

    def _model_read(self, fleet: FleetCoordinator, read: Catchup) -> None:
        self._model_reading = False
        if fleet is not self.fleet:
            return  # its term ended while the read was under way
        assert read.at == self._model_version, "one model read at a time"
        self._refresh(fleet, read)

    def _model_not_read(self) -> None:
        self._model_reading = False  # tried again at the next turn

    def _refresh(self, fleet: FleetCoordinator, read: Catchup) -> None:
        fleet.catch_up(read)
        self._model_version = read.version

    def _send_shares(self, frames: list[tuple[str, p.Shares]]) -> None:
        if not frames:
            return
        if self._term is not None:
            term = self._term()
            if term is None or term.token != self._fleet_token:
                return  # the term ended since the step: a successor decides now
            self._last_shares_at = time.monotonic()
        for engine_id, message in frames:
            if self._peers.holds(engine_id, p.ENGINE_ROLE):
                if self._send_to(engine_id, p.encode(message)):
                    self.num_share_frames += 1
                continue
            home = self._home_of.get(engine_id)
            if self.relay is not None and home is not None and self._fleet_token is not None:
                self.relay.down(home, self._fleet_token, engine_id, p.encode(message))
                self.num_share_frames += 1

    def _send_to(self, engine_id: str, frame: bytes) -> bool:
        """To the engine core's connection here, once it has its snapshot: whether it
        went. (A frame before is dropped: after its snapshot the engine says its whole
        demand and gets a full table.)"""
        bound = self._peers.connection(engine_id, p.ENGINE_ROLE)
        if bound is None or not bound[1].has_snapshot:
            return False
        self._outbox.send(bound[0], frame)
        return True
