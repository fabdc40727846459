"""The push channel trusts no peer: against a real `output-rate serve` and real ZMQ
peers, a spoofed or forged message changes nothing an operator reads, a bad one never
yields a 5xx nor blocks another engine's row, and a HELLO flood does not slow a real
engine down."""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from engine_ext.limiter import OutputRateLimiter
from engine_ext.push_client import PushClient
from engine_ext.saved_state import StateFile, StateWriter
from harness.control_plane import Served, fresh_database, serve
from output_rate_core import protocol as p

WAIT_S = 30.0


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class RealEngine:
    """A real engine_ext PushClient and the limiter it feeds (applied only in `step`)."""

    def __init__(
        self, endpoint: str, engine_id: str, state_dir: Path | None = None, **keys: str | None
    ) -> None:
        """``state_dir``: where it saves what it applies, and starts from."""
        self.limiter = OutputRateLimiter(None)
        state = None if state_dir is None else StateFile(state_dir, engine_id, p.ENGINE_ROLE)
        self.client = PushClient(
            endpoints=[endpoint],
            engine_id=engine_id,
            model="tiny",
            server_public_key=keys.get("server_public"),
            client_secret_key=keys.get("secret"),
            state=None if state is None else StateWriter(state),
        )
        saved = None if state is None else state.load()
        if saved is not None:
            self.client.enforce_saved(self.limiter, saved.snapshot)
        self.client.start()

    def step(self) -> int:
        self.client.apply_pending(self.limiter)
        return self.client.applied_version


class RawPeer:
    """A hand-driven DEALER: says whatever a forger would."""

    def __init__(self, endpoint: str, *, server_public: str | None = None, secret: str = ""):
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if server_public is not None:
            self.sock.curve_secretkey = secret.encode()
            self.sock.curve_publickey = zmq.curve_public(secret.encode())
            self.sock.curve_serverkey = server_public.encode()
        self.sock.connect(endpoint)

    def send(self, message: p.Message) -> None:
        self.sock.send(p.encode(message))

    def send_raw(self, frame: bytes) -> None:
        self.sock.send(frame)

    def received(self, timeout_s: float = 0.0) -> list[int]:
        """Message types received so far."""
        kinds = []
        if timeout_s:
            self.sock.poll(int(timeout_s * 1000))
        while True:
            try:
                kinds.append(self.sock.recv(zmq.NOBLOCK)[0])
            except zmq.Again:
                return kinds

    def close(self) -> None:
        self.sock.close()
        self.context.term()


@contextmanager
def control_plane(
    kind: str, tmp_path: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[Served, httpx.Client]]:
    with (
        fresh_database(kind, tmp_path) as url,
        serve(url, tmp_path, env=env) as served,
        served.client() as api,
    ):
        yield served, api


def engine_row(api: httpx.Client, engine_id: str) -> dict[str, Any] | None:
    response = api.get("/engines")
    assert response.status_code == 200, response.text
    rows = [r for r in response.json()["items"] if r["engine_id"] == engine_id]
    return rows[0] if rows else None


def put_default(api: httpx.Client, rate: int) -> int:
    response = api.put("/default-limit", json={"output_tokens_per_second": rate})
    assert response.status_code == 200
    return int(response.json()["version"])


