"""KeyClient (an engine's API server, role "api") against the real push server
in-process on a real SQLite database, beside the same engine's core (role "engine")."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from control_plane.config import service as config
from control_plane.db import Database, make_engine
from control_plane.keys import service as key_service
from control_plane.keys.bucket import TokenBucket
from control_plane.limits import service as limits
from control_plane.push.server import PushServer
from engine_ext.key_client import KeyClient
from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import PushClient
from harness.control_plane import fresh_database

WAIT_S = 20.0


def until(condition: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


class Uses:
    """What the server hands its key-use sink (the recorder in `output-rate serve`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.used: dict[str, float] = {}

    def __call__(self, used: Mapping[str, float]) -> None:
        with self.lock:
            self.used.update(used)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    with fresh_database("sqlite", tmp_path) as url:
        database = Database(make_engine(url))
        yield database
        database.dispose()


def write(db: Database, server: PushServer, fn: Callable[..., Any], **kw: Any) -> Any:
    result = db.write_now(fn, actor="test", **kw)
    server.notify(db.read_now(config.current_version))
    return result


def create_key(db: Database, server: PushServer, user: str) -> tuple[str, str]:
    bucket = TokenBucket(per_minute=60_000, burst=1000)
    change = write(
        db, server, key_service.create_key, user=user, max_keys_per_user=10, bucket=bucket
    )
    created = change.result
    return created.id, created.key


def start_server(db: Database, endpoint: str, uses: Uses) -> PushServer:
    server = PushServer(endpoint=endpoint, db=db, key_uses=uses)
    server.start()
    return server


def test_keys_follow_the_control_plane_beside_the_engine_core(db: Database) -> None:
    uses = Uses()
    server = start_server(db, "tcp://127.0.0.1:0", uses)
    alice = create_key(db, server, "alice")
    keys = KeyClient(
        endpoints=[server.endpoint],
        engine_id="e1",
        model="tiny",
        server_public_key=None,
        key_use_interval_s=0.1,
    )
    core = PushClient(
        endpoints=[server.endpoint], engine_id="e1", model="tiny", server_public_key=None
    )
    limiter = OutputRateLimiter(None)
    keys.start()
    core.start()
    try:
        until(lambda: keys.has_snapshot)
        assert keys.table.user_of(alice[1]) == (alice[0], "alice")
        # A key made while connected arrives as a delta; a limit change arrives with its
        # version kept and no op, so the versions stay gap-free.
        bob = create_key(db, server, "bob")
        until(lambda: keys.table.user_of(bob[1]) is not None)
        version = write(db, server, limits.put_limit, user="bob", rate=5, tier=None).commit.version
        until(lambda: keys.applied_version == version)
        assert keys.is_in_sync and keys.num_resyncs == 0
        # The engine core got the limit and no key.
        until(lambda: core.apply_pending(limiter) >= 0 and core.applied_version == version)
        assert limiter.rate_of("bob") == 5
        # Revoked: gone from the API server.
        write(db, server, key_service.revoke_key, key_id=alice[0])
        until(lambda: keys.table.user_of(alice[1]) is None)
        # Last use reaches the server's sink.
        keys.note_use(bob[0])
        until(lambda: bob[0] in uses.used)
        # The control plane restarts on the same endpoint: the keys stay while it is
        # down, and the client follows the new server (bound as role api by its heartbeat).
        endpoint = server.endpoint
        server.close()
        time.sleep(1.0)
        assert keys.table.user_of(bob[1]) == (bob[0], "bob")
        carol_server = start_server(db, endpoint, uses)
        server = carol_server
        carol = create_key(db, server, "carol")
        until(lambda: keys.table.user_of(carol[1]) is not None)
        assert keys.table.user_of(bob[1]) == (bob[0], "bob")
    finally:
        keys.close()
        core.close()
        server.close()
