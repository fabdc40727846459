"""The audit view names every field a change changed, in real headless Chromium against
a real `output-rate serve` (SQLite): a scope-only or an enforcement-only change never
reads "Before" equal to "After", for a user, a tier, the default and a bulk change."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, expect

from harness.servers import ControlPlane
from tests.web.browser import DESKTOP, PHONE, served_on_sqlite, sign_in, watched_page

HEADERS = ControlPlane.auth_headers()
expect.set_options(timeout=20_000)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with served_on_sqlite(tmp_path_factory.mktemp("audit-ui")) as server:
        yield server


def api(served: ControlPlane, method: str, path: str, **kwargs: Any) -> None:
    httpx.request(
        method, f"{served.url}{path}", headers=HEADERS, timeout=30, **kwargs
    ).raise_for_status()


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_scope_and_enforcement_changes_read_as_changes(
    browser: Browser, served: ControlPlane, viewport: dict[str, int]
) -> None:
    name = "d" if viewport is DESKTOP else "p"
    tier, user = f"pro-{name}", f"ann-{name}"
    api(served, "PUT", f"/tiers/{tier}", json={"output_tokens_per_second": 100})
    api(served, "PATCH", f"/tiers/{tier}", json={"scope": "engine"})
    api(served, "PUT", f"/limits/{user}", json={"tier": tier, "enforcement": "shadow"})
    api(served, "PATCH", f"/limits/{user}", json={"enforcement": None})
    api(served, "POST", "/limits:bulk", json={"items": [{"user": user, "scope": "fleet"}]})
    # The default: a first change (desktop), then a scope-only one (phone).
    scope = "engine" if viewport is DESKTOP else "fleet"
    api(served, "PUT", "/default-limit", json={"output_tokens_per_second": 5, "scope": scope})
    with watched_page(browser, viewport) as w:
        page = w.page
        sign_in(page, served, "audit")
        rows = page.locator("#audit > tbody > tr")
        expect(rows.first).to_contain_text("put default")

        def sides(row_text: str) -> list[str]:
            row = rows.filter(has_text=row_text).first
            return [row.locator("td").nth(i).inner_text() for i in (4, 5)]

        assert sides("put default") == (
            ["rate unlimited, scope fleet (not set)", "rate 5 tok/s, scope engine"]
            if viewport is DESKTOP
            else ["rate 5 tok/s, scope engine", "rate 5 tok/s, scope fleet"]
        )
        assert sides("patch tier") == [
            "rate 100 tok/s, scope inherited, no description",
            "rate 100 tok/s, scope engine, no description",
        ]
        assert sides("patch limit") == [
            f"tier {tier}, no override, enforcement shadow",
            f"tier {tier}, no override, enforcement inherited",
        ]
    # A user's page lists the bulk change with what it did to the user.
    with watched_page(browser, viewport) as w:
        sign_in(w.page, served, f"users/{user}")
        bulk = w.page.locator("#audit > tbody > tr").filter(has_text="bulk put limits").first
        assert [bulk.locator("td").nth(i).inner_text() for i in (4, 5)] == [
            f"tier {tier}, no override, scope inherited",
            "no tier, no override, scope fleet",
        ]
