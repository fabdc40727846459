"""Headless Chromium (Debian's) driven by Playwright, with the checks every UI test makes:
no console errors, and no request to anything but 127.0.0.1."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from playwright.sync_api import Browser, ConsoleMessage, Page, expect

from harness.control_plane import fresh_database
from harness.servers import ControlPlane, free_port

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


@dataclass
class Watched:
    page: Page
    console_errors: list[str] = field(default_factory=list)
    foreign_requests: list[str] = field(default_factory=list)


@contextmanager
def watched_page(
    browser: Browser,
    viewport: dict[str, int] = DESKTOP,
    *,
    refusals: tuple[int, ...] = (),
    outage: bool = False,
) -> Iterator[Watched]:
    """`refusals`: HTTP statuses the test makes the server answer; Chromium logs each as a
    console error ("Failed to load resource"), which is then not counted. `outage`: the
    test stops the server under the page, so requests the page sends meanwhile fail
    (logged the same way, and not counted either)."""
    expected = tuple(f"the server responded with a status of {status} " for status in refusals)
    if outage:
        expected += ("net::ERR_CONNECTION_REFUSED",)
    context = browser.new_context(viewport=viewport)  # type: ignore[arg-type]
    page = context.new_page()
    watched = Watched(page)

    def on_request(request: object) -> None:
        url = request.url  # type: ignore[attr-defined]
        parts = urlsplit(url)
        if parts.scheme not in ("data", "blob") and parts.hostname != "127.0.0.1":
            watched.foreign_requests.append(url)

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error" and not any(e in message.text for e in expected):
            watched.console_errors.append(message.text)

    page.on("console", on_console)
    page.on("pageerror", lambda e: watched.console_errors.append(f"page error: {e}"))
    page.on("request", on_request)
    try:
        yield watched
    finally:
        context.close()
    assert watched.console_errors == [], watched.console_errors
    assert watched.foreign_requests == [], watched.foreign_requests


def sign_in(page: Page, served: ControlPlane, view: str = "overview") -> None:
    """Open `view` with the admin token and wait until the view says it is drawn."""
    page.goto(f"{served.url}/ui/#/{view}")
    page.fill("#token", ControlPlane.TOKEN)
    page.get_by_role("button", name="Use token").click()
    expect(page.locator("#role")).to_be_visible()
    expect(page.locator(f'#view[data-ready="{view}"]')).to_have_count(1)


def shot(page: Page, name: str) -> None:
    """A screenshot of the page as `name`.png in OUTPUT_RATE_UI_SCREENSHOTS (docs/screenshots
    when regenerating the docs' pictures); none when it is not set."""
    out = os.environ.get("OUTPUT_RATE_UI_SCREENSHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(out) / f"{name}.png"))


@contextmanager
def served_on_sqlite(tmp: Path) -> Iterator[ControlPlane]:
    """A control plane of its own on a fresh SQLite database in ``tmp``, killed after."""
    with fresh_database("sqlite", tmp) as url:
        server = ControlPlane(tmp / "cp.log", url, free_port(), free_port())
        server.wait_ready()
        try:
            yield server
        finally:
            server.kill()
