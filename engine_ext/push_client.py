"""Engine side of the live push: receives limits from the control plane.

Threads: the IO thread owns the DEALER socket and moves frames between it
and two queues; it touches no limiter state. The one thing it does beyond
moving bytes is decoding and flattening snapshots into a fresh table, so a
100,000-user snapshot costs the engine thread a table swap (~50 ms) instead of
~140 ms. Version checks and every limiter update happen on the engine thread
in ``apply_pending``, called by the scheduler at the start of every
``schedule()``, so the limiter is never touched concurrently and the hot path
takes no lock beyond an emptiness check of a queue.

Usage: the scheduler counts granted tokens, throttled and would-throttle request-steps per
user in plain dicts and hands them over with ``report_usage`` about once a
second; the client takes ownership of the dicts (the caller starts new ones),
and the IO thread encodes and sends them.

Fleet shares (docs/fleet.md): the scheduler hands over its streams per fleet-limited
user with ``report_demand`` (at once when a user is new here, else every 250 ms); the
client sends what changed, and the whole map after every snapshot and every few
seconds. Shares arrive as their own messages, are applied by the table on the engine
thread like deltas, and acknowledged; past their lease the table falls back to safe
shares.

The connection itself (IO thread, HELLO, snapshot then gap-free deltas, acks,
heartbeats, resync with backoff) is ``PushConnection``; what a connection applies
is its subclass's: ``PushClient`` (role "engine", the limiter) here, ``KeyClient``
(role "api", the API keys of an engine's API server) in engine_ext/key_client.py.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from engine_ext import vllm_compat
from engine_ext.limit_table import LimitTable
from engine_ext.limiter import OutputRateLimiter
from engine_ext.saved_state import SavedFleet, StateWriter
from output_rate_core import protocol as p
from output_rate_core.ids import MAX_USER_ID_LEN, is_user_id, is_vllm_version
from output_rate_core.zmq_util import ENGINE_SECRET_KEY_ENV, make_socket

logger = logging.getLogger("vllm.output_rate." + __name__)

MAX_RESYNC_WAIT_S = 30.0
# With one endpoint, a control plane silent this long gets a new socket (a new HELLO):
# three silences, so that one restarting on its endpoint within it keeps its engines
# without a new bind. With several (replicas), the next replica is always there: one
# silence (SERVER_SILENCE_S) is enough to leave (docs/replicas.md, "Failover").
RECONNECT_AFTER_S = 3 * p.SERVER_SILENCE_S
# Every replica turned the engine away (a Goodbye before anything else: each is cut off
# from its database): this long before the next round.
ALL_REFUSED_WAIT_S = p.HEARTBEAT_INTERVAL_S
# Usage reports go at most this often, half the rate the control plane takes (its clock
# sees them bunched by the network): a report that comes sooner (an engine that goes
# idle after every short request reports each time) is held, merged with the next one,
# and sent by the IO thread once due.
USAGE_MIN_SPACING_S = 2 / p.MAX_USAGE_REPORTS_PER_S
# The whole demand map is restated this often (a lost delta heals by then).
FULL_DEMAND_INTERVAL_S = 5.0
# How long a closing connection tries to deliver its Leaving frame.
LEAVING_LINGER_MS = 500
# A refused engine id is tried again with every heartbeat: one error line this often,
# with the number of refusals since the last.
REFUSAL_LOG_INTERVAL_S = 5.0


def _reportable(counts: dict[str, int]) -> dict[str, int]:
    if len(counts) <= p.MAX_USAGE_USERS and all(map(is_user_id, counts)):
        return counts
    valid = ((user, n) for user, n in counts.items() if is_user_id(user))
    return dict(itertools.islice(valid, p.MAX_USAGE_USERS))


# A usage frame's room for user entries: the frame limit less its other fields (an engine
# id of at most 256 characters, the interval, the part numbers, field names).
_USAGE_ENTRY_ROOM = p.MAX_ENGINE_MESSAGE_BYTES - 4096
# What a user costs a usage frame at most beyond its id's UTF-8 bytes, in each map it is
# in: a msgpack string header (at most 3 bytes for an id) and a count (at most 9 bytes).
_ENTRY_OVERHEAD = 12
# Reports of at most this many entries (users, summed over the maps) fit one frame
# whatever their ids are, so the usual report costs no size estimate.
_ALWAYS_FITS = _USAGE_ENTRY_ROOM // (4 * MAX_USER_ID_LEN + _ENTRY_OVERHEAD)


# A usage report held back (interval, granted, throttled, would-throttle, borrowed).
_HeldUsage = tuple[float, dict[str, int], dict[str, int], dict[str, int], dict[str, int]]


def usage_parts(
    engine_id: str,
    interval_s: float,
    granted: dict[str, int],
    throttled: dict[str, int],
    would_throttle: dict[str, int] | None = None,
    borrowed: dict[str, int] | None = None,
) -> list[p.Usage]:
    """One interval's report as frames the control plane accepts (each at most
    MAX_ENGINE_MESSAGE_BYTES): itself, or parts of it split by users (a user's counts
    in one part), numbered in the order they are to be sent."""
    would = would_throttle or {}
    lent = borrowed or {}
    whole = p.Usage(engine_id, interval_s, granted, throttled, would_throttle=would, borrowed=lent)
    num_entries = len(granted) + len(throttled) + len(would) + len(lent)
    # Encoding 40,000 entries to measure them takes ~1 ms (the IO thread encodes again).
    if num_entries <= _ALWAYS_FITS or len(p.encode(whole)) <= _USAGE_ENTRY_ROOM:
        return [whole]
    users = granted.keys() | throttled.keys() | would.keys() | lent.keys()
    groups: list[list[str]] = [[]]
    size = 0
    for user in users:
        num_maps = (user in granted) + (user in throttled) + (user in would) + (user in lent)
        cost = (len(user.encode()) + _ENTRY_OVERHEAD) * num_maps
        if size + cost > _USAGE_ENTRY_ROOM:
            groups.append([])
            size = 0
        groups[-1].append(user)
        size += cost
    return [
        p.Usage(
            engine_id,
            interval_s,
            {u: granted[u] for u in group if u in granted},
            {u: throttled[u] for u in group if u in throttled},
            part,
            len(groups),
            {u: would[u] for u in group if u in would},
            {u: lent[u] for u in group if u in lent},
        )
        for part, group in enumerate(groups)
    ]


@dataclass(frozen=True)
class Prepared:
    """A snapshot made ready off the applying thread (each connection says how)."""

    version: int
    # The snapshot as it arrived (for the saved state; dropped once installed).
    snapshot: p.Snapshot


@dataclass(frozen=True)
class _PreparedSnapshot(Prepared):
    """An engine's snapshot, decoded and flattened off the engine thread."""

    table: LimitTable
    # The limiter's entries before any share (milli-tokens/s), and its ceilings.
    default_milli: int | None
    millis: dict[str, int | None]
    default_ceiling: int | None
    ceilings: dict[str, int | None]

    @classmethod
    def of(cls, snapshot: p.Snapshot) -> _PreparedSnapshot:
        table = LimitTable.from_snapshot(snapshot)
        return cls(
            snapshot.version,
            snapshot,
            table,
            table.default_milli(),
            table.user_millis(),
            table.default_ceiling_milli(),
            table.user_ceilings(),
        )


