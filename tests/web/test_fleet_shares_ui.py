"""Fleet shares in the console, in headless Chromium against a real `output-rate serve`:
two engines that are real push clients (ApplyingEngine: the push client with the engine
core's own thread applying what arrives) report their streams of each fleet-limited user,
as the scheduler does between steps, and the control plane splits each fleet limit
between them. The user page's shares table and the engines view's "Fleet users shared"
column show what it decided: engine ids and values, checked against the REST API. The two
engines say they run different vLLM releases (0.32.0 and 0.34.0): the engines view names
each one's and says the fleet runs two. A second engine claiming a live id is shown as a
clash, and an engine whose demand is flagged implausible is named in a notice.

SQLite only: the shares are the fleet coordinator's, the same on both databases."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq
from playwright.sync_api import Browser, expect

from harness.applying_engine import ApplyingEngine
from harness.control_plane import fresh_database
from harness.servers import ControlPlane, free_port
from output_rate_core import protocol as p
from tests.web.browser import sign_in, watched_page

HEADERS = ControlPlane.auth_headers()
expect.set_options(timeout=30_000)
WAIT_S = 30.0
SPLIT = "split-user"  # 40 tok/s over both engines: 3 streams on engine-a, 1 on engine-b
SOLO = "solo-user"  # 20 tok/s, streaming on engine-a only
STREAMS = {"engine-a": {SPLIT: 3, SOLO: 2}, "engine-b": {SPLIT: 1}}
# What the coordinator gives each engine, by its streams: 40 x 3/4, 40 x 1/4, all of 20.
SHARES = {SPLIT: {"engine-a": 30.0, "engine-b": 10.0}, SOLO: {"engine-a": 20.0}}
VLLM_RELEASES = {"engine-a": "0.32.0", "engine-b": "0.34.0"}


class StreamingEngine(ApplyingEngine):
    """After each apply, says how many streams of each fleet-limited user it serves."""

    def __init__(self, name: str, endpoint: str, streams: dict[str, int]) -> None:
        super().__init__(name, [endpoint], vllm_version=VLLM_RELEASES[name])
        self.streams = streams

    def after_apply(self, now: float) -> None:
        self.client.report_demand(dict(self.streams))


def api(served: ControlPlane, method: str, path: str, **kwargs: Any) -> httpx.Response:
    response = httpx.request(method, f"{served.url}{path}", headers=HEADERS, timeout=30, **kwargs)
    response.raise_for_status()
    return response


def shares_of(served: ControlPlane, user: str) -> dict[str, float]:
    """GET /limits/{user}'s shares: engine id -> tok/s."""
    shares = api(served, "GET", f"/limits/{user}").json()["shares"]
    return {s["engine_id"]: s["output_tokens_per_second"] for s in shares}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    tmp = tmp_path_factory.mktemp("shares-ui")
    with fresh_database("sqlite", tmp) as url:
        server = ControlPlane(tmp / "cp.log", url, free_port(), free_port())
        server.wait_ready()
        try:
            for user, rate in ((SPLIT, 40), (SOLO, 20)):
                api(server, "PUT", f"/limits/{user}", json={"output_tokens_per_second": rate})
            with (
                StreamingEngine("engine-a", server.zmq_endpoint, STREAMS["engine-a"]),
                StreamingEngine("engine-b", server.zmq_endpoint, STREAMS["engine-b"]),
            ):
                deadline = time.monotonic() + WAIT_S
                while any(shares_of(server, user) != want for user, want in SHARES.items()):
                    assert time.monotonic() < deadline, {u: shares_of(server, u) for u in SHARES}
                    time.sleep(0.1)
                yield server
        finally:
            server.kill()


def test_the_user_page_lists_the_share_each_engine_holds(
    browser: Browser, served: ControlPlane
) -> None:
    with watched_page(browser) as watched:
        page = watched.page
        for user, want in SHARES.items():
            sign_in(page, served, f"users/{user}")
            rows = page.locator("#user-shares-table tbody tr")
            expect(rows).to_have_count(len(want))
            shown = rows.evaluate_all(
                "rows => rows.map(r => [r.dataset.engine, ...[...r.cells].map(c => c.textContent)])"
            )
            assert sorted(shown) == sorted(
                [engine, engine, f"{rate:.1f} tok/s"] for engine, rate in want.items()
            )
            headers = page.locator("#user-shares-table th").all_text_contents()
            assert headers == ["Engine", "Share"]
            assert shares_of(served, user) == want  # still what the page was drawn from


