"""The admin UI runs under its Content-Security-Policy in real headless Chromium: no
violation, the chart library loads, and the UI refuses to be framed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import sync_playwright

from harness.servers import ControlPlane, free_port
from tests.web.browser import CHROMIUM, CHROMIUM_ARGS
from tests.web.test_admin_ui import TOKEN


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    tmp = tmp_path_factory.mktemp("csp")
    server = ControlPlane(tmp / "cp.log", f"sqlite:///{tmp / 'ui.db'}", free_port(), free_port())
    server.wait_ready()
    yield server
    server.kill()


def test_ui_works_under_its_csp_and_cannot_be_framed(served: ControlPlane) -> None:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page()
            messages: list[str] = []
            page.on("console", lambda m: messages.append(m.text))
            response = page.goto(f"{served.url}/ui/")
            assert response is not None
            assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
            page.fill("#token", TOKEN)
            page.click("#token-form button")
            page.wait_for_timeout(2000)
            assert page.evaluate("typeof uPlot") == "function"
            assert not [m for m in messages if "Content Security Policy" in m], messages
            # A page of another origin cannot frame the UI (the token is in localStorage).
            framer = browser.new_page()
            framer.set_content(f'<iframe id="f" src="{served.url}/ui/"></iframe>')
            framer.wait_for_timeout(2000)
            frame = framer.frame_locator("#f")
            assert frame.locator("#token").count() == 0
        finally:
            browser.close()
