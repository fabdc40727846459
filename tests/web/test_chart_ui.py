"""The share-of-limit chart, the fleet total, the phone tables and forms kept across a
refresh, in headless Chromium against a real `output-rate serve` with 5,000 users.

History is written through the real recorder (UsageRecorder.add with real Usage
reports) with a fake clock: the one seam, standing for the control plane's clock so that
reports can be placed minutes in the past around a real limit change made through the
API. Drawn values are read from the chart's table view and legend (the DOM), not pixels.
SQLite only: the history queries are covered on both databases in
tests/control_plane/usage/."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from harness.servers import ControlPlane
from output_rate_core import protocol as p
from tests.web.browser import DESKTOP, PHONE, served_on_sqlite, sign_in, watched_page
from tests.web.fleet import Backdated, live_engine, seed

HEADERS = ControlPlane.auth_headers()
expect.set_options(timeout=30_000)
# Six users held at 94-98 % of 100 tok/s and one at 100 %: lines that overlap.
CLOSE_USERS = {f"close-{i}": 94 + (i % 5) for i in range(6)}
HELD = "held-change"  # held at 100, then at 45 from mid-minute
SHADOW = "shadow-user"  # a shadow limit of 20 tok/s while it streams at 30
MINUTES = 20
# A held user reads at most 100 % plus the GCRA burst (0.1 s x N + 1 token) over a minute.
BURST_PCT = 100 * (0.1 * 45 + 1) / (60 * 45)


def api(served: ControlPlane, method: str, path: str, **kwargs: Any) -> httpx.Response:
    response = httpx.request(method, f"{served.url}{path}", headers=HEADERS, timeout=60, **kwargs)
    response.raise_for_status()
    return response


def write_reports(served: ControlPlane) -> None:
    """Per second for the last MINUTES minutes (through the current one): every user at
    its rate, throttled as a held user is; the limit of HELD changes in the middle of the
    minute that began 10 minutes ago."""
    history = Backdated(served.db_url, minutes=MINUTES)
    change_at = (int(history.now) // 60 - 10) * 60 + 30
    limit = 100
    for now in history.seconds():
        if limit == 100 and now >= change_at:
            api(served, "PATCH", f"/limits/{HELD}", json={"output_tokens_per_second": 45})
            history.recorder.refresh_limits()
            limit = 45
        granted = {user: rate for user, rate in CLOSE_USERS.items()}
        granted[HELD] = limit
        granted[SHADOW] = 30
        throttled = {user: 40 for user in (*CLOSE_USERS, HELD)}
        history.recorder.add(p.Usage("e1", 1.0, granted, throttled, would_throttle={SHADOW: 12}))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with served_on_sqlite(tmp_path_factory.mktemp("chart-ui")) as server:
        seed(server)  # 4 tiers, 5,000 users
        for user in CLOSE_USERS:
            api(server, "PUT", f"/limits/{user}", json={"tier": "pro"})  # 100 tok/s
        api(server, "PUT", f"/limits/{HELD}", json={"output_tokens_per_second": 100})
        api(
            server,
            "PUT",
            f"/limits/{SHADOW}",
            json={"output_tokens_per_second": 20, "enforcement": "shadow"},
        )
        write_reports(server)
        yield server


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the screenshots go (printed): OUTPUT_RATE_UI_SCREENSHOTS, else a temp dir."""
    env = os.environ.get("OUTPUT_RATE_UI_SCREENSHOTS")
    out = Path(env) if env else tmp_path_factory.mktemp("chart-shots")
    out.mkdir(parents=True, exist_ok=True)
    print(f"\nchart screenshots: {out}")
    return out


def shares(page: Page, user: str) -> list[float]:
    """The drawn share-of-limit values of `user`, from the chart's table view."""
    cells = page.locator(f'#chart-values td[data-user="{user}"]')
    return [
        float(s)
        for s in cells.evaluate_all("tds => tds.map(td => td.dataset.share)")
        if s != "null"
    ]


