"""Long unbroken names (a 256-character user id, the longest there is) never widen the
page: cut with an ellipsis in tables, the whole id in the link's title and shown wrapped
on keyboard focus; wrapped on the user's own page. Headless Chromium at desktop and phone
width against a real `output-rate serve` (its users view, audit log, overview with a live
engine reporting the user, the user's page)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from harness.control_plane import fresh_database
from harness.servers import ControlPlane, free_port
from output_rate_core.ids import MAX_USER_ID_LEN
from tests.web.browser import DESKTOP, PHONE, sign_in, watched_page
from tests.web.fleet import live_engine

expect.set_options(timeout=30_000)
LONG = "L" + "o" * (MAX_USER_ID_LEN - 2) + "g"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    tmp = tmp_path_factory.mktemp("long-names-ui")
    with fresh_database("sqlite", tmp) as url:
        server = ControlPlane(tmp / "cp.log", url, free_port(), free_port())
        server.wait_ready()
        try:
            for user in (LONG, "short"):
                httpx.put(
                    f"{server.url}/limits/{user}",
                    json={"output_tokens_per_second": 40},
                    headers=ControlPlane.auth_headers(),
                ).raise_for_status()
            yield server
        finally:
            server.kill()


def fits(page: Page, width: int) -> None:
    assert page.evaluate("document.documentElement.scrollWidth") <= width


def open_view(page: Page, served: ControlPlane, view: str) -> None:
    page.goto(f"{served.url}/ui/#/{view}")
    expect(page.locator(f'#view[data-ready="{view}"]')).to_have_count(1)


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_a_long_user_id_never_widens_the_page(
    browser: Browser, served: ControlPlane, viewport: dict[str, int]
) -> None:
    width = viewport["width"]
    with live_engine(served, "e1", {LONG: 30}), watched_page(browser, viewport) as watched:
        page = watched.page
        sign_in(page, served, view="users")
        name = page.locator(f'#users tr[data-user="{LONG}"] a.user-name')
        expect(name).to_have_attribute("title", LONG)
        fits(page, width)
        cut = name.bounding_box()
        assert cut is not None and cut["x"] + cut["width"] <= width
        # On keyboard focus the whole id shows, wrapped within the page.
        page.locator("#user-search").focus()
        for _ in range(40):
            page.keyboard.press("Tab")
            if name.evaluate("a => a === document.activeElement"):
                break
        whole = name.bounding_box()
        assert whole is not None and whole["height"] > 2 * cut["height"], (cut, whole)
        assert whole["x"] + whole["width"] <= width
        fits(page, width)

        open_view(page, served, f"users/{LONG}")
        expect(page.locator(".view-title")).to_contain_text(LONG)
        fits(page, width)
        open_view(page, served, "audit")
        expect(page.locator(f'#view a.user-name[title="{LONG}"]').first).to_be_visible()
        fits(page, width)
        open_view(page, served, "overview")
        expect(page.locator(f'#live-usage a.user-name[title="{LONG}"]')).to_be_visible()
        fits(page, width)
