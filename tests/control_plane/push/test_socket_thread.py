"""No database call runs on the push server's socket thread (docs/live-push.md, "The push
server's parts"): every statement the database sees is recorded with the thread that ran
it, through a whole life of the server: binds (with replicas, claimed in the database
and led under a real lease), snapshots for both roles, deltas, acks, fleet shares, status
rows, an engine timing out, the shutdown."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import zmq
from sqlalchemy import event

from control_plane.config import service as config
from control_plane.db import Database, make_engine
from control_plane.engines.service import list_engines
from control_plane.fleet.coordinator import FleetCoordinator
from control_plane.limits import service as limits
from control_plane.push.server import PushServer
from control_plane.replicas import relay as fleet_relay
from control_plane.replicas.lease import LeaseKeeper
from control_plane.replicas.notify import current_channel
from harness.control_plane import fresh_database
from output_rate_core import protocol as p
from tests.control_plane.fleet.test_push_fleet import Engine, until
from tests.control_plane.push.test_push import write

SOCKET_THREAD = "output-rate-push"
LEASE_S = 1.5


def statements_by_thread(db: Database) -> set[str]:
    """The names of the threads that ran a statement on ``db`` from now on."""
    names: set[str] = set()

    def record(*_: object) -> None:
        names.add(threading.current_thread().name)

    event.listen(db.engine, "before_cursor_execute", record)
    return names


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_the_socket_thread_never_waits_on_the_database(kind: str, tmp_path: Path) -> None:
    with fresh_database(kind, tmp_path) as url:
        db = Database(make_engine(url))
        threads = statements_by_thread(db)
        lease = relay = None
        if kind == "postgres":  # a replica: binds are claimed, the allocator is led
            lease = LeaseKeeper(db, holder="r1")
            with db.engine.connect() as conn:
                channel = current_channel(conn, prefix=fleet_relay.CHANNEL_PREFIX)
            relay = fleet_relay.FleetRelay(
                db, replica_id="r1", term=lambda: lease.term, channel=channel, notify=False
            )
            server = PushServer(
                endpoint="tcp://127.0.0.1:0",
                db=db,
                engine_timeout_s=1.5,
                relay=relay,
                term=lambda: lease.term,
                make_fleet=lambda quiet: FleetCoordinator(lease_s=LEASE_S, quiet_until=quiet),
                share_lease_s=LEASE_S,
            )
            lease.start()
            relay.start()
        else:
            fleet = FleetCoordinator(lease_s=LEASE_S)
            server = PushServer(
                endpoint="tcp://127.0.0.1:0", db=db, engine_timeout_s=1.5, fleet=fleet
            )
        server.start()
        engine = Engine(server.endpoint, "e1")
        context = zmq.Context()
        api = context.socket(zmq.DEALER)
        api.setsockopt(zmq.LINGER, 0)
        api.connect(server.endpoint)
        try:
            api.send(p.encode(p.Hello("e1", "", 0, role=p.API_ROLE)))
            assert api.poll(20_000) and p.peek_type(api.recv()) == p.SNAPSHOT
            write(db, server, limits.put_limit, user="u", rate=40, tier=None)
            version = db.read_now(config.current_version)
            engine.streams = {"u": 1}
            until([engine], lambda: engine.client.applied_version == version)
            until([engine], lambda: engine.share("u") == 40_000)
            until(
                [engine],
                lambda: (
                    [e.applied_version for e in db.read_now(list_engines, timeout_s=5).items]
                    == [version]
                ),
            )
            engine.client.close()
            api.close()
            time.sleep(2.5)  # past the engine timeout: its row says disconnected
            assert [e.connected for e in db.read_now(list_engines, timeout_s=60).items] == [False]
        finally:
            engine.client.close()
            api.close()
            context.term()
            server.close()
            for part in (relay, lease):
                if part is not None:
                    part.close()
            db.dispose()
        rows = {"output-rate-push-reads", "output-rate-engine-rows"}
        assert rows <= threads and SOCKET_THREAD not in threads, threads
