from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, sync_playwright

from scripts import build_ui
from tests.web.browser import CHROMIUM, CHROMIUM_ARGS


@pytest.fixture(scope="session", autouse=True)
def built_ui() -> None:
    """The server serves control_plane/ui/: rebuild it, so the tests see web/ as it is now."""
    build_ui.build()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()
