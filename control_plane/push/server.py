"""Control-plane side of the live push: the ROUTER socket engines connect to.

One thread owns the socket. It answers HELLO/RESYNC with a snapshot read from
the database and sends every committed change, read back from the durable
``config_changes`` log, to each engine in version order from the version it
last got: nothing is published before it is committed and nothing is lost.
Writers wake it through ``notify`` right after their commit; a poll of the
log every ``poll_interval_s`` is the safety net. It tracks acks and
heartbeats and records engine status in the ``engines`` table (GET /engines).

Security: with a secret key the endpoint is a CURVE server; engines must know
its public key. With ``client_public_keys`` a ZAP handler admits only those
engine keys; a peer with another key completes no handshake, so it neither
reads limits nor reports anything.

Trust (docs/live-push.md, "Trust model"): a connection (ROUTER identity) is bound
to one engine id and role by its first HELLO (or, after a server restart, its first
HEARTBEAT/RESYNC). The bind is refused, and logged, when that (id, role) is held by
another live connection, or when the connection's CURVE key is listed with other
engine ids. ACK, HEARTBEAT and USAGE count only from a bound connection under its
own id. Snapshots go to one connection at most once per SNAPSHOT_MIN_INTERVAL_S, and
only once it acknowledged the last one (or SNAPSHOT_UNREAD_RESEND_S passed); at most
PEER_SEND_HWM frames wait for one connection (docs/live-push.md, "Slow readers").

Roles (docs/control-plane.md, "API keys"): an engine core (role "engine") gets the
limits; its API server (role "api", the same engine id) gets the API keys only: a
snapshot of the keys and every delta with only its key ops (the version kept, so it
sees no gap). An API server is no fleet member and sends no usage or demand; it may
report its keys' last use (KEY_USE), which goes to ``key_uses``.

Replicas (docs/replicas.md, "One fleet allocator"): with a ``relay``, only the replica
whose ``term`` holds the leader lease runs a fleet coordinator (a fresh one per term,
made by ``make_fleet``); the others forward their engines' fleet frames to it and deliver
its shares to their engines through control_plane/replicas/relay.py. The leader treats an
engine on another replica like one of its own: same allocator, frames through the relay.
An engine core's id is bound on one replica at a time (the engines row names its home).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
import zmq

from control_plane.config import service as config
from control_plane.config.follower import StoredLog
from control_plane.db import Database
from control_plane.engines import service as engines
from control_plane.fleet.coordinator import FleetCoordinator, quiet_until
from control_plane.keys import service as keys
from control_plane.push import keys as push_keys
from control_plane.replicas.lease import NotLeader, Term, fleet_work_token
from control_plane.replicas.relay import DOWN, FleetRelay
from control_plane.settings import DEFAULT_ENGINE_RETENTION_S, DEFAULT_ENGINE_TIMEOUT_S, Settings
from control_plane.usage.book import UsageBook
from output_rate_core import protocol as p
from output_rate_core.zmq_util import make_socket

logger = logging.getLogger(__name__)

# Engine status rows are written at most this often (batched).
STATUS_FLUSH_INTERVAL_S = 0.2
# A row whose version and model are unchanged is rewritten only this often: enough for
# last_seen and for the fleet-wide bind (a home heard within the engine timeout, 5 s by
# default), while every usage report or heartbeat no longer costs a row update.
STATUS_REFRESH_S = 1.0
# At most one snapshot per connection this often, whatever asks for it (HELLO, RESYNC,
# a pruned change log); below the engines' retry period.
SNAPSHOT_MIN_INTERVAL_S = p.RESYNC_RETRY_S / 2
# A peer gets its next snapshot only once it acknowledged the last one, or after this
# long (a snapshot lost on the way): a peer that does not read cannot make the server
# queue snapshot after snapshot for it.
SNAPSHOT_UNREAD_RESEND_S = 30.0
# Frames queued for one peer before ZMQ drops further frames to it (the peer then sees
# a gap and asks for a snapshot): a reading engine drains deltas as fast as they come.
PEER_SEND_HWM = 64
# Engine messages handled before the loop publishes and beats again.
MAX_MESSAGES_PER_DRAIN = 1000
# Connections bound to an engine at once; more are refused (each holds a snapshot's
# worth of socket buffer while it reads).
MAX_PEERS = 1024
# Connections that have not proved themselves yet (acknowledged a snapshot) at once, and
# how long one may stay so: a flood of fresh engine ids takes at most these slots, for at
# most that long, and never a known engine's (docs/live-push.md, "Unproven connections").
MAX_UNPROVEN_PEERS = 64
UNPROVEN_GRACE_S = 10.0
# Malformed or refused engine messages: the first of each kind is logged, then one
# summary line per this interval with the counts.
DROP_LOG_INTERVAL_S = 60.0
# How long a closing server's socket keeps trying to deliver its goodbyes.
GOODBYE_LINGER_MS = 500
# Engine rows not seen for the retention are deleted this often.
RETENTION_SWEEP_INTERVAL_S = 60.0
# The ops each role receives of a delta (the rest are left out, the version kept).
KEY_OPS = (p.SetKey, p.DeleteKey)
# A home replica lists to the leader the engines it heard from within this (the leader
# takes them as heard; an engine that moved away drops off its old home's list).
LIVE_WITHIN_S = 2.5 * p.HEARTBEAT_INTERVAL_S


def ops_for(role: p.Role, ops: list[p.Op]) -> list[p.Op]:
    """An API server gets the key ops only; an engine core the limit ops only."""
    want_keys = role == p.API_ROLE
    return [op for op in ops if isinstance(op, KEY_OPS) == want_keys]


class DropLog:
    """Counts dropped engine messages by reason; logs the first of each reason at once
    and then one summary per interval (a flood of bad frames is not a flood of lines)."""

    def __init__(self, interval_s: float = DROP_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.total = 0
        self._seen: set[str] = set()
        self._pending: dict[str, int] = {}
        self._next_summary = 0.0

    def note(self, reason: str, detail: str = "") -> None:
        self.total += 1
        if reason not in self._seen:
            self._seen.add(reason)
            shown = f" ({detail})" if detail else ""
            logger.warning("dropped an engine message: %s%s", reason, shown)
            return
        self._pending[reason] = self._pending.get(reason, 0) + 1

    def flush(self, now: float) -> None:
        if now < self._next_summary:
            return
        self._next_summary = now + self.interval_s
        if self._pending:
            counts = ", ".join(f"{n} {reason}" for reason, n in sorted(self._pending.items()))
            logger.warning("dropped engine messages in the last %.0fs: %s", self.interval_s, counts)
            self._pending.clear()


@dataclass
class Peer:
    """One engine connection, keyed by its ROUTER identity."""

    engine_id: str
    model: str = ""
    # An engine core, or the API server of the engine with that id.
    role: p.Role = p.ENGINE_ROLE
    # Z85 CURVE public key of the connection (None on plain TCP).
    key: str | None = None
    # The last version sent to it (snapshot or delta) and the last it applied.
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


def _snapshot_due(peer: Peer, now: float) -> bool:
    """Whether a peer that asks for a snapshot gets one now (at most one in flight)."""
    elapsed = now - peer.last_snapshot_at
    if peer.unread_snapshot is not None:
        return elapsed >= SNAPSHOT_UNREAD_RESEND_S
    return elapsed >= SNAPSHOT_MIN_INTERVAL_S


class _AllowedKeys:
    """ZAP credentials provider: admits the listed engine public keys (None: any key).
    The authenticator then labels each message with its key (the User-Id property)."""

    def __init__(self, keys: Iterable[str] | None) -> None:
        self.keys = None if keys is None else {k.encode() for k in keys}

    def callback(self, domain: str, key: bytes) -> bool:
        return self.keys is None or key in self.keys


class PushServer:
    def __init__(
        self,
        *,
        endpoint: str,
        db: Database,
        secret_key: str | None = None,
        client_public_keys: Iterable[str] | Mapping[str, frozenset[str] | None] | None = None,
        usage: UsageBook | None = None,
        fleet: FleetCoordinator | None = None,
        key_uses: Callable[[Mapping[str, float]], None] | None = None,
        engine_timeout_s: float = DEFAULT_ENGINE_TIMEOUT_S,
        engine_retention_s: float = DEFAULT_ENGINE_RETENTION_S,
        heartbeat_interval_s: float = p.HEARTBEAT_INTERVAL_S,
        poll_interval_s: float = 1.0,
        relay: FleetRelay | None = None,
        term: Callable[[], Term | None] | None = None,
        make_fleet: Callable[[float], FleetCoordinator] | None = None,
        share_lease_s: float = 10.0,
    ) -> None:
        self.endpoint = endpoint
        self._db = db
        self._secret_key = secret_key
        # key -> engine ids it may claim (None: any); None: every key is admitted.
        self._client_keys: dict[str, frozenset[str] | None] | None
        if client_public_keys is None:
            self._client_keys = None
        elif isinstance(client_public_keys, Mapping):
            self._client_keys = dict(client_public_keys)
        else:
            self._client_keys = dict.fromkeys(client_public_keys)
        self._engine_timeout_s = engine_timeout_s
        self._engine_retention_s = engine_retention_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._poll_interval_s = poll_interval_s
        # Where usage reports go (None: nobody reads them; they are dropped).
        self._usage = usage
        # Fleet shares (docs/fleet.md); None: engines are only told the limits (or, with a
        # relay, this replica does not lead now).
        self.fleet = fleet
        self.relay = relay
        self.replica_id = None if relay is None else relay.replica_id
        # With a relay: this replica's leadership now, and a coordinator for a new term
        # (given when its first shares may go out).
        self._term = term
        self._make_fleet = make_fleet
        self._share_lease_s = share_lease_s
        # The token of the term self.fleet was made for.
        self._fleet_token: int | None = None
        # When this replica's coordinator last sent shares (monotonic): a later term of
        # its own waits their lease out like a successor's.
        self._last_shares_at = float("-inf")
        # engine id -> the replica holding its connection (engines of other replicas the
        # leader's coordinator serves through the relay)
        self._home_of: dict[str, str] = {}
        # Shares frames this replica's coordinators sent (local or relayed).
        self.num_share_frames = 0
        # Engine ids refused because another replica holds them.
        self.num_binds_refused_elsewhere = 0
        self.num_status_rows_written = 0
        # Where API servers' key-use reports go (None: nobody records them).
        self._key_uses = key_uses
        # ROUTER identity -> peer; read (copied) by other threads for metrics.
        self.peers: dict[bytes, Peer] = {}
        # (engine id, role) -> the identity bound to it
        self._owners: dict[tuple[str, p.Role], bytes] = {}
        self.drops = DropLog()
        # HELLO/RESYNC answered with nothing: a snapshot went to that connection just now.
        self.num_snapshots_refused = 0
        self.num_snapshots_sent = 0
        self.num_unproven = 0
        # Engine ids that applied a version here before (loaded at start, then as peers
        # prove themselves): they bind whatever the unproven connections hold.
        self._known_ids: set[str] = set()
        self.num_frames_unsent = 0
        self._next_sweep = 0.0
        self._context = zmq.Context()
        self._authenticator: Any = None
        self._wake_address = f"inproc://output-rate-wake-{id(self)}"
        self._wake_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_sender: zmq.Socket | None = None
        self._dirty: set[bytes] = set()
        self._last_flush = 0.0
        # The newest change-log version _publish has sent out (written by the
        # IO thread, read by notify() on any thread: an int, read atomically).
        self._published_version = 0
        # role -> (version, fleet size, encoded snapshot): peers connecting together share
        # one read.
        self._snapshot_cache: dict[p.Role, tuple[int, int, bytes]] = {}

    @property
    def num_dropped(self) -> int:
        return self.drops.total

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        db: Database,
        usage: UsageBook,
        fleet: FleetCoordinator | None = None,
        key_uses: Callable[[Mapping[str, float]], None] | None = None,
        relay: FleetRelay | None = None,
        term: Callable[[], Term | None] | None = None,
        make_fleet: Callable[[float], FleetCoordinator] | None = None,
    ) -> PushServer:
        """The server `output-rate serve` runs; warns about what its settings leave open."""
        secret = settings.zmq_secret_key.get_secret_value() if settings.zmq_secret_key else None
        client_keys = settings.allowed_engine_keys()
        if secret is None:
            logger.warning(
                "!!! OUTPUT_RATE_ZMQ_SECRET_KEY is not set: the push endpoint %s is plain TCP; "
                "anyone who reaches it can read every limit (run `output-rate keys`) !!!",
                settings.zmq_endpoint,
            )
        elif not client_keys:
            logger.warning(
                "OUTPUT_RATE_ZMQ_CLIENT_KEYS is empty: any engine that knows the server's "
                "public key may connect, read limits and claim any engine id"
            )
        else:
            unbound = [key for key, ids in client_keys.items() if ids is None]
            if unbound:
                logger.warning(
                    "OUTPUT_RATE_ZMQ_CLIENT_KEYS: %d key(s) may claim any engine id (%s); "
                    "bind each to its engines with KEY=engine-id",
                    len(unbound),
                    ", ".join(k[:8] + "..." for k in unbound),
                )
        if secret is not None:
            logger.info(
                "engines connect with %s",
                push_keys.public_key_flag(zmq.curve_public(secret.encode()).decode()),
            )
        return cls(
            endpoint=settings.zmq_endpoint,
            db=db,
            secret_key=secret,
            client_public_keys=client_keys or None,
            usage=usage,
            fleet=fleet,
            key_uses=key_uses,
            engine_timeout_s=settings.engine_timeout_s,
            engine_retention_s=settings.engine_retention_s,
            poll_interval_s=settings.push_poll_interval_s,
            relay=relay,
            term=term,
            make_fleet=make_fleet,
            share_lease_s=settings.share_lease_s,
        )

    # ---- lifecycle (any thread) -------------------------------------------

    def start(self) -> None:
        if self._secret_key is not None:
            # Always a ZAP handler with CURVE: it admits the listed keys (or any) and
            # labels every message with its key, which binds engine ids to keys.
            from zmq.auth.thread import ThreadAuthenticator

            self._authenticator = ThreadAuthenticator(self._context)
            self._authenticator.start()
            self._authenticator.configure_curve_callback(
                domain="*",
                credentials_provider=_AllowedKeys(
                    None if self._client_keys is None else self._client_keys.keys()
                ),
            )
        router = make_socket(
            self._context,
            zmq.ROUTER,
            server_secret_key=self._secret_key,
            max_message_bytes=p.MAX_ENGINE_MESSAGE_BYTES,
        )
        router.setsockopt(zmq.SNDHWM, PEER_SEND_HWM)
        # A full queue raises Again instead of dropping in silence (see _send).
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.bind(self.endpoint)
        if self.endpoint.endswith(":0"):
            self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        wake_receiver = make_socket(self._context, zmq.PAIR)
        wake_receiver.bind(self._wake_address)
        self._wake_sender = make_socket(self._context, zmq.PAIR)
        self._wake_sender.connect(self._wake_address)
        self._mark_all_disconnected()
        self._known_ids = self._db.run_now(engines.applied_engine_ids)
        self._thread = threading.Thread(
            target=self._loop, args=(router, wake_receiver), name="output-rate-push", daemon=True
        )
        self._thread.start()
        logger.info(
            "output-rate push endpoint on %s (%s)",
            self.endpoint,
            "CURVE" if self._secret_key else "plain TCP",
        )

    def notify(self, version: int) -> None:
        """Called after a write committed (any thread): publish ``version`` now."""
        if version <= self._published_version:
            return  # already sent (a later write's wake-up carried it)
        with self._wake_lock:
            if self._wake_sender is not None:
                # Again: a wake-up is already pending.
                with contextlib.suppress(zmq.Again):
                    self._wake_sender.send(b"", zmq.NOBLOCK)

    def wake(self) -> None:
        """Have the socket thread look at what arrived (the relay; any thread)."""
        with self._wake_lock:
            if self._wake_sender is not None:
                with contextlib.suppress(zmq.Again):
                    self._wake_sender.send(b"", zmq.NOBLOCK)

    @property
    def allocating(self) -> bool:
        """This replica runs the fleet allocator now."""
        return self.fleet is not None

    def close(self) -> None:
        self._stop.set()
        self.notify(0)
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._wake_lock:
            if self._wake_sender is not None:
                self._wake_sender.close(linger=0)
                self._wake_sender = None
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    # ---- the socket thread ------------------------------------------------

    def _loop(self, router: zmq.Socket, wake: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        next_beat = next_poll = 0.0
        try:
            while not self._stop.is_set():
                try:
                    events = dict(poller.poll(100))
                    publish = wake in events
                    while wake.poll(0):
                        wake.recv()
                    self._lead()
                    if router in events:
                        self._drain(router)
                    if self.relay is not None:
                        self._take_relayed(router)
                    now = time.monotonic()
                    if now >= next_poll:
                        next_poll = now + self._poll_interval_s
                        publish = True
                    if publish:
                        self._publish(router)
                    if now >= next_beat:
                        next_beat = now + self._heartbeat_interval_s
                        self._beat(router, now)
                    if self.fleet is not None:
                        self._send_shares(router, self.fleet.step())
                    if self._dirty and now - self._last_flush >= STATUS_FLUSH_INTERVAL_S:
                        self._last_flush = now
                        self._flush_status(now)
                except Exception:
                    # A database hiccup must not end the push: log, back off, go on.
                    logger.exception("output-rate push loop error")
                    self._stop.wait(0.5)
        finally:
            # Shutting down: tell every peer, so engines move to another replica at once
            # (the frames get a moment to leave before the socket goes); with replicas,
            # let go of them first, so that the next replica may bind them.
            self._let_go_of_engines()
            goodbye = p.encode(p.Goodbye())
            for identity in list(self.peers):
                self._send(router, identity, goodbye)
            router.close(linger=GOODBYE_LINGER_MS)
            wake.close(linger=0)

    def _drain(self, router: zmq.Socket) -> None:
        # Bounded: a peer that never stops sending must not starve publishing and beats.
        for _ in range(MAX_MESSAGES_PER_DRAIN):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.drops.note("not one frame")
                continue
            identity, frame = frames[0].bytes, frames[1]
            try:
                message = p.decode(frame.bytes, max_bytes=p.MAX_ENGINE_MESSAGE_BYTES)
            except p.ProtocolError as e:
                self.drops.note("malformed", str(e)[:200])
                continue
            key = frame.get("User-Id") if self._secret_key is not None else None
            self._handle(router, identity, message, str(key) if key else None)

    def _handle(
        self, router: zmq.Socket, identity: bytes, message: p.Message, key: str | None = None
    ) -> None:
        now = time.monotonic()
        peer = self.peers.get(identity)
        if isinstance(message, p.Snapshot | p.Delta | p.Shares | p.Goodbye):
            self.drops.note("server-only message from an engine")
            return
        if peer is None:
            # HELLO binds a connection; so does a HEARTBEAT or RESYNC from a connection
            # we do not know (this server restarted; the engine's socket redialled
            # without a HELLO). Anything else from an unbound connection counts for nothing.
            if not isinstance(message, p.Hello | p.Heartbeat | p.Resync) or not message.engine_id:
                self.drops.note("message from a connection that said no HELLO")
                return
            model = message.model if isinstance(message, p.Hello | p.Heartbeat) else ""
            peer = self._bind(identity, message.engine_id, message.role, model, key, now)
            if peer is not None:
                self._send_snapshot(router, identity, peer)
            return
        claimed = getattr(message, "engine_id", peer.engine_id) or peer.engine_id
        if claimed != peer.engine_id:
            self.drops.note(
                "engine id other than the connection's",
                f"{peer.engine_id!r} sent {type(message).__name__} as {claimed!r}",
            )
            return
        if getattr(message, "role", peer.role) != peer.role:
            self.drops.note(
                "role other than the connection's",
                f"{peer.engine_id!r} ({peer.role}) sent {type(message).__name__} as "
                f"{getattr(message, 'role', '')!r}",
            )
            return
        if peer.role == p.API_ROLE and isinstance(message, p.Usage | p.Demand | p.ShareAck):
            self.drops.note("engine-core message from an API server", f"{type(message).__name__}")
            return
        if isinstance(message, p.Hello | p.Resync):
            # A repeated HELLO or queued RESYNCs (after our restart they arrive in a
            # burst): one snapshot per SNAPSHOT_MIN_INTERVAL_S answers them all; an
            # engine that missed it asks again later.
            if isinstance(message, p.Hello) and message.model:
                peer.model = message.model
            if _snapshot_due(peer, now):
                self._send_snapshot(router, identity, peer)
            else:
                self.num_snapshots_refused += 1
        elif isinstance(message, p.Ack | p.Heartbeat):
            # An engine's heartbeat restates what it applied (a lost ack is harmless).
            if message.version <= peer.sent_version:
                peer.applied_version = message.version
            unread = peer.unread_snapshot
            if isinstance(message, p.Ack) and unread is not None and message.version >= unread:
                peer.unread_snapshot = None
                self._prove(peer)
        elif isinstance(message, p.KeyUse):
            if peer.role != p.API_ROLE:
                self.drops.note("key use from an engine core", repr(peer.engine_id))
                return
            if self._key_uses is not None:
                self._key_uses(message.used)
        elif isinstance(message, p.Demand | p.ShareAck):
            if self.fleet is None and self.relay is not None:
                self.relay.up(peer.engine_id, p.encode(message))  # to the leader
            elif self.fleet is None:
                self.drops.note("fleet message while fleet shares are off")
            elif isinstance(message, p.Demand):
                self._send_shares(router, self.fleet.on_demand(peer.engine_id, message))
            elif not self.fleet.on_ack(peer.engine_id, message):
                self.drops.note("share ack of another epoch", repr(peer.engine_id))
        else:
            assert isinstance(message, p.Usage)
            if self._usage is not None:
                self._usage.add(message, engine_id=peer.engine_id)
        peer.last_seen = now
        if self.fleet is not None and peer.role == p.ENGINE_ROLE:
            self.fleet.heard(peer.engine_id)
        self._dirty.add(identity)

    def _send_shares(self, router: zmq.Socket, frames: list[tuple[str, p.Shares]]) -> None:
        if not frames:
            return
        if self._term is not None:
            term = self._term()
            if term is None or term.token != self._fleet_token:
                return  # the term ended since the step: a successor decides now
            self._last_shares_at = time.monotonic()
        for engine_id, message in frames:
            identity = self._owners.get((engine_id, p.ENGINE_ROLE))
            if identity is not None:
                self._send(router, identity, p.encode(message))
                self.num_share_frames += 1
                continue
            home = self._home_of.get(engine_id)
            if self.relay is not None and home is not None and self._fleet_token is not None:
                self.relay.down(home, self._fleet_token, engine_id, p.encode(message))
                self.num_share_frames += 1

    # ---- one allocator for the fleet (replicas) ------------------------------

    def _lead(self) -> None:
        """Run a coordinator while this replica leads, a fresh one per term."""
        if self._term is None or self._make_fleet is None:
            return  # one replica: the coordinator given, always
        term = self._term()
        if term is None:
            if self.fleet is not None:
                logger.info("replica %s no longer allocates fleet shares", self.replica_id)
                self.fleet = None
                self._fleet_token = None
                self._home_of.clear()
            return
        if term.token == self._fleet_token:
            return
        stopped_at = max(term.predecessor_ended_at, self._last_shares_at)
        fleet = self._make_fleet(quiet_until(stopped_at, self._share_lease_s))
        # Engines that may be enforcing its predecessor's shares, or safe shares of a
        # fleet that counts them.
        live: list[str] = self._db.run_now(engines.live_engine_ids, within_s=self._share_lease_s)
        fleet.await_engines(live)
        # The limits now, not at the next read of the change log.
        fleet.refresh(StoredLog(self._db))
        self.fleet = fleet
        self._fleet_token = term.token
        self._home_of.clear()
        logger.info(
            "replica %s allocates fleet shares (leader token %d): first shares in %.1fs, "
            "after the whole demand of %d engine(s) of the fleet",
            self.replica_id,
            term.token,
            max(0.0, fleet.quiet_until - time.monotonic()),
            len(live),
        )

    def _take_relayed(self, router: zmq.Socket) -> None:
        assert self.relay is not None
        for kind, arrived in self.relay.take():
            if kind == DOWN:
                # From the leader: shares for engines connected here.
                for engine_id, frame in arrived.batch.frames:
                    identity = self._owners.get((engine_id, p.ENGINE_ROLE))
                    if identity is not None:
                        self._send(router, identity, frame)
                continue
            fleet = self.fleet
            if fleet is None:
                continue  # taken just before the term ended: restated within 5 s
            home = arrived.from_replica
            for engine_id in arrived.batch.live or ():
                if (engine_id, p.ENGINE_ROLE) not in self._owners:
                    self._home_of[engine_id] = home
                    fleet.heard(engine_id)
            for engine_id, frame in arrived.batch.frames:
                try:
                    message = p.decode(frame, max_bytes=p.MAX_ENGINE_MESSAGE_BYTES)
                except p.ProtocolError as e:
                    self.drops.note("malformed relayed frame", str(e)[:200])
                    continue
                if (engine_id, p.ENGINE_ROLE) in self._owners:
                    if home != self.replica_id:
                        continue  # older than what it says on its connection here
                else:
                    self._home_of[engine_id] = home
                if isinstance(message, p.Demand):
                    self._send_shares(router, fleet.on_demand(engine_id, message))
                elif isinstance(message, p.ShareAck):
                    fleet.on_ack(engine_id, message)

    def _bind(
        self,
        identity: bytes,
        engine_id: str,
        role: p.Role,
        model: str,
        key: str | None,
        now: float,
    ) -> Peer | None:
        """Bind a new connection to (engine_id, role), or refuse (logged, counted). The
        allow-list check is the same for both roles: an API server holds its engine's
        key, or one listed with its engine id."""
        if self._secret_key is not None and self._client_keys is not None:
            allowed = self._client_keys.get(key or "")
            if key not in self._client_keys or (allowed is not None and engine_id not in allowed):
                self.drops.note(
                    "engine key may not claim that engine id",
                    f"key {(key or '?')[:8]}... claimed {engine_id!r}",
                )
                return None
        owner = self._owners.get((engine_id, role))
        holder = self.peers.get(owner) if owner is not None else None
        if holder is not None and owner != identity:
            if now - holder.last_seen <= self._engine_timeout_s:
                self.drops.note(
                    "engine id already bound to another live connection",
                    f"{engine_id!r} ({role})",
                )
                return None
            self._forget(owner)  # type: ignore[arg-type]
        if len(self.peers) >= MAX_PEERS:
            self.drops.note("too many connections", f"at most {MAX_PEERS}")
            return None
        known = engine_id in self._known_ids
        if not known and self.num_unproven >= MAX_UNPROVEN_PEERS:
            self.drops.note(
                "too many connections that have not acknowledged a snapshot",
                f"at most {MAX_UNPROVEN_PEERS}",
            )
            return None
        if self.replica_id is not None:
            try:
                claimed = self._db.run_now(
                    engines.claim_engine,
                    engine_id=engine_id,
                    replica=self.replica_id,
                    timeout_s=self._engine_timeout_s,
                    role=role,
                )
            except Exception as e:  # a claim racing another replica's: the other has it
                logger.debug("claim of %r failed: %s", engine_id, e)
                claimed = False
            if not claimed:
                self.num_binds_refused_elsewhere += 1
                self.drops.note("engine id live on another replica", f"{engine_id!r} ({role})")
                return None
        peer = self.peers[identity] = Peer(
            engine_id=engine_id, model=model, role=role, key=key, proven=known, bound_at=now
        )
        peer.last_seen = now
        self._owners[engine_id, role] = identity
        if known:
            self._dirty.add(identity)
        else:
            self.num_unproven += 1
        return peer

    def _prove(self, peer: Peer) -> None:
        """A peer acknowledged a snapshot: it reads and speaks the protocol."""
        if peer.proven:
            return
        peer.proven = True
        self.num_unproven -= 1
        self._known_ids.add(peer.engine_id)
        identity = self._owners.get((peer.engine_id, peer.role))
        if identity is not None:
            self._dirty.add(identity)

    def _forget(self, identity: bytes) -> Peer | None:
        peer = self.peers.pop(identity, None)
        self._dirty.discard(identity)
        if peer is not None and not peer.proven:
            self.num_unproven -= 1
        if peer is not None and self._owners.get((peer.engine_id, peer.role)) == identity:
            del self._owners[peer.engine_id, peer.role]
        return peer

    def _snapshot_frame(self, role: p.Role) -> tuple[int, bytes]:
        # The fleet size rides along: an engine's safe shares hold from its first request.
        if role == p.API_ROLE or (self.fleet is None and self.relay is None):
            num_engines = 1
        elif self.relay is None:
            num_engines = self.fleet.num_engines if self.fleet is not None else 1
        else:  # engines of every replica
            num_engines = max(
                1,
                self.fleet.num_engines if self.fleet is not None else 0,
                self._db.run_now(engines.count_live_engines, timeout_s=self._engine_timeout_s),
            )
        cached = self._snapshot_cache.get(role)
        if (
            cached is not None
            and cached[1] == num_engines
            and cached[0] == self._db.run_now(config.current_version)
        ):
            return cached[0], cached[2]
        if role == p.API_ROLE:
            snap = self._db.run_now(keys.load_key_snapshot)
        else:
            snap = msgspec.structs.replace(
                self._db.run_now(config.load_snapshot), num_engines=num_engines
            )
        frame = p.encode(snap)
        self._snapshot_cache[role] = (snap.version, num_engines, frame)
        return snap.version, frame

    def _send_snapshot(self, router: zmq.Socket, identity: bytes, peer: Peer) -> None:
        version, frame = self._snapshot_frame(peer.role)
        queued = self._send(router, identity, frame)
        peer.sent_version = version
        peer.last_snapshot_at = time.monotonic()
        # A snapshot that could not even be queued is not waiting to be read.
        peer.unread_snapshot = version if queued else None
        self.num_snapshots_sent += queued

    def _publish(self, router: zmq.Socket) -> None:
        if self.fleet is not None:
            self.fleet.refresh(StoredLog(self._db))
        if not self.peers:
            return
        oldest = min(peer.sent_version for peer in self.peers.values())
        changes = self._db.run_now(config.changes_since, oldest)
        if not changes:
            return
        ops_of: dict[int, list[p.Op]] = {}
        for version, rows in changes:
            try:
                ops_of[version] = p.ops_from_rows(rows)
            except p.ProtocolError:
                logger.exception("config change %d cannot be sent", version)
                break
        newest = changes[-1][0]
        if len(ops_of) == len(changes):
            self._published_version = max(self._published_version, newest)
        # role -> version -> its delta as that role receives it
        deltas = {
            role: {v: p.encode(p.Delta(v, ops_for(role, ops))) for v, ops in ops_of.items()}
            for role in {peer.role for peer in self.peers.values()}
        }
        for identity, peer in list(self.peers.items()):
            frames = deltas[peer.role]
            if peer.sent_version + 1 in frames:
                while peer.sent_version + 1 in frames:
                    self._send(router, identity, frames[peer.sent_version + 1])
                    peer.sent_version += 1
            elif peer.sent_version < newest and _snapshot_due(peer, time.monotonic()):
                # Its next version is not in the log (pruned, or unsendable): start over
                # (within the snapshot rate limit; the next poll tries again).
                self._send_snapshot(router, identity, peer)

    def _send(self, router: zmq.Socket, identity: bytes, frame: bytes) -> bool:
        """The single send path (the fault-injection seam of the tests): whether the frame
        was queued. Not when the peer's queue is full (it does not read: its heartbeat
        will show the gap and it resyncs) or the peer is gone."""
        try:
            router.send_multipart([identity, frame], zmq.NOBLOCK)
        except zmq.Again:
            self.num_frames_unsent += 1
            return False
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            return False
        return True

    def _beat(self, router: zmq.Socket, now: float) -> None:
        for identity, peer in list(self.peers.items()):
            if not peer.proven and now - peer.bound_at > UNPROVEN_GRACE_S:
                self._forget(identity)  # it never acknowledged its snapshot: no row to mark
                continue
            if now - peer.last_seen > self._engine_timeout_s:
                self._forget(identity)
                if peer.proven and (peer.engine_id, peer.role) not in self._owners:
                    self._set_disconnected(peer.engine_id, peer.role)
                continue
            # Sent after every frame up to sent_version: the engine checks it holds that.
            self._send(router, identity, p.encode(p.Heartbeat(peer.sent_version)))
        if self.relay is not None and self.fleet is None:
            self.relay.live(
                [
                    peer.engine_id
                    for peer in self.peers.values()
                    if peer.role == p.ENGINE_ROLE
                    and peer.proven
                    and now - peer.last_seen <= LIVE_WITHIN_S
                ]
            )
        self.drops.flush(now)
        if now >= self._next_sweep:
            self._next_sweep = now + RETENTION_SWEEP_INTERVAL_S
            may_sweep, fence = fleet_work_token(self._term)
            if may_sweep:
                with contextlib.suppress(NotLeader):  # the lease moved: the new leader sweeps
                    self._db.run_now(
                        engines.forget_engines, retention_s=self._engine_retention_s, fence=fence
                    )

    # ---- engine status in the database ------------------------------------

    def _status_due(self, now: float) -> list[Peer]:
        """The dirty peers whose row is written now: a changed version or model at once,
        an unchanged one once STATUS_REFRESH_S passed; the others stay dirty."""
        due, waiting = [], set()
        for identity in self._dirty:
            peer = self.peers.get(identity)
            if peer is None or not peer.proven:
                continue
            if (
                peer.written_status != (peer.model, peer.applied_version)
                or now - peer.status_written_at >= STATUS_REFRESH_S
            ):
                due.append(peer)
            else:
                waiting.add(identity)
        self._dirty = waiting
        return due

    def _flush_status(self, now: float) -> None:
        due = self._status_due(now)
        if not due:
            return
        for peer in due:
            peer.written_status = (peer.model, peer.applied_version)
            peer.status_written_at = now
        # One row per engine_id, written by its engine core and its API server (one
        # connection per engine id and role).
        seen = {
            (peer.engine_id, peer.role): engines.EngineSeen(
                engine_id=peer.engine_id,
                model=peer.model,
                applied_version=peer.applied_version,
                first_seen=peer.first_seen,
                role=peer.role,
            )
            for peer in due
        }
        try:
            moved = self._db.run_now(
                engines.record_engines, seen=list(seen.values()), replica=self.replica_id
            )
            self.num_status_rows_written += len(seen)
        except Exception:
            # One row the database refuses must not keep every other engine's row stale:
            # write them one by one and let go of the engines whose row fails.
            moved = set()
            for engine in seen.values():
                try:
                    moved_one: set[tuple[str, p.Role]] = self._db.run_now(
                        engines.record_engines, seen=[engine], replica=self.replica_id
                    )
                    moved |= moved_one
                    self.num_status_rows_written += 1
                except Exception as e:
                    self.drops.note("engine status row refused by the database", str(e)[:200])
                    owner = self._owners.get((engine.engine_id, engine.role))
                    if owner is not None:
                        self._forget(owner)
        for engine_id, role in moved:
            # Another replica claimed it since (this replica was paused, or cut off): what
            # still arrives from it here is old. Its row is the other replica's to write.
            self.drops.note("engine bound on another replica since", f"{engine_id!r} ({role})")
            owner = self._owners.get((engine_id, role))
            if owner is not None:
                self._forget(owner)

    def _let_go_of_engines(self) -> None:
        if self.replica_id is None:
            return
        for role in (p.ENGINE_ROLE, p.API_ROLE):
            ids = [
                peer.engine_id for peer in self.peers.values() if peer.role == role and peer.proven
            ]
            try:
                self._db.run_now(
                    engines.disconnect_engines, engine_ids=ids, role=role, replica=self.replica_id
                )
            except Exception as e:  # the database is away: claimable after the timeout
                logger.warning("could not let go of this replica's engines: %s", e)

    def _set_disconnected(self, engine_id: str, role: p.Role) -> None:
        self._db.run_now(
            engines.disconnect_engines, engine_ids=[engine_id], role=role, replica=self.replica_id
        )

    def _mark_all_disconnected(self) -> None:
        """At start: the engines (and API servers) this replica held before are not
        connected (with replicas, the others' are theirs to say)."""
        for role in (p.ENGINE_ROLE, p.API_ROLE):
            self._db.run_now(
                engines.disconnect_engines, engine_ids=None, role=role, replica=self.replica_id
            )
