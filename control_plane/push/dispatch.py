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

from control_plane.push.drops import DropLog
from control_plane.push.leadership import FleetLeadership
from control_plane.push.peers import MAX_HELD_MESSAGES, Peer, PeerTable
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
        usage: UsageBook | None,
        key_uses: Callable[[Mapping[str, float]], None] | None,
    ) -> None:
        """``usage``, ``key_uses``: where usage and key-use reports go (None: nobody
        reads them; they are dropped)."""
        self._peers = peers
        self._publisher = publisher
        self._leadership = leadership
        self._status = status
        self._drops = drops
        self._usage = usage
        self._key_uses = key_uses
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
        }

    def route(self, identity: bytes, message: p.Message, key: str | None) -> None:
        """A message from the connection ``identity`` (``key``: its CURVE key)."""
        handle = self._handlers.get(type(message))
        if handle is None:
            self._drops.note("server-only message from an engine")
            return
        now = time.monotonic()
        peer = self._peers.get(identity)
        if peer is None:
            self._on_unbound(identity, message, key, now)
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

    def _on_unbound(self, identity: bytes, message: p.Message, key: str | None, now: float) -> None:
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
        engine_id, role = message.engine_id, message.role
        model = message.model if isinstance(message, p.Hello | p.Heartbeat) else ""
        if not self._peers.admit(engine_id, role, key, now):
            return
        if self._status.claims:
            self._peers.hold(identity, engine_id, role, model, key)
            self._status.claim(engine_id, role, partial(self._claimed, identity))
            return
        self._bound(identity, self._peers.bind(identity, engine_id, role, model, key, now), now)

    def _claimed(self, identity: bytes, claimed: bool) -> None:
        pending = self._peers.settle(identity)
        if claimed:
            now = time.monotonic()
            peer = self._peers.bind(
                identity, pending.engine_id, pending.role, pending.model, pending.key, now
            )
            self._bound(identity, peer, now)
        for message in pending.held:
            self.route(identity, message, pending.key)

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

    def _on_key_use(self, identity: bytes, peer: Peer, message: p.KeyUse, now: float) -> None:
        if self._key_uses is not None:
            self._key_uses(message.used)

    def _on_fleet_frame(
        self, identity: bytes, peer: Peer, message: p.Demand | p.ShareAck, now: float
    ) -> None:
        self._leadership.on_frame(peer, message)