def test_around_a_limit_change_a_held_user_never_reads_above_its_limit(
    browser: Browser, served: ControlPlane, shots: Path
) -> None:
    with watched_page(browser, DESKTOP) as watched:
        page = watched.page
        sign_in(page, served)
        expect(page.locator("#chart-legend tbody tr")).to_have_count(8)
        page.locator(".chart-values summary").click()
        expect(page.locator("#chart-values tbody tr").first).to_be_visible()
        held = shares(page, HELD)
        assert len(held) >= MINUTES - 1
        assert max(held) <= 100 + BURST_PCT, held
        assert min(held) >= 99, held  # at the limit throughout, also across the change
        # Divided by the new limit, the minute of the change would read far above 100 %.
        body = api(served, "GET", "/usage/history", params={"user": HELD}).json()
        item = body["items"][0]
        naive = [
            r / 45
            for r, lim in zip(item["output_tokens_per_second"], item["limit"], strict=True)
            if r is not None and lim is not None and 45 < lim < 100
        ]
        assert naive and max(naive) > 1.2
        # Seven lines at 94-100 % and the shadow one: each told apart by colour and dash,
        # its latest value and limit written in the legend, without hovering.
        legend = page.locator("#chart-legend tbody tr").evaluate_all(
            """rows => rows.map(r => ({
                user: r.dataset.user, shadow: r.dataset.shadow,
                key: r.querySelector('.swatch').style.background + '|' +
                     (r.querySelector('line').getAttribute('stroke-dasharray') || ''),
                latest: r.querySelector('td.latest').textContent,
                would: r.querySelector('td.would').textContent }))"""
        )
        assert len({row["key"] for row in legend}) == 8
        assert all("%" in row["latest"] and "tok/s" in row["latest"] for row in legend)
        close = [row for row in legend if row["user"] in CLOSE_USERS]
        assert len(close) == len(CLOSE_USERS)
        # The shadow user is marked, with the share of request-steps it would throttle.
        (shadow,) = [row for row in legend if row["user"] == SHADOW]
        assert shadow["shadow"] == "true"
        assert shadow["would"] == "40.0%"  # 12 of its 30 request-steps
        expect(page.locator(f'#chart-legend tr[data-user="{SHADOW}"] .pill.shadow')).to_have_text(
            "shadow"
        )
        page.locator("#toast").evaluate("t => t.hidden = true")
        page.get_by_role("button", name="15 min").click()  # the change in the middle
        expect(page.locator(".chart")).to_have_attribute("data-points", "16")
        page.locator(".history").screenshot(path=str(shots / "chart-limit-change.png"))


def test_the_current_minute_is_no_dip_and_the_fleet_total_shows(
    browser: Browser, served: ControlPlane
) -> None:
    with watched_page(browser, DESKTOP) as watched:
        page = watched.page
        sign_in(page, served)
        page.locator(".chart-values summary").click()
        expect(page.locator("#chart-values tbody tr").first).to_be_visible()
        for user, rate in CLOSE_USERS.items():
            values = shares(page, user)
            # Every minute, the current partial one included, at the user's steady rate.
            assert values and all(abs(v - rate) <= 0.5 for v in values), (user, values)
        expect(page.locator(".fleet-chart canvas")).to_have_count(1)
        fleet_rate = sum(CLOSE_USERS.values()) + 45 + 30
        expect(page.locator("#fleet-history-latest")).to_contain_text(f"{fleet_rate:.1f} tok/s")
        fleet = page.locator("#chart-values td[data-fleet]").evaluate_all(
            "tds => tds.map(td => Number(td.dataset.fleet))"
        )
        assert fleet and all(abs(v - fleet_rate) <= 1 or v > fleet_rate for v in fleet[-10:])


def test_the_seven_day_range(browser: Browser, served: ControlPlane) -> None:
    with watched_page(browser, DESKTOP) as watched:
        page = watched.page
        sign_in(page, served)
        page.get_by_role("button", name="7 days").click()
        # 7 days of 10-minute buckets, through the current one.
        expect(page.locator(".chart")).to_have_attribute("data-points", "1009")
        expect(page.locator("#chart-legend tbody tr")).to_have_count(8)
        expect(page.locator(".fleet-chart canvas")).to_have_count(1)
        page.goto(f"{served.url}/ui/#/users/{HELD}?range=7d")
        expect(page.locator(f'#view[data-ready="users/{HELD}"]')).to_have_count(1)
        expect(page.locator(".chart")).to_have_attribute("data-points", "1009")
        expect(page.locator("#chart-latest")).to_contain_text("of the limit in force")


