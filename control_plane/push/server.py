"""Control-plane side of the live push: the ROUTER socket engines connect to.

One thread owns the socket and only moves bytes: it decodes what engines send and hands
each message to the dispatcher; the parts send what follows through the outbox. No
database call runs on it: reads and writes go to two threads of their own, whose results
come back through a queue and the wake-up socket. The parts, each owning its state:

- ``dispatch.py``: what an engine's message does (a table keyed by its type); binding;
- ``peers.py``: who is who (connections bound to an engine id and role; trust);
- ``publisher.py``: what each connection is sent: a snapshot first, then every committed
  change in version order, heartbeats after;
- ``log_reader.py``: every read of the configuration (the change log, snapshots), on its
  thread; a write committed here hands its ops in (``committed``), which are sent as
  they are when no version is missing before them; another replica's write (``notify``)
  is read from the log, and a poll of the log every ``poll_interval_s`` is the safety
  net;
- ``leadership.py``: the fleet allocator (with replicas, the leader's; the relay);
- ``status.py``: the engine rows (GET /engines), on its thread;
- ``outbox.py``: the one send path.

Security: with a secret key the endpoint is a CURVE server; engines must know its public
key. With ``client_public_keys`` a ZAP handler admits only those engine keys; a peer with
another key completes no handshake, so it neither reads limits nor reports anything.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import zmq

from control_plane.db import Commit, Database
from control_plane.fencing import Term
from control_plane.fleet.coordinator import FleetCoordinator
from control_plane.push import keys as push_keys
from control_plane.push.claims import RefusedClaims
from control_plane.push.database_watch import DatabaseWatch
from control_plane.push.dispatch import Dispatcher
from control_plane.push.drops import DropLog
from control_plane.push.flagged import FlaggedDemands
from control_plane.push.leadership import FleetLeadership
from control_plane.push.log_reader import LogRead, LogReader
from control_plane.push.outbox import Outbox
from control_plane.push.peers import PeerTable
from control_plane.push.publisher import Publisher
from control_plane.push.status import StatusWriter
from control_plane.replicas.relay import FleetRelay
from control_plane.settings import DEFAULT_ENGINE_RETENTION_S, DEFAULT_ENGINE_TIMEOUT_S, Settings
from control_plane.usage.book import UsageBook
from output_rate_core import protocol as p
from output_rate_core.zmq_util import make_socket

logger = logging.getLogger(__name__)

# Frames queued for one peer before ZMQ drops further frames to it (the peer then sees
# a gap and asks for a snapshot): a reading engine drains deltas as fast as they come.
PEER_SEND_HWM = 64
# Frames queued from one peer before ZMQ stops reading its connection (the peer's own
# queue then fills): a flooding peer costs this process at most this many frames of
# MAX_ENGINE_MESSAGE_BYTES, not ZMQ's default 1,000. Honest engines send a few a second.
PEER_RECV_HWM = 64
# Engine messages handled before the loop publishes and beats again.
MAX_MESSAGES_PER_DRAIN = 1000
# How long a closing server's socket keeps trying to deliver its goodbyes.
GOODBYE_LINGER_MS = 500


def _peer_address(frame: zmq.Frame) -> str:
    """The IP a TCP peer connects from ("" on other transports)."""
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return ""


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
        share_kept_s: float = 0.0,
        outbox: Outbox | None = None,
    ) -> None:
        """``fleet``: the coordinator of a single replica; with a ``relay``, ``term`` and
        ``make_fleet`` make one per term of leadership instead (leadership.py).
        ``outbox``: the send path (the tests inject faults there)."""
        self.endpoint = endpoint
        self._secret_key = secret_key
        # key -> engine ids it may claim (None: any); None: every key is admitted.
        self._client_keys: dict[str, frozenset[str] | None] | None
        if client_public_keys is None:
            self._client_keys = None
        elif isinstance(client_public_keys, Mapping):
            self._client_keys = dict(client_public_keys)
        else:
            self._client_keys = dict.fromkeys(client_public_keys)
        self._heartbeat_interval_s = heartbeat_interval_s
        self._poll_interval_s = poll_interval_s
        self.drops = DropLog()
        self.peers = PeerTable(
            self.drops,
            client_keys=self._client_keys if secret_key is not None else None,
            engine_timeout_s=engine_timeout_s,
        )
        self.outbox = Outbox() if outbox is None else outbox
        self.reader = LogReader(
            db, wake=self.wake, on_read=self._on_read, engine_timeout_s=engine_timeout_s
        )
        self.leadership = FleetLeadership(
            peers=self.peers,
            outbox=self.outbox,
            drops=self.drops,
            reader=self.reader,
            fleet=fleet,
            relay=relay,
            term=term,
            make_fleet=make_fleet,
            share_lease_s=share_lease_s,
            share_kept_s=share_kept_s,
        )
        self.publisher = Publisher(
            peers=self.peers, outbox=self.outbox, reader=self.reader, leadership=self.leadership
        )
        self.status = StatusWriter(
            db,
            peers=self.peers,
            drops=self.drops,
            wake=self.wake,
            replica_id=self.leadership.replica_id,
            engine_timeout_s=engine_timeout_s,
            engine_retention_s=engine_retention_s,
            term=term,
        )
        # Claims of live engine ids refused here (GET /engines shows them).
        self.claims = RefusedClaims()
        # Engines whose demand was flagged implausible here (GET /engines shows them).
        self.flagged = FlaggedDemands()
        # Replicas: one cut off from the database sends its engines to another.
        self.database_watch = (
            DatabaseWatch(db.ping) if self.leadership.replica_id is not None else None
        )
        self.dispatcher = Dispatcher(
            peers=self.peers,
            publisher=self.publisher,
            leadership=self.leadership,
            status=self.status,
            drops=self.drops,
            outbox=self.outbox,
            claims=self.claims,
            flagged=self.flagged,
            usage=usage,
            key_uses=key_uses,
            welcome=self._welcome,
        )
        self._context = zmq.Context()
        self._authenticator: Any = None
        self._wake_address = f"inproc://output-rate-wake-{id(self)}"
        self._wake_lock = threading.Lock()
        self._wake_sender: zmq.Socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def fleet(self) -> FleetCoordinator | None:
        """This replica's fleet coordinator now (None: it allocates no shares)."""
        return self.leadership.fleet

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
            share_kept_s=settings.outage.kept_s,
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
        router.setsockopt(zmq.RCVHWM, PEER_RECV_HWM)
        # A full queue raises Again instead of dropping in silence (see Outbox.send).
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.bind(self.endpoint)
        if self.endpoint.endswith(":0"):
            self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.outbox.router = router
        wake_receiver = make_socket(self._context, zmq.PAIR)
        wake_receiver.bind(self._wake_address)
        self._wake_sender = make_socket(self._context, zmq.PAIR)
        self._wake_sender.connect(self._wake_address)
        self.peers.know(self.status.start())
        self.reader.start()
        if self.database_watch is not None:
            self.database_watch.start()
        self._thread = threading.Thread(
            target=self._loop, args=(router, wake_receiver), name="output-rate-push", daemon=True
        )
        self._thread.start()
        logger.info(
            "output-rate push endpoint on %s (%s)",
            self.endpoint,
            "CURVE" if self._secret_key else "plain TCP",
        )

    def committed(self, commit: Commit) -> None:
        """A write committed on this replica (the database's on-commit hook, the writer's
        thread): publish it now."""
        self.reader.committed(commit)

    def notify(self, version: int) -> None:
        """``version`` was committed, known by its number only (another replica's write;
        any thread): publish it now."""
        self.reader.notified(version)

    def wake(self) -> None:
        """Have the socket thread look at what arrived (the relay, the database
        threads; any thread)."""
        with self._wake_lock:
            if self._wake_sender is not None:
                # Again: a wake-up is already pending.
                with contextlib.suppress(zmq.Again):
                    self._wake_sender.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        self._stop.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.database_watch is not None:
            self.database_watch.close()
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
                    while wake.poll(0):
                        wake.recv()
                    if self.database_watch is not None and self.database_watch.changed() is False:
                        self._send_all_away()
                    self.reader.deliver()
                    self.status.deliver()
                    self.leadership.lead()
                    if router in events:
                        self._drain(router)
                    self.leadership.take_relayed()
                    now = time.monotonic()
                    if now >= next_poll:
                        next_poll = now + self._poll_interval_s
                        self.reader.follow()
                        self.publisher.poll()
                    if now >= next_beat:
                        next_beat = now + self._heartbeat_interval_s
                        self._beat(now)
                    self.leadership.step()
                    self.status.flush(now)
                except Exception:
                    # A bad frame of the log or a coordinator's error must not end the
                    # push: log, back off, go on.
                    logger.exception("output-rate push loop error")
                    self._stop.wait(0.5)
        finally:
            # Shutting down: tell every peer, so engines move to another replica at once
            # (the frames get a moment to leave before the socket goes); with replicas,
            # let go of them first (waited for), so that the next replica may bind them.
            self.reader.close()
            self.status.close(self.peers.all())
            goodbye = p.encode(p.Goodbye())
            for identity, _ in self.peers.items():
                self.outbox.send(identity, goodbye)
            router.close(linger=GOODBYE_LINGER_MS)
            wake.close(linger=0)

    def _welcome(self) -> bool:
        """Whether a connection may bind here now (a replica cut off from its database
        turns engines away)."""
        return self.database_watch is None or self.database_watch.reachable

    def _send_all_away(self) -> None:
        """The database is lost: every engine is told Goodbye (it moves to the next
        replica at once, keeping what it holds) and forgotten here. Its row is not
        written (nothing can be): the next replica may claim it once the row is
        HOME_SILENT_AFTER_S old (control_plane/push/status.py)."""
        goodbye = p.encode(p.Goodbye())
        for identity, _ in self.peers.items():
            self.outbox.send(identity, goodbye)
            self.peers.forget(identity)

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
            data = frame.bytes
            if p.peek_type(data) == p.DEMAND and not self.dispatcher.demand_fits(
                identity, len(data)
            ):
                continue  # over the rates: refused before it costs a decode
            try:
                message = p.decode(data, max_bytes=p.MAX_ENGINE_MESSAGE_BYTES)
            except p.ProtocolError as e:
                self.drops.note("malformed", str(e)[:200])
                continue
            key = frame.get("User-Id") if self._secret_key is not None else None
            # Where a connection comes from is asked only before it is bound (the log
            # and GET /engines name both peers of a refused claim).
            address = "" if self.peers.get(identity) is not None else _peer_address(frame)
            self.dispatcher.route(identity, message, str(key) if key else None, address)

    def _on_read(self, read: LogRead) -> None:
        self.leadership.on_log(read.newest)
        self.publisher.on_read(read)

    def _beat(self, now: float) -> None:
        for peer in self.peers.expire(now):
            self.status.disconnect(peer.engine_id, peer.role)
        self.publisher.beat()
        self.leadership.beat(now)
        self.drops.flush(now)
        self.status.sweep(now)
