"""A rogue engine's demand no longer starves the honest ones (issue 34; docs/fleet.md,
"Trust"): the real push server with its allocator on a real SQLite database, an honest
engine that is the real push client and limiter, and a rogue that is a raw socket bound to
its own admitted id (plain TCP, and CURVE with its key allowed that id only), claiming
2**53 streams of the tenant and acknowledging every share it is sent, as an engine that
keeps its lease would. Before: the honest engine enforced 1 milli-token/s (0.001 tok/s)
for the tenant within 20 ms, for as long as the rogue acknowledged."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zmq

from control_plane.db import Database
from control_plane.fleet.coordinator import FleetCoordinator
from control_plane.limits import service as limits
from control_plane.push.server import PushServer
from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import PushClient
from output_rate_core import protocol as p
from output_rate_core.limits import safe_share
from output_rate_core.zmq_util import make_socket
from tests.control_plane.push.test_push import db, write  # noqa: F401 (the db fixture)

LIMIT = 40
LEASE_S = 2.0
WAIT_S = 20.0
# Long enough for many rounds of the rogue's claims and acks and of the allocator's steps.
HOLD_S = 3.0


class Keys:
    def __init__(self) -> None:
        self.server_public, self.server_secret = (k.decode() for k in zmq.curve_keypair())
        self.honest_public, self.honest_secret = (k.decode() for k in zmq.curve_keypair())
        self.rogue_public, self.rogue_secret = (k.decode() for k in zmq.curve_keypair())


@pytest.fixture(params=["plain", "curve"])
def keys(request: pytest.FixtureRequest) -> Keys | None:
    return Keys() if request.param == "curve" else None


@pytest.fixture
def server(db: Database, keys: Keys | None) -> Iterator[PushServer]:  # noqa: F811
    allowed = None
    if keys is not None:
        allowed = {
            keys.honest_public: frozenset({"honest"}),
            keys.rogue_public: frozenset({"rogue"}),
        }
    server = PushServer(
        endpoint="tcp://127.0.0.1:0",
        db=db,
        fleet=FleetCoordinator(lease_s=LEASE_S),
        secret_key=None if keys is None else keys.server_secret,
        client_public_keys=allowed,
    )
    server.start()
    yield server
    server.close()


@dataclass
class Beside:
    """What the honest engine enforced for the tenant while the rogue claimed."""

    # Its lowest share once both engines were in the fleet, and its last one.
    lowest: int | None = None
    last: int | None = None


def _rogue_beside_honest(
    db: Database,  # noqa: F811
    server: PushServer,
    keys: Keys | None,
    *,
    capacity: int,
    claim: int,
    evidenced: bool = False,
) -> Beside:
    """The honest engine (one stream of the tenant; ``evidenced``: its usage reports count
    tokens and throttled steps of the tenant, as a scheduler whose share holds it back
    does) beside the rogue, which says ``capacity`` at HELLO and claims ``claim`` streams
    for HOLD_S, acknowledging every share it is sent and reporting 100 tokens a second
    granted to the tenant (fewer than a token per stream claimed)."""
    write(db, server, limits.put_limit, user="tenant", rate=LIMIT, tier=None)
    limiter = OutputRateLimiter(None)
    honest = PushClient(
        endpoints=[server.endpoint],
        engine_id="honest",
        model="tiny",
        server_public_key=None if keys is None else keys.server_public,
        client_secret_key=None if keys is None else keys.honest_secret,
        capacity=256,
    )
    honest.start()
    context = zmq.Context()
    rogue = make_socket(
        context,
        zmq.DEALER,
        server_public_key=None if keys is None else keys.server_public,
        client_secret_key=None if keys is None else keys.rogue_secret,
    )
    beside = Beside()
    try:
        deadline = time.monotonic() + WAIT_S
        while honest.applied_version == 0:
            assert time.monotonic() < deadline, "the honest engine had no snapshot"
            honest.apply_pending(limiter)
            honest.report_demand({"tenant": 1})
            time.sleep(0.01)
        rogue.connect(server.endpoint)
        rogue.send(p.encode(p.Hello("rogue", "tiny", 0, capacity=capacity)))
        started = time.monotonic()
        while time.monotonic() - started < HOLD_S:
            rogue.send(p.encode(p.Demand("rogue", True, {"tenant": claim})))
            rogue.send(p.encode(p.Usage("rogue", 1.0, {"tenant": 100}, {})))
            while rogue.poll(0):
                frame = rogue.recv()
                if p.peek_type(frame) == p.SHARES:
                    shares = p.decode(frame)
                    assert isinstance(shares, p.Shares)
                    rogue.send(p.encode(p.ShareAck("rogue", shares.epoch, shares.seq)))
                elif p.peek_type(frame) == p.SNAPSHOT:
                    rogue.send(p.encode(p.Ack("rogue", p.decode(frame).version)))  # type: ignore[union-attr]
            honest.apply_pending(limiter)
            honest.report_demand({"tenant": 1})
            if evidenced:
                honest.report_usage(granted={"tenant": 1}, throttled={"tenant": 3})
            if server.fleet is not None and server.fleet.num_engines == 2:
                share = limiter.milli_rate_of("tenant")
                assert share is not None
                beside.last = share
                beside.lowest = share if beside.lowest is None else min(beside.lowest, share)
            time.sleep(0.02)
        assert beside.lowest is not None, "the rogue never joined the fleet"
        return beside
    finally:
        rogue.close(linger=0)
        context.term()
        honest.close()


def test_a_rogue_claim_leaves_the_honest_engine_at_least_its_safe_share(
    db: Database,  # noqa: F811
    server: PushServer,
    keys: Keys | None,
) -> None:
    beside = _rogue_beside_honest(db, server, keys, capacity=2**31, claim=2**53)
    print(f"\nhonest engine's lowest share beside the rogue: {beside.lowest} milli-tokens/s")
    assert beside.lowest is not None and beside.lowest >= safe_share(LIMIT * p.MILLI, 2)
    # The rogue is flagged; its frames beyond the rate were refused and counted.
    assert server.dispatcher.num_implausible_demands > 0
    assert server.dispatcher.num_demand_refused > 0


@pytest.mark.parametrize("evidenced", [True, False])
def test_a_rogue_claiming_its_whole_capacity_takes_no_more_than_the_evidenced_engine(
    db: Database,  # noqa: F811
    server: PushServer,
    keys: Keys | None,
    evidenced: bool,
) -> None:
    """The rogue claims exactly the capacity it said (never cut, never flagged) and its
    usage does not bear it out. The honest engine's usage bears out its stream: it ends
    at its safe share, an even split (allocator.weigh_by_evidence); without usage from it
    (the rule unused) the rogue keeps 4,096 / 4,097 of the limit."""
    capacity = p.MAX_ENGINE_CAPACITY
    beside = _rogue_beside_honest(
        db, server, keys, capacity=capacity, claim=capacity, evidenced=evidenced
    )
    print(f"\nhonest engine's last share beside the rogue: {beside.last} milli-tokens/s")
    assert beside.last is not None
    if evidenced:
        assert beside.last >= safe_share(LIMIT * p.MILLI, 2)
    else:
        assert beside.last < 20
    assert server.dispatcher.num_implausible_demands == 0