# What the IO thread hands the applying thread: a frame to decode, a snapshot it
# already prepared (100,000 users take ~70 ms to decode and flatten; the engine
# thread then only swaps the limiter's table), or SILENT: no word from the
# server for silence_s.
@dataclass(frozen=True)
class _Arrived:
    """A Shares frame and when the IO thread received it (time.monotonic_ns): its lease
    counts from then, not from when the engine thread applies it (docs/fleet.md, "Bound
    holes"), as the allocator's accounting assumes."""

    frame: bytes
    at_ns: int


_Inbound = bytes | Prepared | _Arrived | None
SILENT = None


class PushConnection:
    """One connection to the control plane's push endpoint, whatever it applies.

    The rules every receiver follows live here: a HELLO on each new connection, a
    snapshot before anything else, deltas applied only in order (a gap, a silent
    server or a bad frame ask for a snapshot, with backoff), an ACK per applied
    version, heartbeats both ways. A subclass says what a snapshot becomes
    (``_prepare``, on the IO thread), how it is installed (``_install_snapshot``) and
    what an op does (``_apply_op``), all on the applying thread: whichever thread
    calls ``_drain``, one at a time.

    ``endpoints`` are the control plane's replicas (one database, one CURVE server
    key): the connection talks to one at a time and moves to the next, round robin,
    when it stays silent (docs/replicas.md).
    """

    role: p.Role = p.ENGINE_ROLE
    # What the connection keeps while the control plane is silent (for its logs).
    kept = "limits"
    # What it serves on while it holds no configuration at all (for its logs).
    held_without_snapshot = "the limits from the command line"

    def __init__(
        self,
        *,
        endpoints: Sequence[str],
        engine_id: str,
        model: str,
        server_public_key: str | None,
        wake: Callable[[], None] = lambda: None,
        client_secret_key: str | None = None,
        heartbeat_interval_s: float = p.HEARTBEAT_INTERVAL_S,
        silence_s: float = p.SERVER_SILENCE_S,
        reconnect_after_s: float = RECONNECT_AFTER_S,
        resync_retry_s: float = p.RESYNC_RETRY_S,
        vllm_version: str | None = None,
        state: StateWriter | None = None,
        capacity: int = 0,
    ) -> None:
        """``state``: where each applied version is saved (None: nowhere); ``capacity``:
        the engine's max_num_seqs, said at HELLO (its demand counts up to it)."""
        if not endpoints:
            raise ValueError(f"{type(self).__name__} needs at least one endpoint")
        self.endpoints = tuple(endpoints)
        # The replica in use: written by the IO thread, read by any (logs, metrics).
        self.endpoint_index = 0
        self.engine_id = engine_id
        self.model = model
        # What HELLO says this engine runs (None: the vLLM installed here). A version the
        # wire cannot carry goes as "": the control plane would refuse the HELLO whole.
        if vllm_version is None:
            vllm_version = vllm_compat.installed_vllm_version() or ""
        self.vllm_version = vllm_version if is_vllm_version(vllm_version) else ""
        self._server_public_key = server_public_key
        self._client_secret_key = client_secret_key or os.environ.get(ENGINE_SECRET_KEY_ENV)
        self._wake = wake
        self._heartbeat_interval_s = heartbeat_interval_s
        self._silence_s = silence_s
        self._reconnect_after_s = reconnect_after_s
        self._resync_retry_s = resync_retry_s
        self._inbound: queue.SimpleQueue[_Inbound] = queue.SimpleQueue()
        self._outbound: queue.SimpleQueue[p.Message] = queue.SimpleQueue()
        # Written by any thread to end the IO thread's poll (outbound data, close).
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._snapshot_seen = threading.Event()
        self._stop = threading.Event()
        # Set by leave(): the last frame on the socket is Leaving.
        self._leaving = False
        self._closed = False
        self._thread = threading.Thread(
            target=self._io_loop, name=f"output-rate-push-{self.role}", daemon=True
        )
        self._state = state
        self.capacity = capacity
        # While a received frame is handled: when it arrived (time.monotonic_ns).
        self.arrived_ns: int | None = None
        # Applying-thread state.
        self.applied_version = 0
        # Holds a configuration: a snapshot from the control plane, or the saved one.
        self.has_snapshot = False
        # What it enforces came from the saved state (no live snapshot since the start).
        self.serving_saved = False
        # Waiting for a snapshot: deltas are ignored until it arrives.
        self._resyncing = True
        self._resync_asked_at = time.monotonic()
        # Grows while asked-for snapshots do not come (a loaded server or engine must
        # not be buried under more snapshots); back to resync_retry_s once one lands.
        self._resync_wait_s = resync_retry_s
        self.num_dropped = 0
        self.num_resyncs = 0
        # IO-thread state.
        self.num_silences = 0
        # Refused claims of its engine id, by reason (protocol.Refused): read by any thread.
        self.refusals: dict[p.RefusalReason, int] = {}
        self._next_refusal_log = 0.0
        self._refusals_unlogged = 0
        # The replica said goodbye (it shuts down): the IO thread moves on at once.
        self._left = False
        # ... before it said anything else (it turned this engine away).
        self._turned_away = False
        self.num_reconnects = 0

    @property
    def endpoint(self) -> str:
        """The replica the client talks to now (or dials)."""
        return self.endpoints[self.endpoint_index]

    # ---- what a subclass applies (applying thread; _prepare on the IO thread) ----

    def _prepare(self, snapshot: p.Snapshot) -> Prepared:
        raise NotImplementedError

    def _install_snapshot(self, prepared: Prepared) -> None:
        raise NotImplementedError

    def _apply_op(self, op: p.Op) -> None:
        raise NotImplementedError

    def _handle_other(self, message: p.Message) -> None:
        """A message that is neither snapshot, delta nor heartbeat."""
        raise p.ProtocolError(f"unexpected {type(message).__name__} from the control plane")

    def _on_io_tick(self) -> None:
        """Called by the IO thread after every poll (at least once a heartbeat interval),
        before it sends what is queued."""

    # ---- applying thread --------------------------------------------------

    @property
    def is_in_sync(self) -> bool:
        """Holds a snapshot and is not waiting for a fresh one (a silent server or
        a gap in the versions make the client resync)."""
        return self.has_snapshot and not self._resyncing

    def start(self) -> None:
        if self._server_public_key is not None and self._client_secret_key is None:
            logger.warning(
                "output-rate: %s is not set; connecting to %s with a throwaway CURVE key, "
                "which a control plane listing OUTPUT_RATE_ZMQ_CLIENT_KEYS refuses",
                ENGINE_SECRET_KEY_ENV,
                self.endpoint,
            )
        self._thread.start()

    def leave(self) -> None:
        """The engine serves nothing more: the IO thread's last frame says so (Leaving), and
        it sends nothing after it, so the control plane hands its fleet shares to the other
        engines at once and frees its id. Returns at once (any thread, a signal handler
        too); ``close`` waits for it."""
        self._leaving = True
        self._stop.set()
        self._poke()

    def close(self, *, leave: bool = False) -> None:
        """Stop. ``leave``: as ``leave()``, waiting up to LEAVING_LINGER_MS for the frame to
        go."""
        if self._closed:
            return
        self._closed = True
        if leave:
            self._leaving = True
        self._stop.set()
        self._poke()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        os.close(self._wake_read)
        os.close(self._wake_write)
        if self._state is not None:
            self._state.close()

    def install_saved(self, snapshot: p.Snapshot) -> None:
        """Enforce a saved configuration until the control plane's snapshot comes (on the
        applying thread, before ``start``): the HELLO says its version, and the client
        still waits for a snapshot (deltas are not taken on top of a saved state)."""
        self._install_snapshot(self._prepare(snapshot))
        self.applied_version = snapshot.version
        self.has_snapshot = True
        self.serving_saved = True

    def wait_for_snapshot(self, timeout_s: float) -> bool:
        """Block until the first snapshot has arrived (the applying thread applies it)."""
        return self._snapshot_seen.wait(timeout_s)

    def _drain(self) -> int:
        """Apply what arrived since the last call; return the number of versions applied."""
        inbound = self._inbound
        if inbound.empty() and not self._resyncing:
            return 0
        num_applied = 0
        while not inbound.empty():
            item = inbound.get_nowait()
            if item is SILENT:
                self._request_resync("the control plane is silent")
                continue
            try:
                if isinstance(item, Prepared):
                    num_applied += self._install(item)
                elif isinstance(item, _Arrived):
                    self.arrived_ns = item.at_ns
                    try:
                        num_applied += self._handle(p.decode(item.frame))
                    finally:
                        self.arrived_ns = None
                else:
                    num_applied += self._handle(p.decode(item))
            except p.ProtocolError as e:
                self.num_dropped += 1
                logger.warning("output-rate: dropped a bad message from the control plane: %s", e)
                # Whatever it carried is lost: only a snapshot is safe now.
                self._request_resync("bad message")
        if self._resyncing and time.monotonic() - self._resync_asked_at > self._resync_wait_s:
            self._resync_wait_s = min(2 * self._resync_wait_s, MAX_RESYNC_WAIT_S)
            self._request_resync("no snapshot yet")
        return num_applied

    def _install(self, prepared: Prepared) -> int:
        # Always taken: the database is the truth, even if it went back (a restore).
        self._install_snapshot(prepared)
        if self._state is not None:
            self._state.on_snapshot(prepared.snapshot)
        self.applied_version = prepared.version
        self.has_snapshot = True
        self.serving_saved = False
        self._resyncing = False
        self._resync_wait_s = self._resync_retry_s
        self._send(p.Ack(self.engine_id, prepared.version))
        return 1

    def _handle(self, message: p.Message) -> int:
        if isinstance(message, p.Snapshot):
            return self._install(self._prepare(message))
        if isinstance(message, p.Delta):
            if self._resyncing or message.version <= self.applied_version:
                return 0  # a duplicate, or older than the snapshot on its way
            if message.version != self.applied_version + 1:
                self._request_resync(f"gap: have {self.applied_version}, got {message.version}")
                return 0
            for op in message.ops:
                self._apply_op(op)
            if self._state is not None:
                self._state.on_ops(message.version, message.ops)
            self.applied_version = message.version
            self._send(p.Ack(self.engine_id, message.version))
            return 1
        if isinstance(message, p.Heartbeat):
            # The server sends its heartbeat after every frame up to message.version.
            if not self._resyncing and message.version != self.applied_version:
                self._request_resync(
                    f"server sent up to {message.version}, applied {self.applied_version}"
                )
            return 0
        self._handle_other(message)
        return 0

    def _request_resync(self, reason: str) -> None:
        logger.info("output-rate: requesting a snapshot (%s)", reason)
        self.num_resyncs += 1
        self._resyncing = True
        self._resync_asked_at = time.monotonic()
        self._send(p.Resync(self.engine_id, self.applied_version, self.role))

    def _send(self, message: p.Message) -> None:
        self._outbound.put(message)
        self._poke()

    def _poke(self) -> None:
        # A full pipe means the IO thread is already due to wake up.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_write, b"\0")

    # ---- IO thread: moves frames, reconnects ----------------------------

    def _connect(self, context: zmq.Context) -> zmq.Socket:
        sock = make_socket(
            context,
            zmq.DEALER,
            server_public_key=self._server_public_key,
            client_secret_key=self._client_secret_key,
        )
        # Transport liveness (ZMTP heartbeats): a dead TCP peer is dropped and redialled
        # by ZMQ itself; the protocol's own heartbeats detect a silent server.
        ivl_ms = int(self._heartbeat_interval_s * 1000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self._reconnect_after_s * 1000))
        if self.endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)  # else ZMQ never dials an IPv6 address
        sock.connect(self.endpoint)
        # A new connection always starts with a snapshot: HELLO makes the server send one.
        hello = p.Hello(
            self.engine_id,
            self.model,
            self.applied_version,
            self.role,
            self.vllm_version,
            capacity=self.capacity,
        )
        sock.send(p.encode(hello), zmq.NOBLOCK)
        return sock

    def _io_loop(self) -> None:
        context = zmq.Context()
        sock: zmq.Socket | None = None
        # New sockets in a row on which no replica answered (throttles the log), and in
        # a row that a replica turned away.
        num_unanswered = num_turned_away = 0
        try:
            while not self._stop.is_set():
                answered = False
                try:
                    sock = self._connect(context)
                    answered = self._serve(sock)
                except zmq.ZMQError as e:
                    logger.warning("output-rate: control plane socket error: %s", e)
                    self._stop.wait(0.5)
                finally:
                    if sock is not None:
                        self._close_socket(sock)
                        sock = None
                if not self._stop.is_set():
                    self.num_reconnects += 1
                    num_unanswered = 0 if answered else num_unanswered + 1
                    num_turned_away = num_turned_away + 1 if self._turned_away else 0
                    self._turned_away = False
                    log = num_unanswered <= 1 or num_unanswered % 20 == 0
                    self._move_on(answered=answered, log=log)
                    if num_turned_away >= len(self.endpoints):
                        # Every replica is cut off from its database: no busy loop.
                        num_turned_away = 0
                        self._stop.wait(ALL_REFUSED_WAIT_S)
        finally:
            context.term()

    def _close_socket(self, sock: zmq.Socket) -> None:
        if not (self._leaving and self._stop.is_set()):
            sock.close(linger=0)
            return
        with contextlib.suppress(zmq.ZMQError):
            sock.send(p.encode(p.Leaving(self.engine_id, self.role)), zmq.NOBLOCK)
        sock.close(linger=LEAVING_LINGER_MS)

    def _move_on(self, *, answered: bool, log: bool) -> None:
        """To the next replica (round robin); with one endpoint, a new socket to it."""
        silent_at = self.endpoint
        self.endpoint_index = (self.endpoint_index + 1) % len(self.endpoints)
        if self._left:
            self._left = False
            logger.info(
                "output-rate: control plane at %s said goodbye (shutting down, or cut off "
                "from its database); on to replica %d of %d at %s, keeping the last %s",
                silent_at,
                self.endpoint_index + 1,
                len(self.endpoints),
                self.endpoint,
                self.kept,
            )
            return
        if not log:
            return
        if len(self.endpoints) == 1:
            logger.warning(
                "output-rate: no word from the control plane at %s for %.1fs; "
                "new connection, keeping the last %s (down, unreachable, or "
                "a CURVE key mismatch)",
                silent_at,
                self._reconnect_after_s,
                self.kept,
            )
            return
        logger.warning(
            "output-rate: no word from the control plane at %s for %.1fs; moving to "
            "replica %d of %d at %s, keeping the last %s (down, unreachable, or "
            "a CURVE key mismatch)",
            silent_at,
            self._silence_s,
            self.endpoint_index + 1,
            len(self.endpoints),
            self.endpoint,
            self.kept,
        )

    def _serve(self, sock: zmq.Socket) -> bool:
        """Move frames until the server stays silent too long, says Goodbye, or close;
        return whether it answered on this socket.

        One endpoint: a restarted server on it needs no new socket: ZMQ redials, and
        the server answers the next heartbeat from this unknown peer with a snapshot.
        A silence of silence_s makes the engine ask for a snapshot; only
        reconnect_after_s of it makes a new socket (a new HELLO).

        Several endpoints (replicas): a silence of silence_s moves to the next one
        (a new socket, a new HELLO, a snapshot from it): every replica serves the same
        configuration, so the next costs nothing, and a write reaches the engine through
        it within the heartbeat timeout of its replica's death. An engine starting while
        the first replica is down gets its snapshot within the default snapshot timeout."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        last_heard = time.monotonic()
        next_heartbeat = last_heard
        silent = answered = False
        several = len(self.endpoints) > 1
        give_up_s = self._silence_s if several else self._reconnect_after_s
        while not self._stop.is_set():
            # Awake for the next heartbeat, and when the server has been silent too long.
            wake_at = min(next_heartbeat, last_heard + give_up_s)
            timeout_ms = int(max(0.0, wake_at - time.monotonic()) * 1000) + 1
            events = dict(poller.poll(timeout_ms))
            if sock in events:
                woke = heard = False
                while True:
                    try:
                        frame = sock.recv(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    kind = p.peek_type(frame)
                    if kind == p.GOODBYE:
                        # The replica shuts down, or cannot reach its database: on to
                        # the next one now. One that said nothing else turned us away.
                        self._left = True
                        self._turned_away = not answered
                        return True
                    if kind == p.REFUSED:
                        self._refused(frame)
                        heard = woke = True  # an answer; the idle engine shows the count
                        continue
                    if kind == p.SNAPSHOT:
                        self._inbound.put(self._prepare_frame(frame))
                        self._snapshot_seen.set()
                    elif kind == p.SHARES:
                        self._inbound.put(_Arrived(frame, time.monotonic_ns()))
                    else:
                        self._inbound.put(frame)
                    woke = woke or kind != p.HEARTBEAT
                    heard = True
                if heard:
                    last_heard = time.monotonic()
                    silent = False
                    if not answered:
                        answered = True
                        if not several:
                            give_up_s = self._reconnect_after_s
                        if self.num_reconnects:
                            logger.info(
                                "output-rate: control plane at %s answered (replica %d of %d)",
                                self.endpoint,
                                self.endpoint_index + 1,
                                len(self.endpoints),
                            )
                if woke:
                    self._wake()
            if self._wake_read in events:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_read, 4096)
            self._on_io_tick()
            self._flush(sock)
            now = time.monotonic()
            if now >= next_heartbeat:
                next_heartbeat = now + self._heartbeat_interval_s
                beat = p.Heartbeat(self.applied_version, self.engine_id, self.model, self.role)
                with contextlib.suppress(zmq.Again):
                    sock.send(p.encode(beat), zmq.NOBLOCK)
            if now - last_heard > give_up_s:
                return answered
            if not silent and now - last_heard > self._silence_s:
                # Once per silence: the engine asks for a snapshot (retried with backoff).
                silent = True
                self.num_silences += 1
                self._inbound.put(SILENT)
                self._wake()
        return answered

    def _refused(self, frame: bytes) -> None:
        """The control plane refused this connection's claim of its engine id: counted,
        and said as an error (at most every REFUSAL_LOG_INTERVAL_S); every heartbeat
        claims it again."""
        try:
            refused = p.decode(frame)
        except p.ProtocolError as e:
            logger.warning("output-rate: dropped a bad message from the control plane: %s", e)
            return
        assert isinstance(refused, p.Refused)
        self.refusals[refused.reason] = self.refusals.get(refused.reason, 0) + 1
        now = time.monotonic()
        if now < self._next_refusal_log:
            self._refusals_unlogged += 1
            return
        self._next_refusal_log = now + REFUSAL_LOG_INTERVAL_S
        unlogged, self._refusals_unlogged = self._refusals_unlogged, 0
        since = f" ({unlogged} more since the last line)" if unlogged else ""
        if self.serving_saved:
            serving = f"the saved configuration (version {self.applied_version})"
        elif self.has_snapshot:
            serving = f"the last {self.kept} it applied (version {self.applied_version})"
        else:
            serving = self.held_without_snapshot
        logger.error(
            "output-rate: the control plane at %s refused engine id %r (%s): %s (%s)%s; "
            "serving with %s meanwhile, trying again with every heartbeat",
            self.endpoint,
            self.engine_id,
            self.role,
            refused.reason,
            refused.detail,
            since,
            serving,
        )

    def _prepare_frame(self, frame: bytes) -> _Inbound:
        """Decode and prepare a snapshot here, off the applying thread."""
        try:
            message = p.decode(frame)
        except p.ProtocolError:
            return frame  # the applying thread drops and counts it
        if not isinstance(message, p.Snapshot):
            return frame
        return self._prepare(message)

    def _flush(self, sock: zmq.Socket) -> None:
        while not self._outbound.empty():
            message = self._outbound.get_nowait()
            try:
                sock.send(p.encode(message), zmq.NOBLOCK)
            except zmq.Again:
                # Not connected (or the server is not reading): acks are restated by
                # heartbeats, a lost resync request is retried, usage is best effort.
                return


class PushClient(PushConnection):
    """One engine's connection to the control plane's push endpoint: limits and fleet
    shares into the limiter, usage and demand out."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Engine-thread state.
        self.table = LimitTable()
        self._last_usage_at = time.monotonic()
        # A report not sent yet (interval, granted, throttled, would-throttle, borrowed),
        # and when the last one went; the engine thread and the IO thread both take it,
        # under the lock.
        self._usage_lock = threading.Lock()
        self._held_usage: _HeldUsage | None = None
        self._last_usage_sent_at = float("-inf")
        # user -> streams, as the control plane last heard them from this engine, and the
        # users it last heard were stalled
        self.demand_sent: dict[str, int] = {}
        self.stalled_sent: frozenset[str] = frozenset()
        self._full_demand_due = True
        self._last_full_demand_at = 0.0
        # The longest lease a Shares frame gave, and what was last handed to the saved
        # state of the fleet counts (_save_fleet).
        self._max_lease_ms = 0
        self._saved_fleet_key: tuple[object, ...] | None = None
        # What the current apply_pending call applies to (the scheduler's limiter and clock).
        self._limiter: OutputRateLimiter | None = None
        self._now_ns: int | None = None

    @property
    def demand_due(self) -> bool:
        """The control plane should hear this engine's whole demand now."""
        return self._full_demand_due

    def apply_pending(self, limiter: OutputRateLimiter, now_ns: int | None = None) -> int:
        """Apply what arrived since the last call; return the number of versions applied.

        ``now_ns`` (the scheduler's clock) times the lease of the fleet shares."""
        fleet = self.table.fleet
        if fleet.serving_until_ns:
            now_ns = time.monotonic_ns() if now_ns is None else now_ns
            if self.table.expire_counts(limiter, now_ns):
                self._save_fleet(now_ns)
        if fleet.lease_expires_ns is not None:
            now_ns = time.monotonic_ns() if now_ns is None else now_ns
            if self.table.expire_lease(limiter, now_ns):
                self._save_fleet(now_ns)
                logger.warning(
                    "output-rate: no share renewal from the control plane within the lease; "
                    "fleet limits fall to their outage shares (%s; %d users with a serving "
                    "count; fleet of %d engines)",
                    fleet.outage,
                    len(fleet.serving),
                    self.table.num_engines,
                )
        if self._inbound.empty() and not self._resyncing:
            return 0
        self._limiter, self._now_ns = limiter, now_ns
        return self._drain()

    def report_usage(
        self,
        *,
        granted: dict[str, int],
        throttled: dict[str, int],
        would_throttle: dict[str, int] | None = None,
        borrowed: dict[str, int] | None = None,
    ) -> None:
        """Hand over this interval's counters (the client keeps the dicts); ``borrowed``:
        the tokens of ``granted`` lent beyond each user's rate."""
        now = time.monotonic()
        interval = max(now - self._last_usage_at, p.MIN_USAGE_INTERVAL_S)
        self._last_usage_at = now
        would = would_throttle if would_throttle is not None else {}
        lent = borrowed if borrowed is not None else {}
        if not granted and not throttled and not would and not lent:
            return
        with self._usage_lock:
            held = self._held_usage
            if held is not None:  # the earlier interval's counts join this one's
                interval += held[0]
                maps = (granted, throttled, would, lent)
                for counts, held_counts in zip(maps, held[1:], strict=True):
                    for user, n in held_counts.items():
                        counts[user] = counts.get(user, 0) + n
            self._held_usage = (interval, granted, throttled, would, lent)
        self._send_held_usage(now)

    def _send_held_usage(self, now: float) -> None:
        """Send the held report if one is due (engine or IO thread)."""
        with self._usage_lock:
            if self._held_usage is None or now - self._last_usage_sent_at < USAGE_MIN_SPACING_S:
                return
            (interval, granted, throttled, would, lent), self._held_usage = self._held_usage, None
            self._last_usage_sent_at = now
        # What the server would refuse whole: names that are no user id (a request's
        # output_rate_user can be anything) and more than MAX_USAGE_USERS per map.
        granted, throttled = _reportable(granted), _reportable(throttled)
        would, lent = _reportable(would), _reportable(lent)
        # Counts over one engine's bound mean the interval was measured too short.
        interval = max(
            interval,
            sum(granted.values()) / p.MAX_ENGINE_TOKENS_PER_S,
            sum(throttled.values()) / p.MAX_ENGINE_STEPS_PER_S,
            sum(would.values()) / p.MAX_ENGINE_STEPS_PER_S,
            sum(lent.values()) / p.MAX_ENGINE_TOKENS_PER_S,
        )
        # Thousands of long ids can exceed a frame: parts, never a refused frame.
        interval = min(interval, p.MAX_USAGE_INTERVAL_S)
        for part in usage_parts(self.engine_id, interval, granted, throttled, would, lent):
            self._send(part)

    def report_demand(self, streams: dict[str, int], stalled: frozenset[str] = frozenset()) -> None:
        """Hand over the streams per fleet-limited user now (the client keeps the dict), and
        the users among them none of whose requests can run (every slot is taken)."""
        now = time.monotonic()
        sent = self.demand_sent
        full = self._full_demand_due or now - self._last_full_demand_at > FULL_DEMAND_INTERVAL_S
        if full:
            changes = streams
            self._full_demand_due = False
            self._last_full_demand_at = now
        else:
            changes = {user: n for user, n in streams.items() if sent.get(user) != n}
            changes.update((user, 0) for user in sent if user not in streams)
            if not changes and stalled == self.stalled_sent:
                return
        self.demand_sent = streams
        self.stalled_sent = stalled
        whole_stalled = sorted(user for user in stalled if is_user_id(user))
        # Frames stay small: a full map over MAX_DEMAND_USERS goes as a full part and
        # partial rest (names that are no user id are never fleet-limited: is_user_id).
        items = [(user, n) for user, n in changes.items() if is_user_id(user)]
        step = p.MAX_DEMAND_USERS
        for start in range(0, max(len(items), 1), step):
            part = dict(items[start : start + step])
            self._send(p.Demand(self.engine_id, full and start == 0, part, stalled=whole_stalled))

    def _on_io_tick(self) -> None:
        self._send_held_usage(time.monotonic())

    def enforce_saved(
        self,
        limiter: OutputRateLimiter,
        snapshot: p.Snapshot,
        fleet: SavedFleet | None = None,
        now_ns: int | None = None,
    ) -> None:
        """The limiter enforces a saved configuration (``install_saved``): fleet users at
        their safe share of the fleet size saved with it; with the serving counts saved
        (``fleet``), at their outage share once the lease the engine may have held ended
        (at once if it was in an outage), as before the restart."""
        self._limiter = limiter
        self.install_saved(snapshot)
        if fleet is not None:
            now_ns = time.monotonic_ns() if now_ns is None else now_ns
            self.table.restore_fleet(fleet, limiter, now_ns, time.time())
            self._max_lease_ms = fleet.lease_ms
            self._save_fleet(now_ns)

    def _save_fleet(self, now_ns: int) -> None:
        """Hand the serving counts and the outage policy to the saved state when they
        changed (their expiry in Unix seconds: it outlives this process's clock)."""
        if self._state is None:
            return
        fleet = self.table.fleet
        key = (
            fleet.outage,
            fleet.in_outage,
            self._max_lease_ms,
            tuple(fleet.serving.items()),
            tuple(fleet.serving_until_ns.items()),
        )
        if key == self._saved_fleet_key:
            return
        self._saved_fleet_key = key
        self._state.on_fleet(self.table.saved_fleet(now_ns, time.time(), self._max_lease_ms))

    def _prepare(self, snapshot: p.Snapshot) -> _PreparedSnapshot:
        return _PreparedSnapshot.of(snapshot)

    def _install_snapshot(self, prepared: Prepared) -> None:
        assert isinstance(prepared, _PreparedSnapshot) and self._limiter is not None
        table = prepared.table
        num_engines = table.num_engines
        table.adopt_fleet(self.table)
        default_milli, millis = prepared.default_milli, prepared.millis
        default_ceiling, ceilings = prepared.default_ceiling, prepared.ceilings
        if table.num_engines != num_engines or table.fleet.fraction_outage:
            # It kept the larger fleet it knew: the safe shares prepared are too large
            # (rare: only a snapshot that counts fewer engines, so flattened again here);
            # or every fleet user is on the outage fraction of its limit.
            default_milli, millis = table.default_milli(), table.user_millis()
            default_ceiling, ceilings = table.default_ceiling_milli(), table.user_ceilings()
        elif held := table.fleet.held_users():
            millis = {**millis, **table.user_millis_of(held)}
            ceilings = {**ceilings, **{user: table.ceiling_milli(user) for user in held}}
        self.table = table
        self._limiter.replace_all_milli(
            default_milli,
            millis,
            default_shadow=table.default_is_shadow,
            shadow_users=table.shadow_users(millis),
        )
        self._limiter.replace_ceilings(default_ceiling, ceilings)
        # A snapshot follows every new connection: the server hears the whole demand.
        self._full_demand_due = True

    def _apply_op(self, op: p.Op) -> None:
        assert self._limiter is not None
        self.table.apply(op, self._limiter)

    def _handle_other(self, message: p.Message) -> None:
        if not isinstance(message, p.Shares):
            super()._handle_other(message)
            return
        assert self._limiter is not None
        now_ns = time.monotonic_ns() if self._now_ns is None else self._now_ns
        if self.arrived_ns is not None:
            # The lease counts from its arrival: less the time it waited for this thread.
            now_ns -= max(0, time.monotonic_ns() - self.arrived_ns)
        num_engines = self.table.num_engines
        applied = self.table.apply_shares(message, self._limiter, now_ns)
        if self._state is not None and self.table.num_engines != num_engines:
            # Fleet users of an engine restarted from the saved state start at their
            # safe share of the fleet size it knew last.
            self._state.on_fleet_size(self.table.num_engines)
        if applied:
            self._max_lease_ms = max(self._max_lease_ms, message.lease_ms)
            self._save_fleet(time.monotonic_ns() if self._now_ns is None else self._now_ns)
            fleet = self.table.fleet
            assert fleet.epoch is not None
            self._send(p.ShareAck(self.engine_id, fleet.epoch, fleet.seq))
        else:
            # A gap in the share messages: the server answers a full demand
            # report with a full table of this engine's shares.
            self._full_demand_due = True
