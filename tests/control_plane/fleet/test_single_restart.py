"""A single control plane (SQLite) restarts like a new leader: quiet (docs/fleet.md, "Bound
holes"). Its fresh allocator knows none of the shares the process it replaces gave out, so
it sends its first shares only once every lease that process may have given has ended
(lease + 1 s after it started; the old process sent nothing after it died, before the new
one started). Before, it sent at once: old and new shares overlapped until every engine's
old lease ended. A real `output-rate serve` killed with SIGKILL and started again on the
same ports and database; real push clients that report demand for a fleet user. The
engines the killed process heard count in the restarted one's fleet at once (its rows), so
an engine joining before they are back reads the whole fleet's size."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import zmq

from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import PushClient
from harness.control_plane import fresh_database
from harness.servers import ControlPlane, free_port
from output_rate_core import protocol as p

LEASE_S = 5.0
WAIT_S = 60.0


def test_a_restarted_single_control_plane_sends_no_share_before_the_old_leases_ended(
    tmp_path: Path,
) -> None:
    port, zmq_port = free_port(), free_port()
    env = {"OUTPUT_RATE_SHARE_LEASE_S": str(LEASE_S)}
    with fresh_database("sqlite", tmp_path) as url:
        cp = ControlPlane(tmp_path / "cp-1.log", url, port, zmq_port, extra_env=env)
        cp.wait_ready()
        cp.put("u", 40)
        limiter = OutputRateLimiter(None)

        def connect(engine_id: str) -> PushClient:
            client = PushClient(
                endpoints=[cp.zmq_endpoint],
                engine_id=engine_id,
                model="tiny",
                server_public_key=None,
            )
            client.start()
            return client

        clients = [connect("e1"), connect("e2")]
        client = clients[0]

        def pump_until(condition, what: str) -> float:  # type: ignore[no-untyped-def]
            deadline = time.monotonic() + WAIT_S
            while not condition():
                assert time.monotonic() < deadline, what
                for each in clients:
                    each.apply_pending(limiter)
                    each.report_demand({"u": 1})
                time.sleep(0.01)
            return time.monotonic()

        try:
            pump_until(
                lambda: all(c.table.fleet.epoch is not None for c in clients), "no shares at all"
            )
            old_epoch = client.table.fleet.epoch
            clients.pop().close()  # e2 stops with the control plane
            cp.kill(signal.SIGKILL)
            killed_at = time.monotonic()
            cp = ControlPlane(tmp_path / "cp-2.log", url, port, zmq_port, extra_env=env)
            cp.wait_ready()
            # A third engine joins before e2 is back: its snapshot counts e1 and e2, the
            # engines the killed process heard (its rows), and itself.
            assert joining_snapshot(cp.zmq_endpoint, "e3").num_engines == 3
            clients.append(connect("e2"))  # back: its whole demand ends the wait for it
            new_at = pump_until(
                lambda: client.table.fleet.epoch not in (None, old_epoch),
                "no shares from the restarted control plane",
            )
            after = new_at - killed_at
            print(f"\nfirst shares of the restarted control plane {after:.2f}s after the kill")
            assert after >= LEASE_S + 1.0
            assert client.table.fleet.epoch > old_epoch  # type: ignore[operator]  # ordered
        finally:
            for each in clients:
                each.close()
            cp.kill(signal.SIGKILL)


def joining_snapshot(endpoint: str, engine_id: str) -> p.Snapshot:
    """The snapshot a new engine gets, read off a raw socket (before any share could
    restate the fleet size)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send(p.encode(p.Hello(engine_id, "tiny", 0)))
        assert sock.poll(int(WAIT_S * 1000))
        snapshot = p.decode(sock.recv())
        assert isinstance(snapshot, p.Snapshot)
        return snapshot
    finally:
        sock.close(linger=0)
        context.term()