def test_spoofed_hello_and_ack_leave_the_real_engine_row_untouched(tmp_path: Path) -> None:
    with control_plane("sqlite", tmp_path) as (served, api):
        version = put_default(api, 5)
        victim = RealEngine(served.zmq_endpoint, "victim")
        spoofer = RawPeer(served.zmq_endpoint)
        try:
            wait_for(lambda: victim.step() == version, "the victim's snapshot")
            wait_for(
                lambda: (engine_row(api, "victim") or {}).get("applied_version") == version,
                "the victim's row",
            )
            # A new version the victim has not applied (it applies only in step()).
            newer = put_default(api, 6)
            spoofer.send(p.Ack("victim", newer))  # unbound: counts for nothing
            spoofer.send(p.Hello("victim", "evil", 0))  # the id is bound to a live peer
            spoofer.send(p.Ack("victim", newer))
            spoofer.send(p.Heartbeat(newer, "victim", "evil"))
            time.sleep(2 * p.HEARTBEAT_INTERVAL_S)
            row = engine_row(api, "victim")
            assert row is not None
            assert (row["applied_version"], row["model"], row["connected"]) == (
                version,
                "tiny",
                True,
            )
            # The spoofer got no snapshot: it reads no limits either.
            assert p.SNAPSHOT not in spoofer.received()
            assert victim.step() == newer  # the real engine applies and its row follows
            wait_for(
                lambda: (engine_row(api, "victim") or {}).get("applied_version") == newer,
                "the victim's own ack",
            )
            # A connection bound to its own id cannot speak for another.
            spoofer.send(p.Hello("mallory", "evil", 0))
            assert p.SNAPSHOT in spoofer.received(timeout_s=5)
            spoofer.send(p.Ack("victim", newer + 5))
            spoofer.send(p.Heartbeat(newer + 5, "victim", "evil"))
            time.sleep(2 * p.HEARTBEAT_INTERVAL_S)
            assert engine_row(api, "victim")["applied_version"] == newer  # type: ignore[index]
        finally:
            victim.client.close()
            spoofer.close()


def test_a_second_engine_with_a_live_id_is_refused_loudly_and_keeps_its_saved_limits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with control_plane("sqlite", tmp_path) as (served, api):
        limited = {"output_tokens_per_second": 7, "scope": "engine"}
        assert api.put("/limits/limited", json=limited).status_code == 200
        version = put_default(api, 50)
        first = RealEngine(served.zmq_endpoint, "dup")
        # The second: the same id (two replicas with one --output-rate-engine-id), and
        # the configuration it applied in an earlier run.
        state_dir = tmp_path / "second"
        saved = p.Snapshot(2, None, {}, {"limited": (None, 7)}, user_scopes={"limited": "engine"})
        StateFile(state_dir, "dup", p.ENGINE_ROLE).save(saved)
        second = None
        try:
            wait_for(lambda: first.step() == version, "the first engine's snapshot")
            wait_for(lambda: engine_row(api, "dup"), "the first engine's row")
            caplog.set_level(logging.ERROR, logger="vllm.output_rate")
            second = RealEngine(served.zmq_endpoint, "dup", state_dir=state_dir)
            refused = second.client.refusals
            # Every heartbeat claims the id again, and is refused again.
            wait_for(lambda: refused.get("engine_id_in_use", 0) >= 3, "three refusals")
            assert set(refused) == {"engine_id_in_use"}
            # It never got the limits, and is never unlimited: its saved configuration.
            assert second.step() == 2 and second.client.serving_saved
            assert second.limiter.rate_of("limited") == 7
            assert second.limiter.rate_of("anyone") is None  # as saved: no default then
            # The engine says why, as an error, naming the id and what it serves meanwhile.
            engine_lines = [r for r in caplog.records if "refused engine id 'dup'" in r.message]
            assert engine_lines and all(r.levelno == logging.ERROR for r in engine_lines)
            assert "engine_id_in_use" in engine_lines[0].message
            assert "saved configuration (version 2)" in engine_lines[0].message
            # The control plane logs the refused claim with both peers, and shows it.
            log = served.log.read_text()
            assert "refused engine id 'dup' (engine) to the connection from 127.0.0.1" in log
            assert "the live connection from 127.0.0.1 holds it" in log
            row = engine_row(api, "dup")
            assert row is not None and row["refused_claims"] >= 3
            assert row["last_refused_claim_from"] == "127.0.0.1"
            refused_at = datetime.fromisoformat(row["last_refused_claim_at"])
            assert abs((datetime.now(UTC) - refused_at).total_seconds()) < 10
            # The first engine keeps its id, its row and its limits.
            assert row["connected"] and row["applied_version"] == version
            assert first.step() == version and first.client.refusals == {}
        finally:
            first.client.close()
            if second is not None:
                second.client.close()


