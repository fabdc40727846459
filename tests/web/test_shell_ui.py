"""The console's smaller duties, in headless Chromium at desktop and phone width against
a real `output-rate serve`: signing out, forgetting a disconnected engine (confirmed
first; a connected one offers nothing), and focus after a save (on the redrawn form's
button, not lost to the page)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, expect

from harness.servers import ControlPlane
from tests.web.browser import DESKTOP, PHONE, served_on_sqlite, shot, sign_in, watched_page
from tests.web.fleet import live_engine

expect.set_options(timeout=30_000)


def api(served: ControlPlane, method: str, path: str, **kwargs: Any) -> httpx.Response:
    response = httpx.request(
        method, f"{served.url}{path}", headers=ControlPlane.auth_headers(), timeout=60, **kwargs
    )
    response.raise_for_status()
    return response


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with served_on_sqlite(tmp_path_factory.mktemp("shell-ui")) as server:
        yield server


def engine_ids(served: ControlPlane) -> set[str]:
    return {e["engine_id"] for e in api(served, "GET", "/engines").json()["items"]}


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_sign_out_forget_an_engine_and_focus_after_save(
    browser: Browser, served: ControlPlane, viewport: dict[str, int]
) -> None:
    name = "desktop" if viewport is DESKTOP else "phone"
    gone, live, user = f"gone-{name}", f"live-{name}", f"saver-{name}"
    with live_engine(served, gone, {}):
        pass  # connected once, now disconnected
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = {e["engine_id"]: e for e in api(served, "GET", "/engines").json()["items"]}
        if gone in rows and not rows[gone]["connected"]:
            break
        time.sleep(0.2)
    api(served, "PUT", f"/limits/{user}", json={"output_tokens_per_second": 40})
    with live_engine(served, live, {}), watched_page(browser, viewport) as watched:
        page = watched.page
        sign_in(page, served, view="engines")
        expect(page.locator(f'#engines tr[data-engine="{gone}"]')).to_contain_text("no")
        forget = page.get_by_role("button", name=f"Forget engine {gone}")
        # A connected engine has no such action: it would come back at its next heartbeat.
        expect(page.get_by_role("button", name=f"Forget engine {live}")).to_have_count(0)
        # Cancelled: nothing forgotten.
        forget.click()
        dialog = page.locator("#confirm")
        expect(dialog.locator("#confirm-title")).to_have_text(f"Forget engine {gone}?")
        dialog.get_by_role("button", name="Cancel").click()
        assert gone in engine_ids(served)
        forget.click()
        shot(page, f"forget-engine-{name}")
        dialog.get_by_role("button", name="Forget engine").click()
        expect(page.locator(f'#engines tr[data-engine="{gone}"]')).to_have_count(0)
        assert gone not in engine_ids(served) and live in engine_ids(served)

        # Focus after a save: on the redrawn form's button.
        page.goto(f"{served.url}/ui/#/users/{user}")
        expect(page.locator(f'#view[data-ready="users/{user}"]')).to_have_count(1)
        page.fill("#user-override-rate", "90")  # up: no one held back, no confirmation
        page.locator("#user-override-rate").press("Enter")
        expect(page.locator("#user-override-rate")).to_have_value("90")
        expect(page.locator("#toast")).to_contain_text("90")
        focused = page.evaluate(
            "() => [document.activeElement.tagName, document.activeElement.textContent,"
            " document.activeElement.closest('form')?.id]"
        )
        assert focused == ["BUTTON", f"Save user {user}", "user-form"], focused

        # Sign out: the token is forgotten, the views ask for one again.
        page.get_by_role("button", name="Sign out").click()
        expect(page.locator("#view .view-title")).to_have_text("Sign in")
        expect(page.locator("#role")).to_be_hidden()
        expect(page.get_by_role("button", name="Sign out")).to_be_hidden()
        assert page.evaluate("localStorage.getItem('output-rate-token')") is None
        expect(page.locator("#token")).to_have_value("")
        page.reload()
        expect(page.locator("#view .view-title")).to_have_text("Sign in")