def on_screen(page: Page, selector: str, width: int) -> int:
    cells = page.locator(selector)
    count = cells.count()
    for box in [cells.nth(i).bounding_box() for i in range(count)]:
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width, box
    return count


def test_phone_tables_keep_every_column_on_screen(
    browser: Browser, served: ControlPlane, shots: Path
) -> None:
    width = PHONE["width"]
    live = {f"a-rather-long-user-id-{i:03d}": 40 + i for i in range(12)}
    with live_engine(served, "phone-engine", live), watched_page(browser, PHONE) as watched:
        page = watched.page
        sign_in(page, served, view="users")
        expect(page.locator("#users tbody tr").first).to_be_visible()
        assert page.evaluate("document.documentElement.scrollWidth") <= width
        first = page.locator("#users tbody tr").first.locator("td")
        assert first.count() == 6  # User, Tier, Override, Effective, From, Scope
        assert on_screen(page, "#users tbody tr:nth-child(-n+5) td", width) == 30
        labels = first.evaluate_all(
            "tds => tds.map(td => getComputedStyle(td, '::before').content)"
        )
        assert labels == ['"User"', '"Tier"', '"Override"', '"Effective"', '"From"', '"Scope"']
        page.locator("#toast").evaluate("t => t.hidden = true")
        page.screenshot(path=str(shots / "chart-phone-users.png"))
        page.goto(f"{served.url}/ui/#/overview")
        expect(page.locator("#live-usage tbody tr")).to_have_count(10)
        # Every column, Borrowed, Throttled and Would throttle too.
        assert on_screen(page, "#live-usage td", width) == 60
        assert on_screen(page, "#chart-legend td:not(:empty)", width) > 0
        assert page.evaluate("document.documentElement.scrollWidth") <= width


def test_a_form_keeps_typed_input_across_a_refresh(browser: Browser, served: ControlPlane) -> None:
    with watched_page(browser, DESKTOP) as watched:
        page = watched.page
        sign_in(page, served, view=f"users/{HELD}")
        page.locator("#user-override-rate").fill("77")
        # Someone else creates a tier: the tier list in the form changed.
        api(served, "PUT", "/tiers/made-meanwhile", json={"output_tokens_per_second": 9})
        notice = page.locator("#data-changed")
        expect(notice).to_be_visible()  # within one refresh (10 s on this page)
        expect(notice).to_contain_text("Data changed")
        expect(page.locator("#user-override-rate")).to_have_value("77")
        assert page.locator("#user-tier option[value=made-meanwhile]").count() == 0
        page.locator("#data-changed-reload").click()
        expect(page.locator("#user-tier option[value=made-meanwhile]")).to_have_count(1)
        expect(page.locator("#user-override-rate")).to_have_value("45")
        expect(notice).to_be_hidden()
        # The tiers view (5 s): the half-typed default survives another's change of it,
        # while the rest of the view (the list of tiers) refreshes.
        page.goto(f"{served.url}/ui/#/tiers")
        expect(page.locator('#view[data-ready="tiers"]')).to_have_count(1)
        page.locator("#default-rate-rate").fill("123")
        api(served, "PUT", "/default-limit", json={"output_tokens_per_second": 6})
        api(served, "PUT", "/tiers/made-later", json={"output_tokens_per_second": 8})
        expect(notice).to_be_visible()
        expect(page.get_by_text("made-later", exact=True).first).to_be_visible()
        expect(page.locator("#default-rate-rate")).to_have_value("123")
        page.locator("#data-changed-reload").click()
        expect(page.locator("#default-rate-rate")).to_have_value("6")
        expect(notice).to_be_hidden()
        # With nothing typed, a refresh redraws as before: the new tier appears.
        api(served, "PUT", "/tiers/made-last", json={"output_tokens_per_second": 7})
        expect(page.get_by_text("made-last", exact=True).first).to_be_visible()
        expect(notice).to_be_hidden()
