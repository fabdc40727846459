"""What an engine's message does. The socket loop decodes it and hands it here; a
dispatch table keyed by its type hands it on to the part that owns what it changes.

Trust (docs/live-push.md, "Trust model"): a connection is bound to one engine id and role
by its first HELLO (or, after a server restart, its first HEARTBEAT/RESYNC), as the peer
table admits (with replicas, once the database says no other replica holds the id).
ACK, HEARTBEAT, USAGE and the rest count only from a bound connection under its own id
and role, and only the types that role sends: an API server is no fleet member and
sends no usage or demand; only it reports its keys' last use (KEY_USE).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from control_plane.push.claims import RefusedClaims
from control_plane.push.demand import DemandBounds, engine_capacity
from control_plane.push.drops import DropLog
from control_plane.push.flagged import FlaggedDemands
from control_plane.push.leadership import FleetLeadership
from control_plane.push.outbox import Outbox
from control_plane.push.peers import MAX_HELD_MESSAGES, Peer, PeerTable, Refusal
from control_plane.push.publisher import Publisher
from control_plane.push.status import StatusWriter
from control_plane.usage.book import UsageBook
from output_rate_core import protocol as p

# What binds a connection this server does not know: HELLO, and a HEARTBEAT or RESYNC
# (this server restarted; the engine's socket redialled without a HELLO).
BINDING = (p.Hello, p.Heartbeat, p.Resync)
# What only an engine core sends (an API server is no fleet member).
ENGINE_CORE_ONLY = (p.Usage, p.Demand, p.ShareAck)

# What a bound connection's message does: (identity, peer, message, now).
Handler = Callable[[bytes, Peer, Any, float], None]


class Dispatcher:
    def __init__(
        self,
        *,
        peers: PeerTable,
        publisher: Publisher,
        leadership: FleetLeadership,
        status: StatusWriter,
        drops: DropLog,
        outbox: Outbox,
        claims: RefusedClaims,
        flagged: FlaggedDemands,
        usage: UsageBook | None,
        key_uses: Callable[[Mapping[str, float]], None] | None,
        welcome: Callable[[], bool] = lambda: True,
    ) -> None:
        """``usage``, ``key_uses``: where usage and key-use reports go (None: nobody
        reads them; they are dropped); ``welcome``: whether a connection may bind now
        (False: it is turned away with a Goodbye, to another replica)."""
        self._peers = peers
        self._publisher = publisher
        self._leadership = leadership
        self._status = status
        self._drops = drops
        self._outbox = outbox
        self._claims = claims
        self._flagged = flagged
        self._usage = usage
        self._key_uses = key_uses
        self._welcome = welcome
        # Demand frames refused (over the rate), and frames that flagged their engine.
        self.num_demand_refused = 0
        self.num_implausible_demands = 0
        # message type -> what it does from a bound connection (the server's own types
        # are missing: an engine does not send them)
        self._handlers: dict[type[p.Message], Handler] = {
            p.Hello: self._on_hello,
            p.Resync: self._on_resync,
            p.Ack: self._on_ack,
            p.Heartbeat: self._on_heartbeat,
            p.Usage: self._on_usage,
            p.KeyUse: self._on_key_use,
            p.Demand: self._on_fleet_frame,
            p.ShareAck: self._on_fleet_frame,
            p.Leaving: self._on_leaving,
        }

    def route(
        self, identity: bytes, message: p.Message, key: str | None, address: str = ""
    ) -> None:
        """A message from the connection ``identity`` (``key``: its CURVE key; ``address``:
        where it connects from, given for a connection not bound yet)."""
        handle = self._handlers.get(type(message))
        if handle is None:
            self._drops.note("server-only message from an engine")
            return
        now = time.monotonic()
        peer = self._peers.get(identity)
        if peer is None:
            self._on_unbound(identity, message, key, now, address)
        elif isinstance(message, p.Leaving):
            # Its last frame: nothing is heard or touched of it after this.
            if self._speaks_for(peer, message):
                handle(identity, peer, message, now)
        elif self._speaks_for(peer, message):
            handle(identity, peer, message, now)
            peer.last_seen = now
            self._leadership.heard(peer)
            self._status.touch(identity)

    def _speaks_for(self, peer: Peer, message: p.Message) -> bool:
        """Whether a bound connection's message counts: under its own engine id and
        role, of a type its role sends (a refusal is logged and counted)."""
        claimed = getattr(message, "engine_id", peer.engine_id) or peer.engine_id
        if claimed != peer.engine_id:
            self._drops.note(
                "engine id other than the connection's",
                f"{peer.engine_id!r} sent {type(message).__name__} as {claimed!r}",
            )
            return False
        if getattr(message, "role", peer.role) != peer.role:
            self._drops.note(
                "role other than the connection's",
                f"{peer.engine_id!r} ({peer.role}) sent {type(message).__name__} as "
                f"{getattr(message, 'role', '')!r}",
            )
            return False
        if peer.role == p.API_ROLE and isinstance(message, ENGINE_CORE_ONLY):
            self._drops.note("engine-core message from an API server", type(message).__name__)
            return False
        if peer.role == p.ENGINE_ROLE and isinstance(message, p.KeyUse):
            self._drops.note("key use from an engine core", repr(peer.engine_id))
            return False
        return True

    # ---- binding ----------------------------------------------------------------------

    def _on_unbound(
        self, identity: bytes, message: p.Message, key: str | None, now: float, address: str
    ) -> None:
        pending = self._peers.pending(identity)
        if pending is not None:
            # The database decides its bind: this waits for the answer.
            if len(pending.held) < MAX_HELD_MESSAGES:
                pending.held.append(message)
            else:
                self._drops.note(
                    "message while the bind is decided", f"at most {MAX_HELD_MESSAGES}"
                )
            return
        if not isinstance(message, BINDING) or not message.engine_id:
            self._drops.note("message from a connection that said no HELLO")
            return
        if not self._welcome():
            self._turn_away(identity)
            return
        engine_id, role = message.engine_id, message.role
        model = message.model if isinstance(message, p.Hello | p.Heartbeat) else ""
        capacity = message.capacity if isinstance(message, p.Hello) else 0
        vllm_version = message.vllm_version if isinstance(message, p.Hello) else None
        refusal = self._peers.admit(engine_id, role, key, now)
        if refusal is not None:
            self._refuse(identity, engine_id, role, address, refusal)
            return
        if self._status.claims:
            self._peers.hold(identity, engine_id, role, model, key, vllm_version, address, capacity)
            self._status.claim(engine_id, role, partial(self._claimed, identity))
            return
        peer = self._peers.bind(
            identity, engine_id, role, model, key, now, vllm_version, address, capacity
        )
        self._bound(identity, peer, now)

    def _claimed(self, identity: bytes, claimed: bool | None) -> None:
        pending = self._peers.settle(identity)
        if claimed is None or not self._welcome():
            self._turn_away(identity)  # the database did not answer: another replica may
            return
        if claimed:
            now = time.monotonic()
            peer = self._peers.bind(
                identity,
                pending.engine_id,
                pending.role,
                pending.model,
                pending.key,
                now,
                pending.vllm_version,
                pending.address,
                pending.capacity,
            )
            self._bound(identity, peer, now)
        else:
            elsewhere = Refusal(
                p.Refused(
                    "engine_id_in_use",
                    "a live engine on another control-plane replica holds it; give each "
                    "engine a unique --output-rate-engine-id",
                ),
                held_for="on another replica",
            )
            self._refuse(identity, pending.engine_id, pending.role, pending.address, elsewhere)
            return  # what it sent meanwhile is no one's
        for message in pending.held:
            self.route(identity, message, pending.key, pending.address)

    def _turn_away(self, identity: bytes) -> None:
        """This replica cannot bind now (cut off from its database): a Goodbye sends the
        engine to the next replica at once."""
        self._drops.note("engine turned away: the database does not answer")
        self._outbox.send(identity, p.encode(p.Goodbye()))

    def _refuse(
        self, identity: bytes, engine_id: str, role: p.Role, address: str, refusal: Refusal
    ) -> None:
        """Tell the connection why (it logs and counts it, and tries again with its next
        heartbeat); a clash of ids is logged here with both peers and shown in GET
        /engines."""
        if refusal.refused.reason == "engine_id_in_use":
            self._claims.note(
                engine_id,
                role,
                claimant=address,
                holder=refusal.holder_address,
                held_for=refusal.held_for,
            )
        self._outbox.send(identity, p.encode(refusal.refused))

    def _bound(self, identity: bytes, peer: Peer, now: float) -> None:
        if peer.proven:
            self._status.touch(identity)  # a known engine's row says connected at once
        self._publisher.send_snapshot(identity, peer, now)

    # ---- what a bound connection says -------------------------------------------------

    def _on_hello(self, identity: bytes, peer: Peer, message: p.Hello, now: float) -> None:
        # A repeated HELLO, like queued RESYNCs (after our restart they arrive in a
        # burst): one snapshot per SNAPSHOT_MIN_INTERVAL_S answers them all; an engine
        # that missed it asks again later.
        if message.model:
            peer.model = message.model
        peer.vllm_version = message.vllm_version
        self._publisher.ask_snapshot(identity, peer, now)

    def _on_resync(self, identity: bytes, peer: Peer, message: p.Resync, now: float) -> None:
        self._publisher.ask_snapshot(identity, peer, now)

    def _on_ack(self, identity: bytes, peer: Peer, message: p.Ack, now: float) -> None:
        if self._publisher.acked(peer, message.version):
            self._peers.prove(peer)

    def _on_heartbeat(self, identity: bytes, peer: Peer, message: p.Heartbeat, now: float) -> None:
        self._publisher.applied(peer, message.version)

    def _on_usage(self, identity: bytes, peer: Peer, message: p.Usage, now: float) -> None:
        if self._usage is not None:
            self._usage.add(message, engine_id=peer.engine_id)
        if peer.demand is not None:  # a fleet engine: which claims its usage bears out
            evidenced = peer.demand.usage(peer.engine_id, message, time.monotonic())
            if evidenced is not None:
                self._leadership.on_frame(peer, evidenced)

    def _on_key_use(self, identity: bytes, peer: Peer, message: p.KeyUse, now: float) -> None:
        if self._key_uses is not None:
            self._key_uses(message.used)

    def _on_fleet_frame(
        self, identity: bytes, peer: Peer, message: p.Demand | p.ShareAck, now: float
    ) -> None:
        if isinstance(message, p.Demand):
            message = self._bound_demand(peer, message)
        self._leadership.on_frame(peer, message)

    def demand_fits(self, identity: bytes, size: int) -> bool:
        """Whether a Demand frame of ``size`` bytes from this connection is within its
        rates (asked before the frame is decoded; one that is not is refused and counted
        here)."""
        peer = self._peers.get(identity)
        if peer is None:
            return True  # not bound: dropped as any message from it would be
        if self._demand_of(peer).admit(time.monotonic(), size):
            return True
        self.num_demand_refused += 1
        self._drops.note(
            "demand frames over the rate",
            f"{peer.engine_id!r}: at most {p.MAX_DEMAND_FRAMES_PER_S:g} frames and "
            f"{p.MAX_DEMAND_BYTES_PER_S} bytes a second",
        )
        return False

    def _demand_of(self, peer: Peer) -> DemandBounds:
        if peer.demand is None:
            peer.demand = DemandBounds(engine_capacity(peer.capacity))
        return peer.demand

    def _bound_demand(self, peer: Peer, demand: p.Demand) -> p.Demand:
        """What the allocator hears of an engine's demand (control_plane/push/demand.py;
        the rates were checked before the frame was decoded: demand_fits)."""
        passed, implausible = self._demand_of(peer).bound(demand)
        if implausible:
            self.num_implausible_demands += 1
            self._flagged.note(peer.engine_id, implausible)
            self._drops.note("implausible demand", f"{peer.engine_id!r}: {implausible}")
        return passed

    def _on_leaving(self, identity: bytes, peer: Peer, message: p.Leaving, now: float) -> None:
        """The engine (or its API server) stops: it leaves the fleet now, its row says
        disconnected, and its id is free for the engine that replaces it."""
        self._peers.forget(identity)
        if not self._peers.holds(peer.engine_id, peer.role):
            self._status.disconnect(peer.engine_id, peer.role)
        self._leadership.left(peer)
