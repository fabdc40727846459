"""Who is who on the push endpoint: the connections bound to an engine id and role.

Trust (docs/live-push.md, "Trust model"): a connection (ROUTER identity) is bound to one
engine id and role by its first HELLO (or, after a server restart, its first
HEARTBEAT/RESYNC). The bind is refused, and logged, when that (id, role) is held by
another live connection, when the connection's CURVE key is listed with other engine
ids, or when too many connections are bound, or bound and unproven; ``admit`` says why
(a ``Refusal``: what the connection is told, and for a clash who holds the id). With replicas the
database also has a say (another replica may hold the id): while it is asked, the bind
is pending and counts as held. Used on the socket thread only, except ``all``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from control_plane.push.demand import DemandBounds
from control_plane.push.drops import DropLog
from output_rate_core import protocol as p

# Connections bound to an engine at once; more are refused (each holds a snapshot's
# worth of socket buffer while it reads).
MAX_PEERS = 1024
# Connections that have not proved themselves yet (acknowledged a snapshot) at once, and
# how long one may stay so: a flood of fresh engine ids takes at most these slots, for at
# most that long, and never a known engine's (docs/live-push.md, "Unproven connections").
MAX_UNPROVEN_PEERS = 64
UNPROVEN_GRACE_S = 10.0
# Messages a connection sends while the database decides its bind, handled once it is
# decided; an engine sends one HELLO and then a heartbeat a second.
MAX_HELD_MESSAGES = 16


@dataclass
class Peer:
    """One engine connection, keyed by its ROUTER identity."""

    engine_id: str
    model: str = ""
    # The vLLM it said it runs in its HELLO ("": not known); None: bound by a heartbeat
    # or resync (after a restart of this server), so not said.
    vllm_version: str | None = None
    # An engine core, or the API server of the engine with that id.
    role: p.Role = p.ENGINE_ROLE
    # Z85 CURVE public key of the connection (None on plain TCP).
    key: str | None = None
    # Where it connects from (ZMQ's Peer-Address: the IP on TCP; "" when unknown).
    address: str = ""
    # The last version sent to it (snapshot or delta; -1: no snapshot yet) and the last
    # it applied.
    sent_version: int = -1
    applied_version: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    last_snapshot_at: float = float("-inf")
    # The version of a snapshot sent and not acknowledged yet (None: none in flight).
    unread_snapshot: int | None = None
    # It acknowledged a snapshot here, or its engine id applied one before: only then is
    # it shown in GET /engines and exempt from the unproven bound.
    proven: bool = False
    bound_at: float = field(default_factory=time.monotonic)
    first_seen: datetime = field(default_factory=lambda: datetime.now(UTC))
    # What its status row last said, and when it was written (None: not written yet).
    written_status: tuple[str, int] | None = None
    status_written_at: float = float("-inf")
    # The capacity it said at HELLO (0: not said), and its demand as passed on.
    capacity: int = 0
    demand: DemandBounds | None = None

    @property
    def has_snapshot(self) -> bool:
        """A snapshot went to it: frames other than a snapshot may follow."""
        return self.sent_version >= 0


@dataclass(frozen=True)
class Refusal:
    """Why a connection may not bind: what it is told, and for a clash (``engine_id_in_use``)
    who holds the id, for the log and GET /engines."""

    refused: p.Refused
    holder_address: str = ""
    # Since when the holder was heard, or which replica holds the id.
    held_for: str = ""


@dataclass
class PendingBind:
    """A connection's bind while the database is asked whether another replica holds
    its engine id."""

    engine_id: str
    role: p.Role
    model: str
    key: str | None
    known: bool
    vllm_version: str | None = None
    address: str = ""
    # The capacity it said at HELLO (0: not said).
    capacity: int = 0
    # What the connection sent meanwhile, handled once the bind is decided.
    held: list[p.Message] = field(default_factory=list)


class PeerTable:
    def __init__(
        self,
        drops: DropLog,
        *,
        client_keys: dict[str, frozenset[str] | None] | None,
        engine_timeout_s: float,
    ) -> None:
        """``client_keys``: CURVE key -> the engine ids it may claim (None: any); None:
        any connection may claim any id (plain TCP, or no allow-list)."""
        self._drops = drops
        self._client_keys = client_keys
        self._engine_timeout_s = engine_timeout_s
        # ROUTER identity -> peer; read (copied) by other threads for metrics.
        self._peers: dict[bytes, Peer] = {}
        # ROUTER identity -> its bind the database is asked about
        self._pending: dict[bytes, PendingBind] = {}
        # (engine id, role) -> the identity bound to it, or whose bind is pending
        self._owners: dict[tuple[str, p.Role], bytes] = {}
        # Engine ids that applied a version here before (loaded at start, then as peers
        # prove themselves): they bind whatever the unproven connections hold.
        self._known_ids: set[str] = set()
        self.num_unproven = 0

    # ---- who is who ---------------------------------------------------------------

    def get(self, identity: bytes) -> Peer | None:
        return self._peers.get(identity)

    def pending(self, identity: bytes) -> PendingBind | None:
        return self._pending.get(identity)

    def connection(self, engine_id: str, role: p.Role) -> tuple[bytes, Peer] | None:
        """The bound connection of (engine_id, role), if any."""
        identity = self._owners.get((engine_id, role))
        if identity is None:
            return None
        peer = self._peers.get(identity)
        return None if peer is None else (identity, peer)

    def holds(self, engine_id: str, role: p.Role) -> bool:
        """A connection here is bound to (engine_id, role), or binding."""
        return (engine_id, role) in self._owners

    def items(self) -> list[tuple[bytes, Peer]]:
        """The bound connections, to go over while some are forgotten."""
        return list(self._peers.items())

    def all(self) -> list[Peer]:
        """The bound peers now (any thread: one copy under the GIL)."""
        return list(self._peers.values())

    # ---- binding ------------------------------------------------------------------

    def know(self, engine_ids: set[str]) -> None:
        """Engine ids that applied a version here before this server started."""
        self._known_ids |= engine_ids

    def admit(self, engine_id: str, role: p.Role, key: str | None, now: float) -> Refusal | None:
        """None if a new connection may bind to (engine_id, role), else why not (counted
        with the drops). The allow-list check is the same for both roles: an API server
        holds its engine's key, or one listed with its engine id."""
        if self._client_keys is not None:
            allowed = self._client_keys.get(key or "")
            if key not in self._client_keys or (allowed is not None and engine_id not in allowed):
                self._drops.note(
                    "engine key may not claim that engine id",
                    f"key {(key or '?')[:8]}... claimed {engine_id!r}",
                )
                return Refusal(
                    p.Refused("engine_id_not_allowed", "this CURVE key may not claim it")
                )
        owner = self._owners.get((engine_id, role))
        if owner is not None:
            holder = self._peers.get(owner)
            # A holder whose bind is pending has just said HELLO: it is live.
            if holder is None or now - holder.last_seen <= self._engine_timeout_s:
                self._drops.note(
                    "engine id already bound to another live connection",
                    f"{engine_id!r} ({role})",
                )
                pending = self._pending.get(owner)
                address = holder.address if holder is not None else ""
                if pending is not None:
                    address = pending.address
                heard = (
                    "binding now" if holder is None else f"heard {now - holder.last_seen:.1f}s ago"
                )
                return Refusal(
                    p.Refused(
                        "engine_id_in_use",
                        f"another live connection ({address or '?'}) holds it; give each "
                        "engine a unique --output-rate-engine-id",
                    ),
                    holder_address=address,
                    held_for=heard,
                )
            self.forget(owner)
        if len(self._peers) + len(self._pending) >= MAX_PEERS:
            self._drops.note("too many connections", f"at most {MAX_PEERS}")
            return Refusal(p.Refused("server_full", f"at most {MAX_PEERS} connections"))
        num_unproven = self.num_unproven + sum(not b.known for b in self._pending.values())
        if engine_id not in self._known_ids and num_unproven >= MAX_UNPROVEN_PEERS:
            self._drops.note(
                "too many connections that have not acknowledged a snapshot",
                f"at most {MAX_UNPROVEN_PEERS}",
            )
            return Refusal(
                p.Refused("server_full", f"at most {MAX_UNPROVEN_PEERS} new engines at once")
            )
        return None

    def hold(
        self,
        identity: bytes,
        engine_id: str,
        role: p.Role,
        model: str,
        key: str | None,
        vllm_version: str | None = None,
        address: str = "",
        capacity: int = 0,
    ) -> None:
        """An admitted bind waits for the database: it holds (engine_id, role) and counts
        against the bounds meanwhile."""
        assert identity not in self._peers and identity not in self._pending
        known = engine_id in self._known_ids
        self._pending[identity] = PendingBind(
            engine_id, role, model, key, known, vllm_version, address, capacity
        )
        self._owners[engine_id, role] = identity

    def settle(self, identity: bytes) -> PendingBind:
        """The database answered: the pending bind no longer holds anything."""
        pending = self._pending.pop(identity)
        if self._owners.get((pending.engine_id, pending.role)) == identity:
            del self._owners[pending.engine_id, pending.role]
        return pending

    def bind(
        self,
        identity: bytes,
        engine_id: str,
        role: p.Role,
        model: str,
        key: str | None,
        now: float,
        vllm_version: str | None = None,
        address: str = "",
        capacity: int = 0,
    ) -> Peer:
        """Bind an admitted connection to (engine_id, role)."""
        assert identity not in self._peers
        known = engine_id in self._known_ids
        peer = self._peers[identity] = Peer(
            engine_id=engine_id,
            model=model,
            vllm_version=vllm_version,
            role=role,
            key=key,
            address=address,
            proven=known,
            bound_at=now,
            last_seen=now,
            capacity=capacity,
        )
        self._owners[engine_id, role] = identity
        if not known:
            self.num_unproven += 1
        return peer

    def prove(self, peer: Peer) -> None:
        """A peer acknowledged a snapshot: it reads and speaks the protocol."""
        if peer.proven:
            return
        peer.proven = True
        self.num_unproven -= 1
        self._known_ids.add(peer.engine_id)

    def forget(self, identity: bytes) -> Peer | None:
        peer = self._peers.pop(identity, None)
        if peer is None:
            return None
        if not peer.proven:
            self.num_unproven -= 1
        if self._owners.get((peer.engine_id, peer.role)) == identity:
            del self._owners[peer.engine_id, peer.role]
        return peer

    def expire(self, now: float) -> list[Peer]:
        """Forget the connections that did not prove themselves within UNPROVEN_GRACE_S
        and those silent for the engine timeout; the silent ones whose (engine id, role)
        no other connection took since are returned (their rows say disconnected)."""
        silent = []
        for identity, peer in list(self._peers.items()):
            if not peer.proven and now - peer.bound_at > UNPROVEN_GRACE_S:
                self.forget(identity)  # it never acknowledged its snapshot: no row to mark
            elif now - peer.last_seen > self._engine_timeout_s:
                self.forget(identity)
                if peer.proven and not self.holds(peer.engine_id, peer.role):
                    silent.append(peer)
        return silent