def test_curve_key_may_claim_only_its_own_engine_ids(tmp_path: Path) -> None:
    server_public, server_secret = (k.decode() for k in zmq.curve_keypair())
    one_public, one_secret = (k.decode() for k in zmq.curve_keypair())
    two_public, two_secret = (k.decode() for k in zmq.curve_keypair())
    env = {
        "OUTPUT_RATE_ZMQ_SECRET_KEY": server_secret,
        "OUTPUT_RATE_ZMQ_CLIENT_KEYS": f"{one_public}=engine-1,{two_public}=engine-2",
    }
    with control_plane("sqlite", tmp_path, env) as (served, api):
        version = put_default(api, 5)
        keys = {"server_public": server_public}
        impostor = RealEngine(served.zmq_endpoint, "engine-2", secret=one_secret, **keys)
        try:
            time.sleep(3 * p.HEARTBEAT_INTERVAL_S)
            assert impostor.step() == 0 and not impostor.client.has_snapshot
            assert engine_row(api, "engine-2") is None
            assert "may not claim" in served.log.read_text()
            real_one = RealEngine(served.zmq_endpoint, "engine-1", secret=one_secret, **keys)
            real_two = RealEngine(served.zmq_endpoint, "engine-2", secret=two_secret, **keys)
            try:
                wait_for(lambda: real_one.step() == version, "engine-1's snapshot")
                wait_for(lambda: real_two.step() == version, "engine-2's snapshot")
                wait_for(lambda: engine_row(api, "engine-2"), "engine-2's row")
                assert impostor.step() == 0
            finally:
                real_one.client.close()
                real_two.client.close()
        finally:
            impostor.client.close()


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_forged_usage_changes_nothing_and_never_yields_a_5xx(kind: str, tmp_path: Path) -> None:
    with control_plane(kind, tmp_path) as (served, api):
        put_default(api, 5)
        forger = RawPeer(served.zmq_endpoint)
        bound = RawPeer(served.zmq_endpoint)
        try:
            # Without a HELLO, under a stranger's id, with absurd counts, with a NUL user.
            forger.send(p.Usage("victim", 1.0, {"alice": 10**12}, {}))
            bound.send(p.Hello("mallory", "x", 0))
            assert p.SNAPSHOT in bound.received(timeout_s=5)
            bound.send(p.Usage("victim", 1.0, {"alice": 100}, {}))  # not its own id
            bound.send(p.Usage("mallory", 1.0, {"alice": 10**12}, {}))  # beyond one engine
            bound.send(p.Usage("mallory", 1.0, {"bob": 1}, {"bob": 10**12}))
            nul = p.encode(p.Usage("mallory", 1.0, {"carol": 1}, {}))
            bound.send_raw(nul.replace(b"carol", b"ca\x00ol"))
            bound.send_raw(nul.replace(b"carol", b"ca/ol"))
            time.sleep(2 * p.HEARTBEAT_INTERVAL_S)
            for _ in range(3):
                response = api.get("/usage")
                assert response.status_code == 200, response.text
                assert response.json()["items"] == []
            metrics = api.get("/metrics")
            assert metrics.status_code == 200
            assert "output_rate_user_output_tokens_per_second{" not in metrics.text
            # The bound peer's own, plausible report does count.
            bound.send(p.Usage("mallory", 1.0, {"dave": 40}, {}))
            rows = wait_for(lambda: api.get("/usage").json()["items"], "a real report")
            assert [r["user"] for r in rows] == ["dave"]
        finally:
            forger.close()
            bound.close()


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_bad_ids_from_a_peer_never_block_other_engines_rows(kind: str, tmp_path: Path) -> None:
    with control_plane(kind, tmp_path) as (served, api):
        version = put_default(api, 5)
        engine = RealEngine(served.zmq_endpoint, "good")
        bad = RawPeer(served.zmq_endpoint)
        try:
            wait_for(lambda: engine.step() == version, "the snapshot")
            first = wait_for(lambda: engine_row(api, "good"), "good's row")
            hello = p.encode(p.Hello("abcde", "model", 0))
            for frame in (
                hello.replace(b"abcde", b"ab\x00de"),
                p.encode(p.Hello("x" * 5000, "m", 0)),
                p.encode(p.Hello("ok-id", "m" * 5000, 0)),
                p.encode(p.Heartbeat(0, "y" * 600, "m")),
                p.encode(p.Heartbeat(0, "ok-id", "z" * 600)),
                hello.replace(b"model", b"mo\x00el"),
                p.encode(p.Hello("a/b", "m", 0)),
            ):
                bad.send_raw(frame)
            time.sleep(3 * p.HEARTBEAT_INTERVAL_S)
            rows = api.get("/engines")
            assert rows.status_code == 200
            assert [r["engine_id"] for r in rows.json()["items"]] == ["good"]
            now = engine_row(api, "good")
            assert now is not None and now["connected"] is True
            assert now["last_seen"] > first["last_seen"]  # its row keeps being written
            assert p.SNAPSHOT not in bad.received()
        finally:
            engine.client.close()
            bad.close()


