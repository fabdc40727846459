"""One user's limit across two real vLLM engines and a real control plane (docs/fleet.md).

The stack starts once for the module: `output-rate serve` on SQLite with a short share
lease, and two tiny-model engines connected to it. Rates are measured as a client would,
summed over both engines: tokens from the usage block of every chunk, from the first
request sent to the last token read. Upper bounds are the fleet bound of docs/fleet.md;
the lower ones are fractions of the limit, far below what one engine produces unthrottled
(~600 tokens/s per stream on this CPU against a 40 tokens/s limit).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine_ext.saved_state import StateFile
from harness.client import StreamResult, run, stream_completion, user_rate
from harness.servers import ControlPlane, VllmServer, free_port

pytestmark = pytest.mark.e2e
AUTH = ControlPlane.auth_headers()
USER = "fleet-user"
LIMIT = 40
LEASE_S = 2.0
ENFORCED_METRIC = "vllm:output_rate_user_limit_tokens_per_second"
GONE_AFTER_S = 5.0  # 2 x the lease + 1 s: the least the settings take
NUM_ENGINES = 2
# The fleet bound's slack (docs/fleet.md): one token per engine (each engine's GCRA
# starts a user with one token) and a share change's propagation time at the full limit
# (a provisional safe share before the first answer, a raise sent after its lowering).
PROPAGATION_S = 0.1
# Client-side timestamps carry delivery jitter (see test_engine_limits.CLIENT_JITTER_S).
CLIENT_JITTER_S = 0.2


def fleet_bound(window_s: float, limit: float = LIMIT) -> float:
    return (window_s + 0.1 + CLIENT_JITTER_S + PROPAGATION_S) * limit + 1 + NUM_ENGINES


class FleetStack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.db_url = f"sqlite:///{tmp / 'cp.db'}"
        self.port, self.zmq_port = free_port(), free_port()
        self.control_plane = self.start_control_plane()
        self.engines = {name: self.start_engine(name) for name in ("fleet-a", "fleet-b")}
        for engine in self.engines.values():
            engine.wait_ready()

    def start_engine(
        self, engine_id: str, *, state_dir: Path | None = None, log_name: str | None = None
    ) -> VllmServer:
        """An engine of the fleet (``state_dir``: a restart finds what it saved there)."""
        return VllmServer(
            self.tmp / f"{log_name or engine_id}-{time.monotonic_ns()}.log",
            "--control-plane-endpoint",
            f"tcp://127.0.0.1:{self.zmq_port}",
            "--output-rate-engine-id",
            engine_id,
            "--max-num-seqs",
            "16",
            state_dir=state_dir,
        )

    def start_control_plane(self) -> ControlPlane:
        cp = ControlPlane(
            self.tmp / f"cp-{time.time()}.log",
            self.db_url,
            self.port,
            self.zmq_port,
            extra_env={
                "OUTPUT_RATE_SHARE_LEASE_S": str(LEASE_S),
                "OUTPUT_RATE_SHARE_GONE_AFTER_S": str(GONE_AFTER_S),
            },
        )
        cp.wait_ready()
        return cp

    def kill(self) -> None:
        for engine in self.engines.values():
            engine.kill()
        self.control_plane.kill()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    stack = FleetStack(tmp_path_factory.mktemp("fleet"))
    try:
        stack.control_plane.wait_applied(stack.control_plane.put(USER, LIMIT))
        yield stack
    finally:
        stack.kill()


def streams(plan: dict[str, int], max_tokens: int) -> dict[str, list[StreamResult]]:
    """``plan``: engine URL -> streams of USER on it, all at once; URL -> results."""

    async def main() -> dict[str, list[StreamResult]]:
        async with httpx.AsyncClient(timeout=300) as client:
            groups = {
                url: asyncio.gather(
                    *(
                        stream_completion(client, url, user=USER, max_tokens=max_tokens)
                        for _ in range(num)
                    )
                )
                for url, num in plan.items()
            }
            done = await asyncio.gather(*groups.values())
            return {url: list(results) for url, results in zip(groups, done, strict=True)}

    return run(main())


def token_times(results: list[StreamResult]) -> list[float]:
    return sorted(t for r in results for t in r.token_times)


def tokens_between(results: list[StreamResult], start: float, end: float) -> int:
    return sum(start <= t <= end for t in token_times(results))


def assert_within_fleet_bound(results: list[StreamResult]) -> tuple[int, float]:
    """Every window from the first request sent to any token holds the bound; returns
    (tokens, seconds from the first send to the last token)."""
    sent = min(r.started for r in results)
    times = token_times(results)
    for i, t in enumerate(times):
        assert i + 1 <= fleet_bound(t - sent), (i + 1, t - sent)
    return len(times), times[-1] - sent


def test_one_limit_holds_summed_over_two_engines(stack: FleetStack) -> None:
    a, b = (e.url for e in stack.engines.values())
    by_engine = streams({a: 2, b: 2}, max_tokens=100)
    results = [r for group in by_engine.values() for r in group]
    assert all(r.completion_tokens == 100 for r in results)
    num_tokens, span = assert_within_fleet_bound(results)
    # Two engines, one budget: about 40 tokens/s in total, not 80.
    assert num_tokens >= 0.8 * LIMIT * span, (num_tokens, span)
    view = httpx.get(f"{stack.control_plane.url}/limits/{USER}", headers=AUTH).json()
    assert view["effective_output_tokens_per_second"] == LIMIT


def test_traffic_moved_to_one_engine_gets_the_whole_limit_there(stack: FleetStack) -> None:
    a = stack.engines["fleet-a"].url
    results = streams({a: 4}, max_tokens=80)[a]
    assert_within_fleet_bound(results)
    # After a second to converge, engine a alone holds the whole limit.
    start = min(r.started for r in results) + 1.0
    end = max(token_times(results))
    assert tokens_between(results, start, end) >= 0.9 * LIMIT * (end - start)


def test_control_plane_killed_shares_hold_then_fall_back_safe(stack: FleetStack) -> None:
    a, b = stack.engines["fleet-a"].url, stack.engines["fleet-b"].url
    cp = stack.control_plane

    async def main() -> tuple[float, dict[str, list[StreamResult]]]:
        async with httpx.AsyncClient(timeout=300) as client:

            def start(url: str, num: int, max_tokens: int) -> asyncio.Future[list[StreamResult]]:
                return asyncio.gather(
                    *(
                        stream_completion(client, url, user=USER, max_tokens=max_tokens)
                        for _ in range(num)
                    )
                )

            # 3 streams on a, 1 on b: shares of 30 and 10 tokens/s.
            on_a, on_b = start(a, 3, 100), start(b, 1, 150)
            await asyncio.sleep(3.0)
            killed_at = time.monotonic()
            cp.kill(signal.SIGKILL)
            return killed_at, {a: await on_a, b: await on_b}

    killed_at, by_url = run(main())
    sent = min(r.started for group in by_url.values() for r in group)
    # The engines keep enforcing (their shares, then safe shares): the sum holds throughout.
    assert_within_fleet_bound(by_url[a] + by_url[b])
    # b had the smaller share (10 of 40); past the lease it runs at its safe share (20).
    before = tokens_between(by_url[b], sent + 1.0, killed_at) / (killed_at - sent - 1.0)
    after_start = killed_at + LEASE_S + 1.0
    after_end = max(token_times(by_url[b]))
    assert after_end - after_start > 1.0, "the streams ended too soon to see the fallback"
    after = tokens_between(by_url[b], after_start, after_end) / (after_end - after_start)
    assert after > 1.4 * before, (before, after)
    stack.control_plane = stack.start_control_plane()


def test_an_engine_killed_the_other_takes_the_whole_limit(stack: FleetStack) -> None:
    a_engine, b_engine = stack.engines["fleet-a"], stack.engines["fleet-b"]
    # The restarted control plane has both engines back.
    stack.control_plane.wait_applied(stack.control_plane.put(USER, LIMIT))

    async def main() -> tuple[float, list[StreamResult]]:
        async with httpx.AsyncClient(timeout=300) as client:
            on_a = asyncio.gather(
                *(
                    stream_completion(client, a_engine.url, user=USER, max_tokens=200)
                    for _ in range(2)
                )
            )
            on_b = asyncio.ensure_future(
                stream_completion(client, b_engine.url, user=USER, max_tokens=200)
            )
            await asyncio.sleep(2.0)
            killed_at = time.monotonic()
            b_engine.kill(signal.SIGKILL)
            on_b.cancel()
            return killed_at, list(await on_a)

    killed_at, results = run(main())
    # Once b is gone (GONE_AFTER_S of silence) a takes the whole limit.
    start = killed_at + GONE_AFTER_S + 1.0
    end = max(token_times(results))
    assert end - start > 1.0, "the streams ended too soon to see the take-over"
    num_tokens = tokens_between(results, start, end)
    assert 0.9 * LIMIT * (end - start) <= num_tokens <= fleet_bound(end - start)


def rate_between(results: list[StreamResult], start: float, end: float) -> float:
    return tokens_between(results, start, end) / (end - start)


def test_an_engine_restarted_while_the_control_plane_is_down_enforces_its_saved_limits(
    stack: FleetStack,
) -> None:
    # What b applied last is in its state dir: the user's fleet limit and a fleet of two.
    # The test before killed b, possibly before any share told it of a fleet of two (a
    # restarted control plane sends none for lease + 1 s): b rejoins first.
    old_b = stack.engines["fleet-b"]
    if old_b.popen.poll() is not None:
        old_b = stack.engines["fleet-b"] = stack.start_engine("fleet-b", state_dir=old_b.state_dir)
        old_b.wait_ready()
    saved_file = StateFile(old_b.state_dir, "fleet-b", "engine")
    deadline = time.monotonic() + 30
    while (saved := saved_file.load()) is None or saved.snapshot.num_engines != 2:
        assert time.monotonic() < deadline, saved
        time.sleep(0.2)
    assert saved.snapshot.users[USER] == (None, LIMIT)
    old_b.kill(signal.SIGKILL)
    stack.control_plane.kill(signal.SIGKILL)
    b = stack.engines["fleet-b"] = stack.start_engine("fleet-b", state_dir=old_b.state_dir)
    b.wait_ready()
    results = streams({b.url: 2}, max_tokens=60)[b.url]
    assert all(r.completion_tokens == 60 for r in results)
    # Alone, with no control plane, it holds the user to its safe share of the saved
    # fleet (L / 2), never its command-line limits (none: unlimited, ~600 tokens/s).
    sent = min(r.started for r in results)
    times = token_times(results)
    for i, t in enumerate(times):
        assert i + 1 <= fleet_bound(t - sent, LIMIT / 2), (i + 1, t - sent)
    num_tokens, span_s = user_rate(results, skip=2)
    print(
        f"restarted on its saved state: {(num_tokens - 1) / span_s:.1f} tokens/s against the "
        f"limit {LIMIT} (its safe share {LIMIT / 2:g}); first token {times[0] - sent:.1f} s "
        "after the requests"
    )
    assert "enforcing the configuration saved at" in b.log()
    # The control plane comes back: b resyncs from the version it holds.
    stack.control_plane = stack.start_control_plane()
    stack.control_plane.wait_applied(stack.control_plane.put(USER, LIMIT))


async def shares_now(client: httpx.AsyncClient, cp: ControlPlane) -> dict[str, float]:
    """engine id -> its share of USER (tokens/s), as GET /limits/{user} shows it."""
    response = await client.get(f"{cp.url}/limits/{USER}", headers=AUTH)
    return {s["engine_id"]: s["output_tokens_per_second"] for s in response.json()["shares"]}


async def enforced_now(client: httpx.AsyncClient, engine: VllmServer) -> float | None:
    """The limit the engine enforces for USER (tokens/s), as its /metrics shows it."""
    text = (await client.get(f"{engine.url}/metrics")).text
    for line in text.splitlines():
        if line.startswith(f"{ENFORCED_METRIC}{{") and f'user="{USER}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_an_engine_stopped_cleanly_hands_its_share_to_the_other_within_a_second(
    stack: FleetStack,
) -> None:
    a_engine, b_engine = stack.engines["fleet-a"], stack.engines["fleet-b"]
    cp = stack.control_plane

    async def main() -> tuple[float, float, list[StreamResult]]:
        async with httpx.AsyncClient(timeout=300) as client:
            on_a = asyncio.ensure_future(
                stream_completion(client, a_engine.url, user=USER, max_tokens=240)
            )
            on_b = asyncio.ensure_future(
                stream_completion(client, b_engine.url, user=USER, max_tokens=240)
            )
            # One stream each: half the limit each, as the control plane shows it and as
            # each engine enforces it (an engine back from an outage keeps its outage share
            # until its first full table after the quiet start), for a while.
            halves = {"fleet-a": LIMIT / 2, "fleet-b": LIMIT / 2}
            deadline = time.monotonic() + 30
            while (
                await shares_now(client, cp) != halves
                or await enforced_now(client, a_engine) != LIMIT / 2
                or await enforced_now(client, b_engine) != LIMIT / 2
            ):
                assert time.monotonic() < deadline, await shares_now(client, cp)
                await asyncio.sleep(0.1)
            await asyncio.sleep(2.0)
            stopped_at = time.monotonic()
            os.killpg(b_engine.popen.pid, signal.SIGTERM)  # a rolling restart's stop
            while (shares := await shares_now(client, cp)) != {"fleet-a": LIMIT}:
                assert time.monotonic() - stopped_at < 10, shares
                await asyncio.sleep(0.02)
            full_at = time.monotonic()
            on_b.cancel()
            await asyncio.gather(on_b, return_exceptions=True)
            return stopped_at, full_at, [await on_a]

    stopped_at, full_at, on_a = run(main())
    b_engine.kill()  # reaped (it exited on the SIGTERM)
    took_s = full_at - stopped_at
    # The survivor holds the whole limit within a second of the SIGTERM (before: its
    # share stayed at L/2 until the stopped engine was gone, GONE_AFTER_S of silence).
    assert took_s < 1.0, took_s
    # And it gets it: its rate rises, against its own rate before in this test.
    sent = on_a[0].started
    before = rate_between(on_a, max(sent + 1.5, stopped_at - 2.0), stopped_at)
    end = max(token_times(on_a))
    assert end - full_at > 1.5, "the stream ended too soon to see the rise"
    after = rate_between(on_a, full_at + 0.5, end)
    print(
        f"SIGTERM -> survivor's full share {1000 * took_s:.0f} ms; its rate "
        f"{before:.1f} -> {after:.1f} tokens/s ({after / before:.2f}x)"
    )
    assert after > 1.4 * before, (before, after)
    assert tokens_between(on_a, full_at, end) <= fleet_bound(end - full_at)


def test_a_second_engine_with_a_live_id_is_refused_loudly_and_never_unlimited(
    stack: FleetStack,
) -> None:
    a = stack.engines["fleet-a"]
    cp = stack.control_plane
    # A second engine with a's id, whose state dir holds what it applied when it last
    # held the id (here: a's own file, as a pod that ran as fleet-a before would have).
    state_dir = stack.tmp / "clash-state"
    state_dir.mkdir(mode=0o700)
    a_file = StateFile(a.state_dir, "fleet-a", "engine")
    shutil.copy(a_file.path, state_dir / a_file.path.name)
    clash = stack.start_engine("fleet-a", state_dir=state_dir, log_name="clash")
    try:
        clash.wait_ready()
        results = streams({clash.url: 1}, max_tokens=40)[clash.url]
        assert results[0].completion_tokens == 40
        # Never unlimited: the saved limit holds (a fleet of one then: the whole limit).
        sent = results[0].started
        for i, t in enumerate(token_times(results)):
            assert i + 1 <= fleet_bound(t - sent), (i + 1, t - sent)
        # Logged as an error by both sides, counted, shown.
        assert "ERROR" in clash.log() and "refused engine id 'fleet-a'" in clash.log()
        assert "engine_id_in_use" in clash.log()
        assert clash.metric("vllm:output_rate_control_plane_refusals_total") >= 1
        rows = httpx.get(f"{cp.url}/engines", headers=AUTH, timeout=10).json()["items"]
        row = next(r for r in rows if r["engine_id"] == "fleet-a")
        assert row["refused_claims"] >= 1 and row["last_refused_claim_from"] == "127.0.0.1"
        assert row["connected"]  # a keeps its id
        assert "refused engine id 'fleet-a' (engine) to the connection from 127.0.0.1" in (cp.log())
    finally:
        clash.kill()


def test_data_parallel_ranks_join_the_fleet_each_as_an_engine(stack: FleetStack) -> None:
    # Last in the module: the ranks join the fleet the other tests measured.
    cp = stack.control_plane
    dp = VllmServer(
        stack.tmp / "dp.log",
        "--control-plane-endpoint",
        f"tcp://127.0.0.1:{stack.zmq_port}",
        "--output-rate-engine-id",
        "fleet-dp",
        "--data-parallel-size",
        "2",
    )
    try:
        dp.wait_ready()
        deadline = time.monotonic() + 60
        ranks: set[str] = set()
        while time.monotonic() < deadline and ranks != {"fleet-dp-dp0", "fleet-dp-dp1"}:
            items = httpx.get(f"{cp.url}/engines", headers=AUTH).json()["items"]
            ranks = {e["engine_id"] for e in items if e["connected"]} & {
                "fleet-dp-dp0",
                "fleet-dp-dp1",
            }
            time.sleep(0.5)
        assert ranks == {"fleet-dp-dp0", "fleet-dp-dp1"}
        # Streams of the user on the data-parallel server share its one fleet budget.
        results = streams({dp.url: 4}, max_tokens=40)[dp.url]
        assert all(r.completion_tokens == 40 for r in results)
        assert_within_fleet_bound(results)
    finally:
        dp.kill()