def test_the_engines_view_counts_the_fleet_users_each_engine_shares_and_names_its_vllm(
    browser: Browser, served: ControlPlane
) -> None:
    with watched_page(browser) as watched:
        page = watched.page
        sign_in(page, served, "engines")
        expect(page.locator("#engines tbody tr")).to_have_count(2)
        shared = {
            engine: page.locator(
                f'#engines tr[data-engine="{engine}"] td[data-label="Fleet users shared"]'
            ).text_content()
            for engine in STREAMS
        }
        # engine-a holds a share of both users, engine-b of the split one only.
        assert shared == {"engine-a": "2", "engine-b": "1"}
        engines = api(served, "GET", "/engines").json()["items"]
        assert {e["engine_id"]: str(e["num_shared_users"]) for e in engines} == shared
        vllm = {
            engine: page.locator(
                f'#engines tr[data-engine="{engine}"] td[data-label="vLLM"]'
            ).text_content()
            for engine in STREAMS
        }
        assert vllm == VLLM_RELEASES == {e["engine_id"]: e["vllm_version"] for e in engines}
        expect(page.locator("#vllm-releases")).to_have_text(
            "The connected engines run 2 vLLM releases: 0.32.0 on 1 engine, 0.34.0 on 1 engine."
        )


def test_the_engines_view_warns_when_two_engines_share_an_id(
    browser: Browser, served: ControlPlane
) -> None:
    # A second engine says it is engine-a while engine-a is live: refused, and shown.
    context = zmq.Context()
    second = context.socket(zmq.DEALER)
    second.setsockopt(zmq.LINGER, 0)
    second.connect(served.zmq_endpoint)
    try:
        second.send(p.encode(p.Hello("engine-a", "tiny", 0)))
        assert second.poll(int(WAIT_S * 1000))
        refused = p.decode(second.recv())
        assert isinstance(refused, p.Refused) and refused.reason == "engine_id_in_use"
        engines = {e["engine_id"]: e for e in api(served, "GET", "/engines").json()["items"]}
        assert engines["engine-a"]["refused_claims"] == 1
        assert engines["engine-b"]["refused_claims"] == 0
        with watched_page(browser) as watched:
            page = watched.page
            sign_in(page, served, "engines")
            notice = page.locator("#engine-id-clash")
            expect(notice).to_contain_text("Two engines share an id (engine-a: 1 claim refused")
            expect(notice).to_contain_text("the last from 127.0.0.1")
            expect(notice).to_contain_text("--output-rate-engine-id")
            expect(page.locator("#engines tbody tr")).to_have_count(2)
    finally:
        second.close()
        context.term()


def test_the_engines_view_shows_an_engine_whose_demand_was_flagged_implausible(
    browser: Browser, served: ControlPlane
) -> None:
    # An engine that says it runs 8 streams at once claims a million of one user: cut to
    # its capacity, flagged, shown on its row of GET /engines and in the engines view.
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(served.zmq_endpoint)
    claim = "1000000 streams of one user (capacity 8)"
    try:
        rogue.send(p.encode(p.Hello("engine-rogue", "tiny", 0, capacity=8)))
        deadline = time.monotonic() + WAIT_S
        while True:
            rogue.send(p.encode(p.Demand("engine-rogue", True, {"rogue-user": 1_000_000})))
            while rogue.poll(0):  # its row is written once it acknowledged its snapshot
                frame = rogue.recv()
                if p.peek_type(frame) == p.SNAPSHOT:
                    snapshot = p.decode(frame)
                    assert isinstance(snapshot, p.Snapshot)
                    rogue.send(p.encode(p.Ack("engine-rogue", snapshot.version)))
            engines = {e["engine_id"]: e for e in api(served, "GET", "/engines").json()["items"]}
            if engines.get("engine-rogue", {}).get("implausible_demands"):
                break
            assert time.monotonic() < deadline, engines
            time.sleep(0.1)
        row = engines["engine-rogue"]
        assert row["last_implausible_demand"] == claim
        assert row["last_implausible_demand_at"] is not None
        assert engines["engine-a"]["implausible_demands"] == 0
        assert engines["engine-a"]["last_implausible_demand"] is None
        with watched_page(browser) as watched:
            page = watched.page
            sign_in(page, served, "engines")
            notice = page.locator("#implausible-demand")
            expect(notice).to_contain_text("Implausible demand (engine-rogue: ")
            expect(notice).to_contain_text(f"({claim})")
            expect(notice).to_contain_text("check that it is an engine you run")
        rogue.send(p.encode(p.Leaving("engine-rogue")))
    finally:
        rogue.close()
        context.term()
