"""A flood of connections claiming fresh engine ids (HELLO, then nothing) against the real
`output-rate serve`: it holds at most MAX_UNPROVEN_PEERS slots, a known engine that
reconnects meanwhile is served at once, and none of them shows in GET /engines
(issue 23: 1,030 such sockets filled every slot and stayed in GET /engines for 24 h)."""

from __future__ import annotations

import time
from pathlib import Path

import zmq

from control_plane.push.peers import MAX_UNPROVEN_PEERS
from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import PushClient
from harness.control_plane import Served, fresh_database, serve
from output_rate_core import protocol as p

NUM_FLOOD = 300


def engine(served: Served, name: str) -> PushClient:
    client = PushClient(
        endpoints=[served.zmq_endpoint], engine_id=name, model="tiny", server_public_key=None
    )
    client.start()
    return client


def synced(client: PushClient, timeout_s: float) -> float:
    """Seconds until the client applied its snapshot."""
    limiter = OutputRateLimiter(None)
    started = time.monotonic()
    while not client.is_in_sync:
        assert time.monotonic() - started < timeout_s, "no snapshot"
        client.apply_pending(limiter)
        time.sleep(0.01)
    return time.monotonic() - started


def test_a_flood_of_fresh_ids_neither_locks_out_known_engines_nor_lists_ghosts(
    tmp_path: Path,
) -> None:
    env = {"OUTPUT_RATE_ENGINE_TIMEOUT_S": "1.5"}
    with fresh_database("sqlite", tmp_path) as url, serve(url, tmp_path, env=env) as served:
        with served.client() as http:
            http.put("/limits/a", json={"output_tokens_per_second": 9})
        known = engine(served, "known")
        synced(known, 30)
        with served.client() as http:
            deadline = time.monotonic() + 30
            while not any(e["engine_id"] == "known" for e in http.get("/engines").json()["items"]):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        known.close()
        time.sleep(2.5)  # its old connection timed out: the id is free to bind again

        context = zmq.Context()
        flood = []
        try:
            for i in range(NUM_FLOOD):
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(served.zmq_endpoint)
                sock.send(p.encode(p.Hello(f"ghost-{i}", "tiny", 0)))
                flood.append(sock)
            # The server has bound what it will (64) and refused the rest.
            deadline = time.monotonic() + 30
            unproven = "output_rate_push_unproven_connections"
            while served.metric(unproven) < MAX_UNPROVEN_PEERS:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            time.sleep(1.0)
            assert served.metric(unproven) == MAX_UNPROVEN_PEERS
            assert served.metric("output_rate_engines_connected") == 0

            # A known engine comes back in the middle of the flood: served at once.
            back = engine(served, "known")
            try:
                took = synced(back, 10)
            finally:
                back.close()
            print(f"\nknown engine resynced in {took * 1000:.0f} ms beside {NUM_FLOOD} ghosts")
            assert took < 5.0  # a refused bind would wait for the ghosts' grace (10 s)

            with served.client() as http:
                listed = {e["engine_id"] for e in http.get("/engines").json()["items"]}
            assert listed == {"known"}, listed
        finally:
            for sock in flood:
                sock.close(linger=0)
            context.term()
