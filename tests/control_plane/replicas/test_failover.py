"""Failover within the heartbeat timeout (docs/replicas.md, "Failover"): two real
`output-rate serve` replicas on one PostgreSQL schema and a real push client (an
ApplyingEngine, default timeouts) listing both. Its replica is killed with SIGKILL, or cut
off from PostgreSQL (its sessions terminated and refused, its port refused, its
connection black-holed) through a TCP proxy that only that replica uses; a write through
the other replica must reach the engine within FAILOVER_GOAL_S of the kill or the cut.

Why that holds: the engine leaves a silent replica SERVER_SILENCE_S after it last heard
it (at most the kill), and a replica that loses its database says Goodbye within
CUT_OFF_AFTER_S (+ one round trip interval); the other replica may bind the engine once
its row is HOME_SILENT_AFTER_S old (the dead home wrote it last at most at the kill),
and answers with a snapshot that carries the write.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from control_plane.push.database_watch import CUT_OFF_AFTER_S, PING_INTERVAL_S
from control_plane.push.status import HOME_SILENT_AFTER_S
from harness.applying_engine import ApplyingEngine
from harness.control_plane import fresh_database, kill_hard, serve
from harness.failover import session_terminator, start_on_first, write_through
from harness.tcp_proxy import Cut, TcpProxy
from output_rate_core import protocol as p

pytestmark = pytest.mark.postgres

# The goal (issue 33): a write reaches the engine through the next replica this soon.
FAILOVER_GOAL_S = 5.0
assert p.SERVER_SILENCE_S < FAILOVER_GOAL_S
assert CUT_OFF_AFTER_S + PING_INTERVAL_S + HOME_SILENT_AFTER_S < FAILOVER_GOAL_S
WAIT_S = 60.0


@pytest.fixture
def database(tmp_path: Path) -> Iterator[str]:
    with fresh_database("postgres", tmp_path) as url:
        yield url


def test_kill_9_of_its_replica_a_write_reaches_the_engine_through_the_other_within_5_s(
    database: str, tmp_path: Path
) -> None:
    with ExitStack() as stack:
        a = stack.enter_context(serve(database, tmp_path))
        b = stack.enter_context(serve(database, tmp_path))
        engine = start_on_first("killed-home", a, b, WAIT_S)
        stack.callback(engine.close)
        kill_hard(a)
        killed_at = time.monotonic()
        version = write_through(b, "after-kill", 7)
        applied_at = engine.wait_applied(version, WAIT_S)
        failover_s = applied_at - killed_at
        print(f"\nwrite applied through the other replica {failover_s:.2f} s after kill -9")
        assert engine.client.endpoint_index == 1
        assert engine.limiter.rate_of("after-kill") == 7
        assert failover_s <= FAILOVER_GOAL_S
        # A failover is no clash: the other replica waited out the dead home's row.
        assert engine.client.refusals == {}


@pytest.mark.parametrize("how", ["terminate", "refuse", "blackhole"])
def test_a_replica_cut_off_from_its_database_sends_its_engines_to_another(
    database: str, tmp_path: Path, how: Cut
) -> None:
    proxy = TcpProxy(("127.0.0.1", 5432))
    via_proxy = database.replace("@127.0.0.1:5432/", f"@127.0.0.1:{proxy.port}/")
    assert via_proxy != database
    with ExitStack() as stack:
        terminate = stack.enter_context(session_terminator())
        stack.callback(proxy.close)
        a = stack.enter_context(serve(via_proxy, tmp_path))
        stack.callback(proxy.restore)  # before a stops: its shutdown writes
        b = stack.enter_context(serve(database, tmp_path))
        engine = start_on_first(f"cut-off-{how}", a, b, WAIT_S)
        stack.callback(engine.close)
        proxy.cut(how, terminate)
        cut_at = time.monotonic()
        version = write_through(b, "after-cut", 9)
        applied_at = engine.wait_applied(version, WAIT_S)
        failover_s = applied_at - cut_at
        print(f"\n{how}: write applied through the other replica {failover_s:.2f} s after the cut")
        assert engine.client.endpoint_index == 1
        assert engine.limiter.rate_of("after-cut") == 9
        assert failover_s <= FAILOVER_GOAL_S
        assert engine.client.refusals == {}
        assert "no answer from the database" in a.log.read_text()
        assert httpx.get(f"{a.url}/readyz", timeout=30).status_code == 503
        # New engines are turned away until the database answers again...
        late = ApplyingEngine(f"late-{how}", [a.zmq_endpoint])
        late.start()
        stack.callback(late.close)
        assert not late.client.wait_for_snapshot(2 * p.HEARTBEAT_INTERVAL_S + 0.5)
        # ... and welcome once it does.
        proxy.restore()
        assert late.client.wait_for_snapshot(WAIT_S), "never welcomed back"
        late.wait_applied(version, WAIT_S)
