"""No lost updates in the console, in real headless Chromium against a real
`output-rate serve` (SQLite; the If-Match rule itself is tested on both databases in
tests/control_plane/limits/test_versioned_writes.py): every edit of a user, a tier and the
default carries the ETag its form was drawn from, so an operator saving over someone
else's newer change gets the conflict dialog (what changed: as opened, as saved since,
theirs) and nothing is overwritten; redo puts their changes back over the new values,
discard drops them.

Two browser contexts (two operators, two tabs) on one user at desktop and phone width;
the tier and the default are saved over by a REST client between drawing and saving.
Screenshots go to OUTPUT_RATE_UI_SCREENSHOTS (docs/screenshots) when it is set.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from harness.control_plane import fresh_database
from harness.servers import ControlPlane, free_port
from tests.web.browser import DESKTOP, PHONE, shot, sign_in, watched_page
from tests.web.fleet import seed

HEADERS = ControlPlane.auth_headers()
expect.set_options(timeout=20_000)
# A 412 is an answer the page expects (Chromium logs it as a failed resource).
REFUSALS = (412,)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    tmp = tmp_path_factory.mktemp("conflicts-ui")
    with fresh_database("sqlite", tmp) as url:
        server = ControlPlane(tmp / "cp.log", url, free_port(), free_port())
        server.wait_ready()
        try:
            seed(server, num_users=200, pro_users=40)
            yield server
        finally:
            server.kill()


def api(served: ControlPlane, method: str, path: str, **kwargs: Any) -> httpx.Response:
    response = httpx.request(method, f"{served.url}{path}", headers=HEADERS, timeout=30, **kwargs)
    response.raise_for_status()
    return response


def audit_ids(served: ControlPlane, target: str, kind: str = "user") -> list[int]:
    params = {"target": target, "target_kind": kind}
    return [e["id"] for e in api(served, "GET", "/audit", params=params).json()["items"]]


def type_override(page: Page, rate: int) -> None:
    page.check("#user-override-limited")
    page.fill("#user-override-rate", str(rate))


def conflict_row(page: Page, label: str) -> list[str]:
    row = page.locator(f'#conflict-table tr[data-field="{label}"]')
    return [row.locator(f"td.{c}").inner_text() for c in ("seen", "now", "mine")]


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_b_saving_over_a_gets_the_conflict_dialog_and_overwrites_nothing(
    browser: Browser, served: ControlPlane, viewport: dict[str, int]
) -> None:
    name = "desktop" if viewport is DESKTOP else "phone"
    user = f"shared-{name}"
    api(served, "PUT", f"/limits/{user}", json={"tier": "basic", "output_tokens_per_second": 40})
    view = f"users/{user}"
    with (
        watched_page(browser, viewport, refusals=REFUSALS) as a,
        watched_page(browser, viewport, refusals=REFUSALS) as b,
    ):
        sign_in(a.page, served, view)
        sign_in(b.page, served, view)
        # B starts typing 60 on the page that shows 40; then A saves 50.
        type_override(b.page, 60)
        type_override(a.page, 50)
        a.page.get_by_role("button", name=f"Save user {user}").click()
        expect(a.page.locator("#toast")).to_contain_text("override 40 tok/s → 50 tok/s")
        assert api(served, "GET", f"/limits/{user}").json()["output_tokens_per_second"] == 50
        entries = audit_ids(served, user)

        # B saves: refused, shown what changed, nothing written.
        b.page.get_by_role("button", name=f"Save user {user}").click()
        dialog = b.page.locator("#conflict")
        expect(dialog).to_be_visible()
        expect(dialog.locator("#conflict-title")).to_have_text(
            f"User {user} changed since you opened it"
        )
        assert conflict_row(b.page, "Own override") == ["40 tok/s", "50 tok/s", "60 tok/s"]
        assert conflict_row(b.page, "Limit in force")[:2] == [
            "40 tok/s (fleet, enforce)",
            "50 tok/s (fleet, enforce)",
        ]
        expect(b.page.locator("#conflict-unchanged")).to_have_text(
            "Unchanged: tier, scope, enforcement, borrowing ceiling."
        )
        expect(
            b.page.locator('#conflict-table tr.theirs[data-field="Own override"]')
        ).to_have_count(1)
        assert api(served, "GET", f"/limits/{user}").json()["output_tokens_per_second"] == 50
        assert audit_ids(served, user) == entries
        width = b.page.evaluate("document.documentElement.scrollWidth")
        assert width <= viewport["width"], width
        shot(b.page, "conflict-user" if name == "desktop" else "conflict-user-phone")

        # Redo: B's 60 is back in the form over A's record, unsaved until B saves again;
        # the toast's "before" is the server's 50, not the 40 B's page first showed.
        b.page.get_by_role("button", name="Redo my changes on the new values").click()
        expect(b.page.locator("#user-form-redo")).to_be_visible()
        expect(b.page.locator("#user-override-rate")).to_have_value("60")
        assert audit_ids(served, user) == entries
        b.page.get_by_role("button", name=f"Save user {user}").click()
        expect(b.page.locator("#toast")).to_contain_text("override 50 tok/s → 60 tok/s")
        assert api(served, "GET", f"/limits/{user}").json()["output_tokens_per_second"] == 60

        # Discard: A, still drawn at 50 with B's 60 saved since, types 70 and saves.
        type_override(a.page, 70)
        a.page.get_by_role("button", name=f"Save user {user}").click()
        expect(a.page.locator("#conflict")).to_be_visible()
        assert conflict_row(a.page, "Own override") == ["50 tok/s", "60 tok/s", "70 tok/s"]
        a.page.get_by_role("button", name="Discard my changes").click()
        expect(a.page.locator("#user-override-rate")).to_have_value("60")
        expect(a.page.locator("#toast")).to_contain_text("nothing was saved")
        assert api(served, "GET", f"/limits/{user}").json()["output_tokens_per_second"] == 60


def test_a_tier_form_left_open_does_not_overwrite_a_newer_tier(
    browser: Browser, served: ControlPlane
) -> None:
    api(served, "PUT", "/tiers/trial", json={"output_tokens_per_second": 35})
    with watched_page(browser, refusals=REFUSALS) as w:
        page = w.page
        sign_in(page, served, "tiers")
        page.get_by_role("button", name="Edit tier trial").click()
        page.fill("#edit-rate-rate", "40")
        # Someone else sets 28 while the form is open.
        api(served, "PATCH", "/tiers/trial", json={"output_tokens_per_second": 28})
        entries = audit_ids(served, "trial", "tier")
        page.get_by_role("button", name="Save tier trial").click()
        expect(page.locator("#conflict")).to_be_visible()
        assert conflict_row(page, "Rate") == ["35 tok/s", "28 tok/s", "40 tok/s"]
        shot(page, "conflict-tier")
        page.get_by_role("button", name="Redo my changes on the new values").click()
        expect(page.locator("#tier-form-redo")).to_be_visible()
        expect(page.locator("#edit-rate-rate")).to_have_value("40")
        assert api(served, "GET", "/tiers/trial").json()["output_tokens_per_second"] == 28
        assert audit_ids(served, "trial", "tier") == entries
        page.get_by_role("button", name="Save tier trial").click()
        expect(page.locator("#toast")).to_contain_text("rate 28 tok/s → 40 tok/s")
        assert api(served, "GET", "/tiers/trial").json()["output_tokens_per_second"] == 40


def test_the_default_form_does_not_overwrite_a_newer_default(
    browser: Browser, served: ControlPlane
) -> None:
    api(served, "PUT", "/default-limit", json={"output_tokens_per_second": 5})
    with watched_page(browser, refusals=REFUSALS) as w:
        page = w.page
        sign_in(page, served, "tiers")
        page.fill("#default-rate-rate", "8")
        api(served, "PUT", "/default-limit", json={"output_tokens_per_second": 6})
        version = api(served, "GET", "/engines").json()["version"]
        page.get_by_role("button", name="Save default limit").click()
        expect(page.locator("#conflict")).to_be_visible()
        assert conflict_row(page, "Rate") == ["5 tok/s", "6 tok/s", "8 tok/s"]
        page.get_by_role("button", name="Discard my changes").click()
        expect(page.locator("#default-rate-rate")).to_have_value("6")
        assert api(served, "GET", "/engines").json()["version"] == version
        assert api(served, "GET", "/default-limit").json()["output_tokens_per_second"] == 6


def test_a_confirmation_says_what_the_server_has_not_what_the_page_drew(
    browser: Browser, served: ControlPlane
) -> None:
    """The user's record did not change (its ETag holds), but its tier's rate did while
    the page was open: the confirmation of putting the user in shadow names the rate it
    is held to now, from the server's preview."""
    api(served, "PUT", "/tiers/bronze", json={"output_tokens_per_second": 30})
    api(served, "PUT", "/limits/lifter", json={"tier": "bronze"})
    with watched_page(browser) as w:
        page = w.page
        sign_in(page, served, "users/lifter")
        expect(page.locator("#user-effective")).to_contain_text("30 tok/s")
        page.select_option("#user-enforcement", "shadow")
        api(served, "PATCH", "/tiers/bronze", json={"output_tokens_per_second": 45})
        page.get_by_role("button", name="Save user lifter").click()
        dialog = page.locator("#confirm")
        expect(dialog.locator("#confirm-title")).to_have_text("Put lifter in shadow?")
        expect(dialog).to_contain_text("lifter: 45 tok/s enforced → unlimited (shadow 45 tok/s)")
        dialog.get_by_role("button", name="Cancel").click()
        expect(page.locator("#toast")).to_contain_text("Not changed.")
    assert api(served, "GET", "/limits/lifter").json()["enforcement"] is None
