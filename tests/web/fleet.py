"""Realistic data for the UI tests: tiers, thousands of users, usage history and a live
protocol peer reporting usage (a ZMQ DEALER speaking output_rate_core.protocol), and an
engine API server's view of the API keys."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import zmq

from control_plane.db import Database, make_engine
from control_plane.usage.history import UsageRecorder
from harness.servers import ControlPlane
from output_rate_core import protocol as p
from output_rate_core.key_table import KeyTable

TIERS = {
    "free": (10, "Free plan"),
    "basic": (50, "Basic"),
    "pro": (100, "Paid plan"),
    "max": (1000, ""),
}


def seed(served: ControlPlane, *, num_users: int = 5000, pro_users: int = 1114) -> None:
    headers = ControlPlane.auth_headers()
    for name, (rate, description) in TIERS.items():
        r = httpx.put(
            f"{served.url}/tiers/{name}",
            json={"output_tokens_per_second": rate, "description": description},
            headers=headers,
        )
        r.raise_for_status()
    httpx.put(
        f"{served.url}/default-limit", json={"output_tokens_per_second": 5}, headers=headers
    ).raise_for_status()
    names = list(TIERS)
    items = []
    for i in range(num_users):
        tier = "pro" if i < pro_users else names[i % 4] if names[i % 4] != "pro" else "basic"
        item: dict[str, object] = {"user": f"user-{i:05d}", "tier": tier}
        if i % 97 == 0:
            item["output_tokens_per_second"] = 20 + i % 50
        items.append(item)
    r = httpx.post(f"{served.url}/limits:bulk", json={"items": items}, headers=headers, timeout=60)
    r.raise_for_status()


def write_history(
    db_url: str, *, users: list[str], minutes: int = 60, gap: range = range(0)
) -> None:
    """Reports for the past `minutes` minutes through the real recorder with a fake clock;
    no reports in the minutes-ago in `gap` (an engine that was disconnected)."""
    db = Database(make_engine(db_url))
    now = time.time()
    clock_now = [now]
    recorder = UsageRecorder(db, retention_days=7, clock=lambda: clock_now[0])
    rng = random.Random(7)
    try:
        for ago in range(minutes, 0, -1):
            if ago in gap:
                continue
            clock_now[0] = now - ago * 60
            for index, user in enumerate(users):
                granted = int((10 + 5 * index) * 60 * rng.uniform(0.6, 1.0))
                throttled = int(granted * (0.5 if index < 3 else 0.05))
                recorder.add(p.Usage("hist", 60.0, {user: granted}, {user: throttled}))
            recorder.flush()
    finally:
        db.dispose()


class Backdated:
    """The real recorder on a fake clock (the one seam: it stands for the control plane's
    clock) that ``seconds`` sets to each second of the last ``minutes`` minutes in turn,
    so that reports can be placed in the past around real changes made through the API."""

    def __init__(self, db_url: str, *, minutes: int) -> None:
        self.db = Database(make_engine(db_url))
        self.now = time.time()
        # The first second ``seconds`` sets the clock to.
        self.start = self.now - minutes * 60
        self._clock = [self.start]
        self.recorder = UsageRecorder(self.db, retention_days=7, clock=lambda: self._clock[0])

    def seconds(self) -> Iterator[float]:
        """Each second from ``start`` up to now, the clock set to it while the caller adds
        its reports; the recorder flushed after every minute and at the end, and the
        database let go of (also when the caller stops on an error)."""
        try:
            self.recorder.refresh_limits()
            for ago in range(round(self.now - self.start), 0, -1):
                self._clock[0] = self.now - ago
                yield self._clock[0]
                if ago % 60 == 0:
                    self.recorder.flush()
            self.recorder.flush()
        finally:
            self.db.dispose()


@contextmanager
def live_engine(
    served: ControlPlane,
    engine_id: str,
    users: dict[str, int],
    *,
    applies_deltas: bool = True,
    borrowed: dict[str, int] | None = None,
) -> Iterator[None]:
    """A connected engine that reports usage for `users` (tokens/s) every 0.5 s, of them
    `borrowed` (tokens/s lent beyond the limit); one that does not `applies_deltas`
    acknowledges its snapshot and nothing after (it lags)."""
    lent = {u: max(1, r // 2) for u, r in (borrowed or {}).items()}
    stop = threading.Event()
    ready = threading.Event()

    def run() -> None:
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(served.zmq_endpoint)
        try:
            sock.send(p.encode(p.Hello(engine_id, "tiny", 0)))
            version = 0
            while not stop.is_set():
                while sock.poll(0):
                    message = p.decode(sock.recv())
                    if isinstance(message, p.Snapshot) or (
                        applies_deltas and isinstance(message, p.Delta)
                    ):
                        version = message.version
                        sock.send(p.encode(p.Ack(engine_id, version)))
                        ready.set()
                sock.send(p.encode(p.Heartbeat(version, engine_id, "tiny")))
                granted = {u: max(1, r // 2) for u, r in users.items()}
                throttled = {u: 3 for u in list(users)[:3]}
                sock.send(p.encode(p.Usage(engine_id, 0.5, granted, throttled, borrowed=lent)))
                stop.wait(0.5)
        finally:
            sock.close()
            context.term()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(15)
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


class ApiServerPeer:
    """What an engine's API server in api-key mode knows of the keys: a protocol peer with
    role "api" keeping an output_rate_core KeyTable from the snapshot and key deltas, the
    table the engine checks a presented key against. It can report key uses."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self._table = KeyTable()
        self._lock = threading.Lock()
        self._outbox: list[p.KeyUse] = []

    def user_of(self, key: str) -> tuple[str, str] | None:
        """(key id, user) as the engine would authenticate `key`, or None."""
        with self._lock:
            return self._table.user_of(key)

    def report_use(self, used: dict[str, float]) -> None:
        with self._lock:
            self._outbox.append(p.KeyUse(self.engine_id, used))

    def run(self, endpoint: str, stop: threading.Event, ready: threading.Event) -> None:
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        engine_id = self.engine_id
        try:
            sock.send(p.encode(p.Hello(engine_id, "tiny", 0, role=p.API_ROLE)))
            version = 0
            while not stop.is_set():
                while sock.poll(0):
                    message = p.decode(sock.recv())
                    if isinstance(message, p.Snapshot | p.Delta):
                        with self._lock:
                            if isinstance(message, p.Snapshot):
                                self._table = KeyTable.from_snapshot(message)
                            else:
                                for op in message.ops:
                                    self._table.apply(op)
                        version = message.version
                        sock.send(p.encode(p.Ack(engine_id, version)))
                        ready.set()
                with self._lock:
                    outbox, self._outbox = self._outbox, []
                for use in outbox:
                    sock.send(p.encode(use))
                sock.send(p.encode(p.Heartbeat(version, engine_id, "tiny", role=p.API_ROLE)))
                stop.wait(0.2)
        finally:
            sock.close()
            context.term()


@contextmanager
def api_server(served: ControlPlane, engine_id: str) -> Iterator[ApiServerPeer]:
    """A connected API-server peer (role "api") of `engine_id`, heartbeating every 0.2 s."""
    peer = ApiServerPeer(engine_id)
    stop = threading.Event()
    ready = threading.Event()
    thread = threading.Thread(target=peer.run, args=(served.zmq_endpoint, stop, ready), daemon=True)
    thread.start()
    try:
        assert ready.wait(15), "the API-server peer got no snapshot"
        yield peer
    finally:
        stop.set()
        thread.join(5)