def _delta_latency(api: httpx.Client, engine: RealEngine, rate: int) -> float:
    start = time.perf_counter()
    version = put_default(api, rate)
    while engine.step() < version:
        assert time.perf_counter() - start < WAIT_S
        time.sleep(0.001)
    return time.perf_counter() - start


def test_hello_flood_gets_one_snapshot_per_interval_and_spares_real_engines(
    tmp_path: Path,
) -> None:
    with control_plane("sqlite", tmp_path) as (served, api):
        items = [{"user": f"user-{i:05d}", "output_tokens_per_second": 9} for i in range(5000)]
        assert api.post("/limits:bulk", json={"items": items}).status_code == 200
        engine = RealEngine(served.zmq_endpoint, "real")
        flooder = RawPeer(served.zmq_endpoint)
        try:
            wait_for(lambda: engine.step() >= 1, "the snapshot")
            baseline = [_delta_latency(api, engine, 10 + i) for i in range(10)]
            stop = threading.Event()
            snapshots: list[int] = []
            hello = p.encode(p.Hello("flooder", "m", 0))

            def flood() -> None:
                while not stop.is_set():  # ~2,000 HELLOs/s (the probe sent 1,200/s)
                    for _ in range(10):
                        flooder.send_raw(hello)
                    snapshots.extend(k for k in flooder.received() if k == p.SNAPSHOT)
                    time.sleep(0.005)

            thread = threading.Thread(target=flood, daemon=True)
            started = time.monotonic()
            thread.start()
            time.sleep(1.0)
            during = [_delta_latency(api, engine, 100 + i) for i in range(10)]
            stop.set()
            thread.join()
            elapsed = time.monotonic() - started
            snapshots.extend(k for k in flooder.received(timeout_s=0.5) if k == p.SNAPSHOT)
        finally:
            engine.client.close()
            flooder.close()
    # One snapshot per connection per second at most (before: one per HELLO).
    assert 1 <= len(snapshots) <= elapsed / 1.0 + 2
    # Before: the PUT -> delta latency went from 2-12 ms to ~1-2 s under the flood.
    assert statistics.median(during) < 5 * statistics.median(baseline) + 0.1


def test_usage_reports_cannot_grow_usage_without_bound(tmp_path: Path) -> None:
    from control_plane.usage.book import MAX_TRACKED_USERS

    with control_plane("sqlite", tmp_path) as (served, api):
        peers = [RawPeer(served.zmq_endpoint) for _ in range(2)]
        try:
            for i, peer in enumerate(peers):
                peer.send(p.Hello(f"reporter-{i}", "m", 0))
                assert p.SNAPSHOT in peer.received(timeout_s=5)
            # Before: every report's users were listed (100 x 20k users: 2,000,000 rows).
            n = p.MAX_USAGE_USERS
            reports = 2 * MAX_TRACKED_USERS // n + 1
            for r in range(reports):
                users = {f"u{r}-{j}": 1 for j in range(n)}
                peers[r % 2].send(p.Usage(f"reporter-{r % 2}", 1.0, users, {}))
            time.sleep(1.0)
            rows = wait_for(
                lambda: len(api.get("/usage").json()["items"]) >= MAX_TRACKED_USERS,
                "the reports",
            )
            assert rows
            start = time.perf_counter()
            items = api.get("/usage").json()["items"]
            elapsed = time.perf_counter() - start
            assert len(items) == MAX_TRACKED_USERS
            metrics = api.get("/metrics").text
            left_out = reports * n - MAX_TRACKED_USERS
            assert f"output_rate_usage_users_left_out_total {left_out}.0" in metrics
            small = time.perf_counter()
            assert api.get("/default-limit").status_code == 200
            assert elapsed < 60 * max(time.perf_counter() - small, 0.01) + 5
        finally:
            for peer in peers:
                peer.close()
