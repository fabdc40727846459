"""The console says when it cannot be trusted, in real headless Chromium against a real
`output-rate serve` (SQLite) and live protocol peers (tests/web/fleet.py):

- the control plane killed under an open page: every panel goes stale (greyed, "Last
  updated N s ago"), a banner says since when, the overview's headline says the state is
  unknown instead of green; a view opened during the outage says so and retries; once a
  new server answers on the same port and database, both recover without a reload;
- a disconnected engine turns the headline red and a lagging one amber, with the count.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, expect

from harness.control_plane import fresh_database
from harness.servers import ControlPlane, free_port
from tests.web.browser import DESKTOP, PHONE, shot, sign_in, watched_page
from tests.web.fleet import live_engine

HEADERS = ControlPlane.auth_headers()
expect.set_options(timeout=20_000)


class Restartable:
    """A control plane that the test kills and starts again on the same ports and database."""

    def __init__(self, tmp: Path, url: str) -> None:
        self.tmp, self.url = tmp, url
        self.port, self.zmq_port = free_port(), free_port()
        self.starts = 0
        self.server = self.start()

    def start(self) -> ControlPlane:
        self.starts += 1
        log = self.tmp / f"cp-{self.starts}.log"
        self.server = ControlPlane(log, self.url, self.port, self.zmq_port)
        self.server.wait_ready()
        return self.server


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[Restartable]:
    with fresh_database("sqlite", tmp_path) as url:
        plane = Restartable(tmp_path, url)
        try:
            put = httpx.put(
                f"{plane.server.url}/tiers/basic",
                json={"output_tokens_per_second": 50},
                headers=HEADERS,
            )
            put.raise_for_status()
            yield plane
        finally:
            plane.server.kill()


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_a_stopped_control_plane_goes_stale_and_recovers_without_a_reload(
    browser: Browser, restartable: Restartable, viewport: dict[str, int]
) -> None:
    name = "desktop" if viewport is DESKTOP else "phone"
    served = restartable.server
    with (
        live_engine(served, "engine-a", {"ann": 40}),
        watched_page(browser, viewport, outage=True) as w,
    ):
        page = w.page
        loads: list[str] = []
        page.on("load", lambda _: loads.append(page.url))
        sign_in(page, served, "overview")
        engines = page.locator("#engines-headline")
        expect(engines).to_have_attribute("data-state", "good")
        expect(engines).to_have_text(re.compile(r"^All 1 engine connected and on version \d+$"))
        num_cards = page.locator("#view section.card").count()
        assert num_cards >= 3
        expect(page.locator("#stale")).to_be_hidden()
        loads_before = len(loads)

        served.kill()
        stale = page.locator("#stale")
        expect(stale).to_be_visible()
        expect(stale).to_contain_text("Cannot reach the control plane")
        expect(stale).to_contain_text(re.compile(r"last updated \d+ s ago"))
        expect(page.locator("#view")).to_have_class(re.compile(r"\bunreachable\b"))
        # Every panel says how old it is, and the count goes up.
        notes = page.locator("#view section.card > .stale-note")
        expect(notes).to_have_count(num_cards)
        expect(notes.first).to_have_text(re.compile(r"^Last updated [1-9]\d* s ago$"))
        assert (
            page.locator("#view section.card").first.evaluate(
                "el => Number(getComputedStyle(el).opacity)"
            )
            < 1
        )
        expect(engines).to_have_attribute("data-state", "unreachable")
        expect(engines).to_contain_text("Control plane unreachable")
        expect(engines).not_to_have_class(re.compile(r"\bgood\b"))
        expect(page.locator("#version")).to_have_class(re.compile(r"\bunreachable\b"))
        shot(page, f"outage-overview{'' if name == 'desktop' else '-phone'}")

        # A view opened during the outage says it cannot be drawn, and keeps trying.
        page.goto(f"{served.url}/ui/#/tiers")
        expect(page.locator("#view-error")).to_contain_text("could not be reached")
        expect(page.locator("#view-retry")).to_be_visible()

        # The control plane is back: the view draws itself, without a reload.
        restartable.start()
        expect(page.locator('#view[data-ready="tiers"]')).to_have_count(1)
        expect(page.locator("#stale")).to_be_hidden()
        expect(page.locator("#view")).not_to_have_class(re.compile(r"\bunreachable\b"))
        expect(page.locator('tr[data-tier="basic"]')).to_have_count(1)
        page.goto(f"{served.url}/ui/#/overview")
        expect(engines).to_have_attribute("data-state", "good")
        expect(page.locator("#view section.card > .stale-note")).to_have_count(0)
        assert len(loads) == loads_before, loads


def test_a_dead_or_lagging_engine_turns_the_headline_red_or_amber(
    browser: Browser, restartable: Restartable
) -> None:
    served = restartable.server
    with watched_page(browser) as w:
        page = w.page
        with live_engine(served, "engine-a", {"ann": 40}):
            sign_in(page, served, "overview")
            engines = page.locator("#engines-headline")
            expect(engines).to_have_attribute("data-state", "good")
            with live_engine(served, "engine-b", {"bob": 40}, applies_deltas=False):
                expect(engines).to_have_text(
                    re.compile(r"^All 2 engines connected and on version \d+$")
                )
                httpx.put(
                    f"{served.url}/limits/ann",
                    json={"output_tokens_per_second": 7},
                    headers=HEADERS,
                ).raise_for_status()
                expect(engines).to_have_attribute("data-state", "warn")
                expect(engines).to_have_text(
                    re.compile(r"^1 engine not yet on version \d+ \(of 2\)$")
                )
                expect(engines).to_have_class(re.compile(r"\bwarn\b"))
                shot(page, "engines-lagging")
            # engine-b stopped: disconnected once the control plane misses its heartbeats.
            expect(engines).to_have_attribute("data-state", "bad")
            expect(engines).to_have_text("1 engine of 2 disconnected")
            expect(engines).to_have_class(re.compile(r"\bbad\b"))
