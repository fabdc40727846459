"""Errors in an operator's words: a bulk import's bad lines say the field and its rule
(never a pattern or the validator's wording), many bad lines get one summary line with
their numbers first, and a paste holding only a header says there is nothing to import.
Headless Chromium at desktop and phone width against a real `output-rate serve`; the
words come from the server's 422 (control_plane/errors.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Browser, expect

from harness.servers import ControlPlane
from tests.web.browser import DESKTOP, PHONE, served_on_sqlite, shot, sign_in, watched_page

expect.set_options(timeout=30_000)
NUM_BAD = 30


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with served_on_sqlite(tmp_path_factory.mktemp("errors-ui")) as server:
        yield server


def bad_lines() -> tuple[str, list[int]]:
    """A header, then good lines with NUM_BAD bad ones among them (every third line
    from line 3: a '/' in the id, a rate of 0, or a rate that is no number)."""
    lines = ["user,tier,override"]
    bad: list[int] = []
    for i in range(2 * NUM_BAD):
        number = len(lines) + 1
        if i % 2 == 0:
            kind = len(bad) % 3
            lines.append(["a/b,,5", f"zero-{i},,0", f"text-{i},,fast"][kind])
            bad.append(number)
        else:
            lines.append(f"good-{i},,5")
    return "\n".join(lines), bad


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_bad_lines_are_said_in_words_with_a_summary(
    browser: Browser, served: ControlPlane, viewport: dict[str, int]
) -> None:
    text, bad = bad_lines()
    with watched_page(browser, viewport, refusals=(422,)) as watched:
        page = watched.page
        sign_in(page, served, view="users")
        page.fill("#bulk-text", text)
        page.get_by_role("button", name="Preview and import").click()
        error = page.locator("#bulk-form .field-error")
        expect(error).to_be_visible()
        said = error.inner_text().split("\n")
        shown = ", ".join(str(n) for n in bad[:12])
        assert said[0] == f"{NUM_BAD} lines have errors: {shown}, …", said[0]
        assert (
            said[1] == f"Line {bad[0]}: User id may not contain '/', control characters or "
            "U+FFFD, nor be '.' or '..'"
        ), said[1]
        assert said[2] == f"Line {bad[1]}: Rate must be at least 1", said[2]
        assert said[3] == f"Line {bad[2]}: Rate 'fast' is not a whole number", said[3]
        assert len(said) == 1 + NUM_BAD
        for words in ("should", "pattern", "^", "\\x"):
            assert words not in error.inner_text()
        assert page.evaluate("document.documentElement.scrollWidth") <= viewport["width"]
        error.scroll_into_view_if_needed()
        shot(page, "bulk-errors" + ("-phone" if viewport is PHONE else ""))
        # Nothing was written.
        listed = httpx.get(
            f"{served.url}/limits", params={"q": "good"}, headers=ControlPlane.auth_headers()
        ).json()
        assert listed["total"] == 0

        # A header only: nothing to import, no "Import 0 users?".
        page.fill("#bulk-text", "user,tier,override,scope,enforcement\n")
        page.get_by_role("button", name="Preview and import").click()
        expect(error).to_have_text("Nothing to import: the lines hold no user (only a header?).")
        expect(page.locator("#confirm")).to_be_hidden()
