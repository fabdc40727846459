"""Borrowing in the console: the overview's live table shows each user's tokens/s within
its limit and borrowed beyond it side by side, with the ceiling beside the limit, and the
fleet's borrowed tok/s; the user's page says what it borrowed in the last hour beside its
ceiling. Headless Chromium against a real `output-rate serve` and an engine reporting
borrowed tokens over the real push endpoint."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Browser, expect

from harness.servers import ControlPlane
from tests.web.browser import DESKTOP, served_on_sqlite, shot, sign_in, watched_page
from tests.web.fleet import live_engine

expect.set_options(timeout=30_000)
# lender: 20 tok/s, may borrow up to 60, reported at 60 tok/s of which 40 borrowed;
# hard: 20 tok/s and no ceiling.
LIMITS = {
    "lender": {"output_tokens_per_second": 20, "ceiling_output_tokens_per_second": 60},
    "hard": {"output_tokens_per_second": 20},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with served_on_sqlite(tmp_path_factory.mktemp("borrowing-ui")) as server:
        for user, body in LIMITS.items():
            httpx.put(
                f"{server.url}/limits/{user}", json=body, headers=ControlPlane.auth_headers()
            ).raise_for_status()
        yield server


def test_live_usage_shows_borrowed_beside_within_limit_and_the_ceiling(
    browser: Browser, served: ControlPlane
) -> None:
    users = {"lender": 60, "hard": 20}
    with (
        live_engine(served, "e1", users, borrowed={"lender": 40}),
        watched_page(browser, DESKTOP) as watched,
    ):
        page = watched.page
        sign_in(page, served, view="overview")
        lender = page.locator('#live-usage tr[data-user="lender"]')
        hard = page.locator('#live-usage tr[data-user="hard"]')
        expect(lender.locator("td.borrowed")).to_have_text("40.0")
        expect(lender.locator("td.within-limit")).to_have_text("20.0")
        expect(lender.locator("td").nth(3)).to_have_text("20 tok/s, ceiling 60 tok/s")
        expect(hard.locator("td.borrowed")).to_have_text("\u2013")  # an en dash: none
        expect(hard.locator("td.within-limit")).to_have_text("20.0")
        expect(hard.locator("td").nth(3)).to_have_text("20 tok/s")
        headers = page.locator("#live-usage th").all_inner_texts()
        assert headers[1:3] == ["Within limit tok/s (10 s)", "Borrowed tok/s (10 s)"]
        expect(page.locator("#fleet-borrowed")).to_contain_text("40 tok/s of it borrowed")
        shot(page, "overview-borrowing")
        # The history is written every 5 s: the user's page says what it borrowed.
        ceiling = page.locator("#user-ceiling-effective")
        deadline = time.monotonic() + 30
        while True:
            page.goto(f"{served.url}/ui/#/users/lender")
            expect(page.locator('#view[data-ready="users/lender"]')).to_have_count(1)
            if "Borrowed" in ceiling.inner_text():
                break
            assert time.monotonic() < deadline, ceiling.inner_text()
            page.reload()
            time.sleep(1.0)
        text = ceiling.inner_text()
        assert text.startswith("up to 60 tok/s when no other user needs the capacity")
        # Two thirds of what it received was borrowed.
        said = re.search(r"Borrowed (\S+) of its (\S+) tokens in the last hour", text)
        assert said is not None, text
        borrowed, tokens = (int(re.sub(r"\D", "", n)) for n in said.groups())
        assert borrowed > 0 and borrowed * 3 == tokens * 2
