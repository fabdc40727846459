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
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import zmq

from control_plane import services
from control_plane.db import Database
from control_plane.push.usage import UsageBook
from engine_ext import protocol as p
from engine_ext.zmq_util import make_socket

logger = logging.getLogger(__name__)

# Engine status rows are written at most this often (batched).
STATUS_FLUSH_INTERVAL_S = 0.2
# At most one snapshot per engine this often on RESYNC (below the engines' retry period).
RESYNC_MIN_INTERVAL_S = p.RESYNC_RETRY_S / 2


@dataclass
class Peer:
    """One engine connection, keyed by its ROUTER identity."""

    engine_id: str
    model: str = ""
    # The last version sent to it (snapshot or delta) and the last it applied.
    sent_version: int = -1
    applied_version: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    last_snapshot_at: float = float("-inf")
    first_seen: datetime = field(default_factory=lambda: datetime.now(UTC))


class _AllowedKeys:
    """ZAP credentials provider: admits only the listed engine public keys."""

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = {k.strip().encode() for k in keys if k.strip()}

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class PushServer:
    def __init__(
        self,
        *,
        endpoint: str,
        db: Database,
        secret_key: str | None = None,
        client_public_keys: Iterable[str] | None = None,
        engine_timeout_s: float = 5.0,
        heartbeat_interval_s: float = p.HEARTBEAT_INTERVAL_S,
        poll_interval_s: float = 1.0,
    ) -> None:
        self.endpoint = endpoint
        self._db = db
        self._secret_key = secret_key
        self._client_keys = None if client_public_keys is None else list(client_public_keys)
        self._engine_timeout_s = engine_timeout_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._poll_interval_s = poll_interval_s
        self.usage = UsageBook()
        # ROUTER identity -> peer; read (copied) by other threads for metrics.
        self.peers: dict[bytes, Peer] = {}
        self.num_dropped = 0
        self._context = zmq.Context()
        self._authenticator: Any = None
        self._wake_address = f"inproc://output-rate-wake-{id(self)}"
        self._wake_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_sender: zmq.Socket | None = None
        self._dirty: set[bytes] = set()
        self._last_flush = 0.0
        # (version, encoded snapshot): engines connecting together share one read.
        self._snapshot_cache: tuple[int, bytes] | None = None

    @classmethod
    def for_app(cls, app: Any, settings: Any) -> PushServer:
        """The server `output-rate serve` runs, wired to the app's commits and /usage."""
        secret = settings.zmq_secret_key.get_secret_value() if settings.zmq_secret_key else None
        client_keys = [k for k in (settings.zmq_client_keys or "").split(",") if k.strip()]
        if secret is None:
            logger.warning(
                "!!! OUTPUT_RATE_ZMQ_SECRET_KEY is not set: the push endpoint %s is plain TCP; "
                "anyone who reaches it can read every limit (run `output-rate keys`) !!!",
                settings.zmq_endpoint,
            )
        elif not client_keys:
            logger.warning(
                "OUTPUT_RATE_ZMQ_CLIENT_KEYS is empty: any engine that knows the server's "
                "public key may connect and read limits"
            )
        server = cls(
            endpoint=settings.zmq_endpoint,
            db=app.state.db,
            secret_key=secret,
            client_public_keys=client_keys or None,
            engine_timeout_s=settings.engine_timeout_s,
        )
        app.state.db.on_commit.append(server.notify)
        app.state.usage_source = server.usage
        registry = getattr(app.state, "metrics_registry", None)
        if registry is not None:
            from control_plane.push.metrics import PushCollector

            registry.register(PushCollector(server))
        return server

    # ---- lifecycle (any thread) -------------------------------------------

    def start(self) -> None:
        if self._secret_key is not None and self._client_keys is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self._authenticator = ThreadAuthenticator(self._context)
            self._authenticator.start()
            self._authenticator.configure_curve_callback(
                domain="*", credentials_provider=_AllowedKeys(self._client_keys)
            )
        router = make_socket(
            self._context,
            zmq.ROUTER,
            server_secret_key=self._secret_key,
            max_message_bytes=p.MAX_ENGINE_MESSAGE_BYTES,
        )
        router.bind(self.endpoint)
        if self.endpoint.endswith(":0"):
            self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        wake_receiver = make_socket(self._context, zmq.PAIR)
        wake_receiver.bind(self._wake_address)
        self._wake_sender = make_socket(self._context, zmq.PAIR)
        self._wake_sender.connect(self._wake_address)
        self._mark_all_disconnected()
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
        """Called after a write committed (any thread): publish it now."""
        with self._wake_lock:
            if self._wake_sender is not None:
                # Again: a wake-up is already pending.
                with contextlib.suppress(zmq.Again):
                    self._wake_sender.send(b"", zmq.NOBLOCK)

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
                    if router in events:
                        self._drain(router)
                    now = time.monotonic()
                    if now >= next_poll:
                        next_poll = now + self._poll_interval_s
                        publish = True
                    if publish:
                        self._publish(router)
                    if now >= next_beat:
                        next_beat = now + self._heartbeat_interval_s
                        self._beat(router, now)
                    if self._dirty and now - self._last_flush >= STATUS_FLUSH_INTERVAL_S:
                        self._last_flush = now
                        self._flush_status()
                except Exception:
                    # A database hiccup must not end the push: log, back off, go on.
                    logger.exception("output-rate push loop error")
                    self._stop.wait(0.5)
        finally:
            router.close(linger=0)
            wake.close(linger=0)

    def _drain(self, router: zmq.Socket) -> None:
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.num_dropped += 1
                continue
            identity, frame = frames
            try:
                message = p.decode(frame, max_bytes=p.MAX_ENGINE_MESSAGE_BYTES)
            except p.ProtocolError as e:
                self.num_dropped += 1
                logger.warning("dropped a bad message from an engine: %s", e)
                continue
            self._handle(router, identity, message)

    def _handle(self, router: zmq.Socket, identity: bytes, message: p.Message) -> None:
        peer = self.peers.get(identity)
        if isinstance(message, p.Hello):
            peer = self.peers[identity] = Peer(engine_id=message.engine_id, model=message.model)
            self._send_snapshot(router, identity, peer)
        elif isinstance(message, p.Heartbeat | p.Resync) and peer is None:
            # An engine we do not know (this server restarted; its socket reconnected
            # without a HELLO): it starts over with a snapshot.
            if not message.engine_id:
                self.num_dropped += 1
                return
            model = message.model if isinstance(message, p.Heartbeat) else ""
            peer = self.peers[identity] = Peer(engine_id=message.engine_id, model=model)
            self._send_snapshot(router, identity, peer)
        elif peer is None:
            if not isinstance(message, p.Usage | p.Ack):
                self.num_dropped += 1
                return
            if isinstance(message, p.Usage):
                self.usage.add(message)
            return
        elif isinstance(message, p.Resync):
            # Resyncs queued in an engine's socket while we were down arrive in a burst:
            # one snapshot answers them all (an engine that missed it asks again later).
            if time.monotonic() - peer.last_snapshot_at >= RESYNC_MIN_INTERVAL_S:
                self._send_snapshot(router, identity, peer)
        elif isinstance(message, p.Ack):
            if message.version <= peer.sent_version:
                peer.applied_version = message.version
        elif isinstance(message, p.Heartbeat):
            # An engine's heartbeat restates what it applied (a lost ack is harmless).
            if message.version <= peer.sent_version:
                peer.applied_version = message.version
        elif isinstance(message, p.Usage):
            self.usage.add(message)
        else:
            self.num_dropped += 1
            return
        peer.last_seen = time.monotonic()
        self._dirty.add(identity)

    def _snapshot_frame(self) -> tuple[int, bytes]:
        cached = self._snapshot_cache
        if cached is not None and cached[0] == self._db.read_now(services.current_version):
            return cached
        snap = self._db.read_now(services.load_snapshot)
        message = p.Snapshot(snap.version, snap.default_rate, snap.tiers, snap.users)
        self._snapshot_cache = (snap.version, p.encode(message))
        return self._snapshot_cache

    def _send_snapshot(self, router: zmq.Socket, identity: bytes, peer: Peer) -> None:
        version, frame = self._snapshot_frame()
        self._send(router, identity, frame)
        peer.sent_version = version
        peer.last_snapshot_at = time.monotonic()

    def _publish(self, router: zmq.Socket) -> None:
        if not self.peers:
            return
        oldest = min(peer.sent_version for peer in self.peers.values())
        changes = self._db.read_now(services.load_changes_since, oldest)
        if not changes:
            return
        frames: dict[int, bytes] = {}
        for version, ops in changes:
            try:
                frames[version] = p.encode(p.Delta(version, p.ops_from_rows(ops)))
            except p.ProtocolError:
                logger.exception("config change %d cannot be sent", version)
                break
        newest = changes[-1][0]
        for identity, peer in list(self.peers.items()):
            if peer.sent_version + 1 in frames:
                while peer.sent_version + 1 in frames:
                    self._send(router, identity, frames[peer.sent_version + 1])
                    peer.sent_version += 1
            elif peer.sent_version < newest:
                # Its next version is not in the log (pruned, or unsendable): start over.
                self._send_snapshot(router, identity, peer)

    def _send(self, router: zmq.Socket, identity: bytes, frame: bytes) -> None:
        """The single send path (the fault-injection seam of the tests)."""
        # Again: a peer that does not read; its heartbeat shows the gap and it resyncs.
        with contextlib.suppress(zmq.Again):
            router.send_multipart([identity, frame], zmq.NOBLOCK)

    def _beat(self, router: zmq.Socket, now: float) -> None:
        for identity, peer in list(self.peers.items()):
            if now - peer.last_seen > self._engine_timeout_s:
                del self.peers[identity]
                self._dirty.discard(identity)
                if not any(other.engine_id == peer.engine_id for other in self.peers.values()):
                    self._set_disconnected(peer.engine_id)
                continue
            # Sent after every frame up to sent_version: the engine checks it holds that.
            self._send(router, identity, p.encode(p.Heartbeat(peer.sent_version)))

    # ---- engine status in the database ------------------------------------

    def _flush_status(self) -> None:
        # One row per engine_id: the last peer seen under an id wins.
        seen = {
            peer.engine_id: services.EngineSeen(
                engine_id=peer.engine_id,
                model=peer.model,
                applied_version=peer.applied_version,
                first_seen=peer.first_seen,
            )
            for peer in (self.peers.get(identity) for identity in self._dirty)
            if peer is not None
        }
        self._db.write_now(services.record_engines, seen=list(seen.values()))
        self._dirty.clear()

    def _set_disconnected(self, engine_id: str) -> None:
        self._db.write_now(services.disconnect_engines, engine_ids=[engine_id])

    def _mark_all_disconnected(self) -> None:
        self._db.write_now(services.disconnect_engines, engine_ids=None)
