"""The admin console in real headless Chromium against a real `output-rate serve` with
realistic data (4 tiers, 5,000 users, 1,114 of them in `pro`), on SQLite and PostgreSQL.

Every test also checks (tests/web/browser.py) that the page logged no console error and
sent no request anywhere but 127.0.0.1. Each silent change the review found is a test.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from control_plane.db import Database, make_engine
from control_plane.usage.history import UsageRecorder
from harness.control_plane import fresh_database
from harness.servers import ControlPlane, free_port
from output_rate_core import protocol as p
from tests.web.browser import DESKTOP, PHONE, shot, watched_page
from tests.web.fleet import api_server, live_engine, seed, write_history

TOKEN = ControlPlane.TOKEN
HEADERS = ControlPlane.auth_headers()
# Generous: the UI refreshes every few seconds and CI shares two cores with the server.
expect.set_options(timeout=15_000)
VIEWS = ["overview", "tiers", "users", "users/user-00001", "engines", "audit", "tokens"]
DASH = "\u2013"  # the UI writes ranges with an en dash
HISTORY_USERS = [f"user-{i:05d}" for i in range(12)]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    tmp = tmp_path_factory.mktemp(f"ui-{request.param}")
    with fresh_database(request.param, tmp) as url:
        server = ControlPlane(tmp / "cp.log", url, free_port(), free_port())
        server.wait_ready()
        try:
            seed(server)
            # An hour of reports, with 6 minutes where the engine was disconnected.
            write_history(url, users=HISTORY_USERS, minutes=60, gap=range(20, 26))
            yield server
        finally:
            server.kill()


def api(served: ControlPlane, method: str, path: str, **kwargs: Any) -> httpx.Response:
    headers = kwargs.pop("headers", HEADERS)
    return httpx.request(method, f"{served.url}{path}", headers=headers, timeout=30, **kwargs)


def sign_in(page: Page, served: ControlPlane, view: str = "overview", token: str = TOKEN) -> None:
    page.goto(f"{served.url}/ui/#/{view}")
    page.fill("#token", token)
    page.get_by_role("button", name="Use token").click()
    expect(page.locator("#role")).to_be_visible()


@pytest.fixture
def admin(browser: Browser, served: ControlPlane) -> Iterator[Page]:
    with watched_page(browser) as watched:
        sign_in(watched.page, served)
        yield watched.page


def tier(served: ControlPlane, name: str) -> dict[str, Any]:
    return dict(api(served, "GET", f"/tiers/{name}").json())


def limit(served: ControlPlane, user: str) -> dict[str, Any]:
    return dict(api(served, "GET", f"/limits/{user}").json())


def toast(page: Page) -> Any:
    return expect(page.locator("#toast"))


# ---- silent changes --------------------------------------------------------------


def test_editing_only_the_description_keeps_the_rate(admin: Page, served: ControlPlane) -> None:
    admin.goto(f"{served.url}/ui/#/tiers")
    admin.get_by_role("button", name="Edit tier pro").click()
    form = admin.locator("#tier-edit-form")
    expect(form.locator("#edit-rate-rate")).to_have_value("100")  # pre-filled
    form.locator("#edit-description").fill("Paid plan (annual)")
    form.get_by_role("button", name="Save tier pro").click()
    toast(admin).to_contain_text("Tier pro: description updated")
    after = tier(served, "pro")
    assert (after["output_tokens_per_second"], after["description"]) == (100, "Paid plan (annual)")
    assert after["num_users"] >= 1114
    params = {"target": "pro", "target_kind": "tier", "limit": 1}
    entry = api(served, "GET", "/audit", params=params).json()["items"][0]
    assert entry["action"] == "patch_tier"


def test_changing_only_the_rate_keeps_the_description(admin: Page, served: ControlPlane) -> None:
    api(
        served,
        "PUT",
        "/tiers/t-rate",
        json={"output_tokens_per_second": 30, "description": "keep me"},
    )
    admin.goto(f"{served.url}/ui/#/tiers")
    admin.get_by_role("button", name="Edit tier t-rate").click()
    admin.fill("#edit-rate-rate", "40")
    admin.get_by_role("button", name="Save tier t-rate").click()
    toast(admin).to_contain_text("rate 30 tok/s → 40 tok/s")
    after = tier(served, "t-rate")
    assert (after["output_tokens_per_second"], after["description"]) == (40, "keep me")
    expect(admin.locator('#tiers tr[data-tier="t-rate"]')).to_contain_text("40 tok/s")


def test_moving_a_user_to_another_tier_keeps_the_override(
    admin: Page, served: ControlPlane
) -> None:
    api(served, "PUT", "/limits/mover", json={"tier": "free", "output_tokens_per_second": 7})
    admin.goto(f"{served.url}/ui/#/users/mover")
    expect(admin.locator("#user-tier")).to_have_value("free")
    expect(admin.locator("#user-override-rate")).to_have_value("7")
    admin.select_option("#user-tier", "basic")
    admin.get_by_role("button", name="Save user mover").click()
    toast(admin).to_contain_text("tier free → basic")
    after = limit(served, "mover")
    assert (after["tier"], after["output_tokens_per_second"]) == ("basic", 7)


def test_setting_an_override_keeps_the_tier(admin: Page, served: ControlPlane) -> None:
    api(served, "PUT", "/limits/overrider", json={"tier": "pro"})
    admin.goto(f"{served.url}/ui/#/users/overrider")
    admin.fill("#user-override-rate", "33")  # typing selects "Limit"
    admin.get_by_role("button", name="Save user overrider").click()
    toast(admin).to_contain_text("override none → 33 tok/s")
    after = limit(served, "overrider")
    assert (after["tier"], after["output_tokens_per_second"]) == ("pro", 33)
    expect(admin.locator("#user-effective")).to_contain_text("33 tok/s (from the override)")


def test_the_scope_selects_save_and_the_user_page_says_where_its_scope_comes_from(
    admin: Page, served: ControlPlane
) -> None:
    api(served, "PUT", "/limits/scoper", json={"tier": "basic", "output_tokens_per_second": 8})
    admin.goto(f"{served.url}/ui/#/users/scoper")
    scope = admin.locator("#user-scope-effective")
    expect(scope).to_have_text("fleet (inherited from the default: fleet)")
    expect(admin.locator("#user-scope")).to_have_value("")
    expect(admin.locator("#user-received")).to_have_text("no engine reports it")
    admin.select_option("#user-scope", "engine")
    admin.get_by_role("button", name="Save user scoper").click()
    # A scope move is confirmed with what it does, as the server previews it.
    dialog = admin.locator("#confirm")
    expect(dialog.locator("#confirm-title")).to_have_text("Change the scope of scoper?")
    expect(dialog).to_contain_text("Scope fleet → engine: each engine enforces the rate in full")
    dialog.get_by_role("button", name="Save user scoper").click()
    toast(admin).to_contain_text("scope inherit → engine; now 8 tok/s (engine scope)")
    after = limit(served, "scoper")
    assert (after["scope"], after["effective_scope"]) == ("engine", "engine")
    assert (after["tier"], after["output_tokens_per_second"]) == ("basic", 8)
    expect(scope).to_have_text("engine (its own)")
    expect(admin.locator("#user-shares")).to_contain_text("each engine enforces the full limit")

    # A tier's scope, from its edit form, is what its members without their own get.
    admin.goto(f"{served.url}/ui/#/tiers")
    admin.get_by_role("button", name="Edit tier basic").click()
    admin.select_option("#edit-scope", "engine")
    admin.get_by_role("button", name="Save tier basic").click()
    expect(dialog.locator("#confirm-title")).to_have_text("Change the scope of tier basic?")
    expect(dialog).to_contain_text("scope fleet → engine")
    dialog.get_by_role("button", name="Set the scope of basic to engine").click()
    toast(admin).to_contain_text("Tier basic: scope inherit → engine")
    expect(admin.locator('#tiers tr[data-tier="basic"]')).to_contain_text("engine")
    assert tier(served, "basic")["scope"] == "engine"
    api(served, "PATCH", "/limits/scoper", json={"scope": None})
    admin.goto(f"{served.url}/ui/#/users/scoper")
    expect(scope).to_have_text("engine (inherited from tier basic: engine)")
    api(served, "PATCH", "/tiers/basic", json={"scope": None})


def test_the_enforcement_selects_save_and_the_user_page_shows_what_shadow_would_hold(
    admin: Page, served: ControlPlane
) -> None:
    api(served, "PUT", "/limits/shadowy", json={"tier": "basic", "output_tokens_per_second": 8})
    # Two minutes ago an engine served 400 request-steps of which 100 were over the limit.
    db = Database(make_engine(served.db_url))
    try:
        recorder = UsageRecorder(db, retention_days=7, clock=lambda: time.time() - 120)
        recorder.add(p.Usage("hist", 60.0, {"shadowy": 400}, {}, would_throttle={"shadowy": 100}))
        recorder.flush()
    finally:
        db.dispose()
    admin.goto(f"{served.url}/ui/#/users/shadowy")
    effective = admin.locator("#user-enforcement-effective")
    expect(effective).to_have_text("enforce (inherited from the default: enforce)")
    expect(admin.locator("#user-enforcement")).to_have_value("")
    admin.select_option("#user-enforcement", "shadow")
    admin.get_by_role("button", name="Save user shadowy").click()
    dialog = admin.locator("#confirm")
    expect(dialog.locator("#confirm-title")).to_have_text("Put shadowy in shadow?")
    expect(dialog).to_contain_text("shadowy: 8 tok/s enforced → unlimited (shadow 8 tok/s)")
    dialog.get_by_role("button", name="Save user shadowy").click()
    toast(admin).to_contain_text("enforcement inherit → shadow")
    after = limit(served, "shadowy")
    assert (after["enforcement"], after["effective_enforcement"]) == ("shadow", "shadow")
    assert (after["tier"], after["output_tokens_per_second"]) == ("basic", 8)
    expect(effective).to_have_text("shadow: counted, not enforced (its own)")
    # Its history names the change (an own enforcement is shown, an inherited one not).
    expect(admin.locator("main")).to_contain_text("override 8 tok/s, enforcement shadow")
    expect(admin.locator("#user-would-throttle")).to_have_text(
        "25.0% of its request-steps in the last hour"
    )

    # A tier's enforcement, from its edit form; the tier is marked in the list.
    admin.goto(f"{served.url}/ui/#/tiers")
    admin.get_by_role("button", name="Edit tier basic").click()
    admin.select_option("#edit-enforcement", "shadow")
    admin.get_by_role("button", name="Save tier basic").click()
    expect(dialog.locator("#confirm-title")).to_have_text("Put tier basic in shadow?")
    dialog.get_by_role("button", name="Set the enforcement of basic to shadow").click()
    toast(admin).to_contain_text("Tier basic: enforcement inherit → shadow")
    expect(admin.locator('#tiers tr[data-tier="basic"]')).to_contain_text("(shadow)")
    assert tier(served, "basic")["enforcement"] == "shadow"
    api(served, "PATCH", "/tiers/basic", json={"enforcement": None})

    # The default's, confirmed with its effect; its PUT keeps the rate and scope.
    before = api(served, "GET", "/default-limit").json()
    admin.goto(f"{served.url}/ui/#/tiers")
    admin.select_option("#default-enforcement", "shadow")
    admin.get_by_role("button", name="Save default limit").click()
    dialog = admin.locator("#confirm")
    expect(dialog).to_contain_text("enforcement enforce → shadow")
    dialog.get_by_role("button", name="Set the default enforcement to shadow").click()
    toast(admin).to_contain_text("Default limit: enforcement enforce → shadow")
    now = api(served, "GET", "/default-limit").json()
    assert now["enforcement"] == "shadow"
    assert (now["output_tokens_per_second"], now["scope"]) == (
        before["output_tokens_per_second"],
        before["scope"],
    )
    expect(admin.locator("#default-current")).to_contain_text("in shadow")
    api(
        served,
        "PUT",
        "/default-limit",
        json={
            "output_tokens_per_second": before["output_tokens_per_second"],
            "scope": before["scope"],
        },
    )
    api(served, "DELETE", "/limits/shadowy")


def test_the_ceiling_fields_save_and_the_user_page_says_what_it_borrows(
    browser: Browser, served: ControlPlane
) -> None:
    ceiling = "ceiling_output_tokens_per_second"
    api(served, "PUT", "/limits/borrower", json={"tier": "basic"})
    # A ceiling below the rate is refused by the server (its 422 is expected).
    with watched_page(browser, refusals=(422,)) as watched:
        admin = watched.page
        sign_in(admin, served)
        admin.goto(f"{served.url}/ui/#/users/borrower")
        effective = admin.locator("#user-ceiling-effective")
        expect(effective).to_have_text("none: the rate is a hard limit")
        expect(admin.locator("#user-ceiling-none")).to_be_checked()
        # Below its rate (basic's 50): the server's 422, next to the field; nothing saved.
        admin.fill("#user-ceiling-rate", "40")
        admin.get_by_role("button", name="Save user borrower").click()
        form = admin.locator("#user-form")
        expect(form.locator(".field-error")).to_contain_text("below the effective rate 50")
        assert limit(served, "borrower")[ceiling] is None
        admin.fill("#user-ceiling-rate", "80")
        admin.get_by_role("button", name="Save user borrower").click()
        toast(admin).to_contain_text("ceiling inherit → 80 tok/s")
        after = limit(served, "borrower")
        assert (after[ceiling], after[f"effective_{ceiling}"]) == (80, 80)
        assert (after["tier"], after["output_tokens_per_second"]) == ("basic", None)
        expect(effective).to_have_text(
            "up to 80 tok/s when no other user needs the capacity (its own)"
        )
        effective.evaluate("e => e.scrollIntoView({block: 'start'})")
        shot(admin, "user-borrowing")

        # A tier's, from its edit form (no confirmation: it holds nobody to less); the list
        # shows it.
        admin.goto(f"{served.url}/ui/#/tiers")
        admin.get_by_role("button", name="Edit tier basic").click()
        expect(admin.locator("#edit-ceiling-none")).to_be_checked()
        admin.fill("#edit-ceiling-rate", "70")
        admin.get_by_role("button", name="Save tier basic").click()
        toast(admin).to_contain_text("Tier basic: ceiling inherit → 70 tok/s")
        assert tier(served, "basic")[ceiling] == 70
        expect(admin.locator('#tiers tr[data-tier="basic"]')).to_contain_text(
            "borrows up to 70 tok/s"
        )

        # The default's: its PUT keeps the rate, scope and enforcement.
        before = api(served, "GET", "/default-limit").json()
        admin.fill("#default-ceiling-rate", "9")
        admin.get_by_role("button", name="Save default limit").click()
        dialog = admin.locator("#confirm")
        expect(dialog).to_contain_text("borrowing ceiling none → 9 tok/s")
        dialog.get_by_role("button", name="Set the default ceiling to 9 tok/s").click()
        toast(admin).to_contain_text("Default limit: borrowing ceiling none → 9 tok/s")
        now = api(served, "GET", "/default-limit").json()
        assert now[ceiling] == 9
        kept = ("output_tokens_per_second", "scope", "enforcement")
        assert {k: now[k] for k in kept} == {k: before[k] for k in kept}
        expect(admin.locator("#default-current")).to_contain_text("borrowing up to 9 tok/s")

        # The user without its own inherits its tier's, and the page says from where.
        api(served, "PATCH", "/limits/borrower", json={ceiling: None})
        admin.goto(f"{served.url}/ui/#/users/borrower")
        expect(effective).to_have_text(
            "up to 70 tok/s when no other user needs the capacity "
            "(inherited from tier basic: 70 tok/s)"
        )
        api(served, "PATCH", "/tiers/basic", json={ceiling: None})
        api(served, "PUT", "/default-limit", json={k: before[k] for k in kept})
        api(served, "DELETE", "/limits/borrower")


def test_the_user_page_shows_the_rate_engines_report_now(admin: Page, served: ControlPlane) -> None:
    # 11 tokens per 0.5 s report from one engine: 22 tok/s.
    with live_engine(served, "engine-r", {"user-00002": 22}):
        admin.goto(f"{served.url}/ui/#/users/user-00002")
        expect(admin.locator("#user-received")).to_have_text(
            "22.0 tok/s (all engines, last second)"
        )


def test_a_change_for_many_users_states_its_effect_first(admin: Page, served: ControlPlane) -> None:
    count = f"{tier(served, 'pro')['num_users']:,} users"
    assert count.startswith("1,11")  # the seeded 1,114 (other tests may add one)
    admin.goto(f"{served.url}/ui/#/tiers")
    admin.get_by_role("button", name="Edit tier pro").click()
    admin.check("#edit-rate-none")  # "Unlimited" in the edit form
    admin.get_by_role("button", name="Save tier pro").click()
    dialog = admin.locator("#confirm")
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text(f"{count}: 100 → unlimited tok/s")
    dialog.get_by_role("button", name="Cancel").click()
    expect(dialog).to_be_hidden()
    assert tier(served, "pro")["output_tokens_per_second"] == 100

    admin.fill("#edit-rate-rate", "150")
    admin.get_by_role("button", name="Save tier pro").click()
    expect(dialog).to_contain_text(f"{count}: 100 → 150 tok/s")
    dialog.get_by_role("button", name="Set pro to 150 tok/s").click()
    toast(admin).to_contain_text("rate 100 tok/s → 150 tok/s")
    assert tier(served, "pro")["output_tokens_per_second"] == 150
    api(served, "PATCH", "/tiers/pro", json={"output_tokens_per_second": 100})


def test_a_cleared_or_mistyped_default_is_refused_not_made_unlimited(
    admin: Page, served: ControlPlane
) -> None:
    admin.goto(f"{served.url}/ui/#/tiers")
    rate = admin.locator("#default-rate-rate")
    expect(rate).to_have_value("5")
    for typed in ("", "abc", "0", "2.5"):
        rate.fill(typed)
        rate.press("Enter")
        error = admin.locator("#default-form .field-error")
        expect(error).to_contain_text("Default rate: enter a whole number")
        expect(rate).to_have_attribute("aria-invalid", "true")
        assert api(served, "GET", "/default-limit").json()["output_tokens_per_second"] == 5
    expect(admin.locator("#confirm")).to_be_hidden()


def test_an_unknown_user_id_is_confirmed_before_it_is_created(
    admin: Page, served: ControlPlane
) -> None:
    admin.goto(f"{served.url}/ui/#/users")
    admin.fill("#open-user", "user-0001x")  # a typo of user-00010
    admin.get_by_role("button", name="Open user").click()
    dialog = admin.locator("#confirm")
    expect(dialog).to_contain_text("No user with the id “user-0001x” exists yet")
    dialog.get_by_role("button", name="Cancel").click()
    assert "#/users" in admin.url and "user-0001x" not in admin.url
    admin.get_by_role("button", name="Open user").click()
    dialog.get_by_role("button", name="Continue with user-0001x").click()
    expect(admin.locator("#user-summary")).to_contain_text("is not configured")
    # Nothing was written by opening it.
    assert api(served, "GET", "/limits", params={"q": "user-0001x"}).json()["total"] == 0
    admin.fill("#user-override-rate", "9")
    admin.get_by_role("button", name="Save user user-0001x").click()
    toast(admin).to_contain_text("now 9 tok/s")
    assert limit(served, "user-0001x")["output_tokens_per_second"] == 9
    # A known id opens directly.
    admin.goto(f"{served.url}/ui/#/users")
    admin.fill("#open-user", "user-00010")
    admin.get_by_role("button", name="Open user").click()
    expect(admin.get_by_role("heading", name="User user-00010")).to_be_visible()


def test_removing_a_user_or_a_limit_says_what_happens(admin: Page, served: ControlPlane) -> None:
    api(served, "PUT", "/limits/leaver", json={"tier": "free", "output_tokens_per_second": 8})
    admin.goto(f"{served.url}/ui/#/users/leaver")
    admin.get_by_role("button", name="Remove user leaver").click()
    dialog = admin.locator("#confirm")
    expect(dialog).to_contain_text("leaver: tier free and override 8 tok/s removed")
    expect(dialog).to_contain_text("8 tok/s → 5 tok/s")
    dialog.get_by_role("button", name="Remove leaver").click()
    toast(admin).to_contain_text("User leaver removed")
    assert limit(served, "leaver")["source"] == "default"

    # A tier change that leaves a user unlimited asks first.
    api(served, "PUT", "/limits/to-max", json={"tier": "free"})
    api(served, "PUT", "/tiers/open", json={"output_tokens_per_second": None})
    admin.goto(f"{served.url}/ui/#/users/to-max")
    admin.select_option("#user-tier", "open")
    admin.get_by_role("button", name="Save user to-max").click()
    expect(dialog).to_contain_text("to-max: 10 tok/s → unlimited")
    dialog.get_by_role("button", name="Cancel").click()
    assert limit(served, "to-max")["tier"] == "free"


def test_errors_are_plain_words_next_to_the_field(admin: Page, served: ControlPlane) -> None:
    admin.goto(f"{served.url}/ui/#/tiers")
    create = admin.locator("#tier-create")
    create.get_by_role("button", name="Create tier").click()
    expect(create.locator(".field-error")).to_have_text("Name: enter a name for the tier.")
    admin.fill("#new-tier-name", "bad name!")
    create.get_by_role("button", name="Create tier").click()
    expect(create.locator(".field-error")).to_contain_text("letters, digits")
    admin.fill("#new-tier-name", "pro")
    admin.fill("#new-tier-rate-rate", "5")
    create.get_by_role("button", name="Create tier").click()
    expect(create.locator(".field-error")).to_contain_text("tier pro already exists")
    admin.fill("#new-tier-name", "fresh-tier")
    admin.fill("#new-tier-rate-rate", "")
    create.get_by_role("button", name="Create tier").click()
    expect(create.locator(".field-error")).to_contain_text("or choose “Unlimited”")
    admin.fill("#new-tier-rate-rate", "25")
    create.get_by_role("button", name="Create tier").click()
    toast(admin).to_contain_text("Tier fresh-tier created (25 tok/s)")
    assert tier(served, "fresh-tier")["output_tokens_per_second"] == 25
    # The error sits in the form, next to its field (not at the top of the page).
    box = admin.locator("#tier-create").bounding_box()
    assert box is not None
    # A tier with users cannot be deleted: the dialog says why; nothing is sent.
    admin.get_by_role("button", name="Delete tier pro").click()
    expect(admin.locator("#confirm")).to_contain_text(
        f"{tier(served, 'pro')['num_users']:,} users still in it"
    )
    admin.locator("#confirm").get_by_role("button", name="OK").click()
    admin.get_by_role("button", name="Delete tier fresh-tier").click()
    admin.locator("#confirm").get_by_role("button", name="Delete fresh-tier").click()
    expect(admin.locator('#tiers tr[data-tier="fresh-tier"]')).to_have_count(0)


# ---- views -------------------------------------------------------------------------


def test_users_search_filter_sort_and_pages(admin: Page, served: ControlPlane) -> None:
    admin.goto(f"{served.url}/ui/#/users")
    total = admin.locator("#users-total")
    expect(total).to_contain_text(f"configured users (showing 1{DASH}50)")
    admin.fill("#user-search", "0042")
    expect(total).to_contain_text("11 configured users")  # user-00420..00429, user-00042
    admin.select_option("#user-tier-filter", "pro")
    expect(total).to_contain_text("configured user")
    rows = admin.locator("#users tbody tr")
    for user in rows.evaluate_all("rs => rs.map(r => r.dataset.user)"):
        assert "0042" in user
    expect(rows.first.locator("td").nth(1)).to_have_text("pro")
    # Deep link: the filters are in the address and survive a reload.
    assert re.search(r"q=0042", admin.url) and "tier=pro" in admin.url
    admin.reload()
    expect(admin.locator("#user-search")).to_have_value("0042")
    expect(admin.locator("#user-tier-filter")).to_have_value("pro")
    admin.goto(f"{served.url}/ui/#/users?sort=-user")
    expect(admin.locator("#users tbody tr").first).to_have_attribute(
        "data-user", re.compile("^user-0|^to|^u")
    )
    first = admin.locator("#users tbody tr").first.get_attribute("data-user")
    assert first is not None and first >= "user-04999"
    admin.get_by_role("button", name="Next →").click()
    expect(total).to_contain_text(f"(showing 51{DASH}100)")
    admin.get_by_role("link", name="Open user user-00001").count()


def test_bulk_import_previews_what_it_replaces(browser: Browser, served: ControlPlane) -> None:
    with watched_page(browser, refusals=(422,)) as watched:  # the bad line's 422
        admin = watched.page
        sign_in(admin, served, view="users")
        admin.fill("#bulk-text", "user-00003,free,\nbulk-new,,12\nbulk-bad,,fast")
        admin.get_by_role("button", name="Preview and import").click()
        expect(admin.locator("#bulk-form .field-error")).to_contain_text(
            "Line 3: Rate 'fast' is not a whole number"
        )
        # user-00004's line is its stored record (seeded in pro): not counted as replaced.
        admin.fill("#bulk-text", "user-00003,free,\nbulk-new,,12\nuser-00004,pro")
        admin.get_by_role("button", name="Preview and import").click()
        dialog = admin.locator("#confirm")
        expect(dialog).to_contain_text("1 existing user: its record is replaced.")
        expect(dialog).to_contain_text("1 line equal to the stored record: nothing changes.")
        expect(dialog.locator("#preview-counts")).to_have_text(
            "1 user held to a lower rate, 1 to a higher one, 1 unchanged, 1 new."
        )
        expect(dialog.locator("#preview-cuts")).to_contain_text("user-00003: 100 tok/s → 10 tok/s")
        dialog.get_by_role("button", name="Import 3 users").click()
        toast(admin).to_contain_text("Imported: 2 users changed")
    assert limit(served, "bulk-new")["output_tokens_per_second"] == 12
    assert limit(served, "user-00003")["tier"] == "free"


def test_changes_made_elsewhere_show_up_without_reload(admin: Page, served: ControlPlane) -> None:
    admin.goto(f"{served.url}/ui/#/tiers")
    row = admin.locator('#tiers tr[data-tier="basic"]')
    expect(row).to_contain_text("50 tok/s")
    api(served, "PATCH", "/tiers/basic", json={"description": "changed elsewhere"})
    expect(row).to_contain_text("changed elsewhere")


def test_audit_log_and_filter(admin: Page, served: ControlPlane) -> None:
    api(served, "PATCH", "/tiers/max", json={"description": "Enterprise"})
    api(served, "PUT", "/limits/max", json={"output_tokens_per_second": 8})  # a user "max"
    admin.goto(f"{served.url}/ui/#/audit?target=max&target_kind=tier")
    audit = admin.locator("#audit")
    expect(audit).to_contain_text("patch tier")
    expect(audit).to_contain_text("description “Enterprise”")
    for target in audit.locator("tbody tr td:nth-child(4)").all_inner_texts():
        assert target == "tier max"
    # The same name as a user: only the user's entries.
    admin.select_option("#audit-kind", "")
    admin.get_by_role("button", name="Filter").click()
    expect(audit.locator("tbody tr")).to_have_count(1)
    expect(audit).to_contain_text("put limit")
    assert "target_kind" not in admin.url


# ---- the audit log: bulk changes, a user's history, paging back -----------------


def audit_items(served: ControlPlane, **params: Any) -> list[dict[str, Any]]:
    return list(api(served, "GET", "/audit", params=params).json()["items"])


def test_a_bulk_change_shows_in_the_users_history_and_opens_its_users(
    admin: Page, served: ControlPlane
) -> None:
    users = [f"hist-{i:03d}" for i in range(150)]
    api(served, "PUT", "/limits/hist-007", json={"output_tokens_per_second": 9})
    items = [{"user": u, "tier": "basic"} for u in users]
    assert api(served, "POST", "/limits:bulk", json={"items": items}).status_code == 200
    bulk_id = audit_items(served, target="hist-007")[0]["id"]
    admin.goto(f"{served.url}/ui/#/users/hist-007")
    expect(admin.locator('#view[data-ready="users/hist-007"]')).to_have_count(1)
    # The import is the user's last change (not the override before it), with what it
    # did to this user.
    rows = admin.locator("#audit > tbody > tr")
    expect(rows).to_have_count(2)
    newest = rows.first
    expect(newest.locator("td").nth(2)).to_have_text("bulk put limits")
    expect(newest.locator("td").nth(4)).to_have_text("no tier, override 9 tok/s")
    expect(newest.locator("td").nth(5)).to_have_text("tier basic, no override")
    expect(rows.nth(1).locator("td").nth(2)).to_have_text("put limit")
    # It opens the users it changed, 100 at a time.
    opener = newest.get_by_role("button", name="150 users")
    expect(opener).to_have_attribute("aria-expanded", "false")
    opener.click()
    expect(opener).to_have_attribute("aria-expanded", "true")
    detail = admin.locator(f"#audit-detail-{bulk_id}")
    expect(detail.locator("tbody tr")).to_have_count(100)
    detail.get_by_role("button", name="More users").click()
    expect(detail.locator("tbody tr")).to_have_count(150)
    expect(detail.get_by_role("button", name="More users")).to_be_hidden()
    mine = detail.locator('tr[data-user="hist-007"] td')
    expect(mine.nth(1)).to_contain_text("override 9 tok/s")
    expect(detail.locator('tr[data-user="hist-100"] td').nth(1)).to_have_text(DASH)
    # The periodic refresh (10 s) shows a later change and keeps the opened users.
    api(served, "PATCH", "/limits/hist-007", json={"output_tokens_per_second": 11})
    expect(rows.first.locator("td").nth(2)).to_have_text("patch limit", timeout=25_000)
    expect(detail.locator("tbody tr")).to_have_count(150)
    # A user in the detail opens that user's page, whose history has the same change.
    detail.get_by_role("link", name="hist-100").click()
    expect(admin.locator('#view[data-ready="users/hist-100"]')).to_have_count(1)
    expect(admin.locator("#audit > tbody > tr")).to_have_count(1)
    expect(admin.locator("#audit > tbody > tr td").nth(4)).to_have_text(DASH)
    # Closing it again.
    admin.locator("#audit").get_by_role("button", name="150 users").click()
    expect(admin.locator(f"#audit-detail-{bulk_id}")).to_be_visible()
    admin.locator("#audit").get_by_role("button", name="150 users").click()
    expect(admin.locator(f"#audit-detail-{bulk_id}")).to_have_count(0)


def test_the_audit_view_pages_back_to_the_first_entry(admin: Page, served: ControlPlane) -> None:
    with httpx.Client(base_url=served.url, headers=HEADERS, timeout=30) as http:
        for rate in range(1, 231):
            response = http.put("/limits/pager", json={"output_tokens_per_second": rate})
            assert response.status_code == 200
    admin.goto(f"{served.url}/ui/#/audit?target=pager")
    rows = admin.locator("#audit > tbody > tr")
    older = admin.locator("#audit-older")
    newer = admin.locator("#audit-newer")
    after_cell = rows.first.locator("td").nth(5)
    expect(after_cell).to_have_text("no tier, override 230 tok/s")
    expect(rows).to_have_count(100)
    expect(newer).to_be_disabled()
    older.click()
    expect(after_cell).to_have_text("no tier, override 130 tok/s")
    expect(rows).to_have_count(100)
    older.click()
    expect(rows).to_have_count(30)
    expect(rows.last.locator("td").nth(5)).to_have_text("no tier, override 1 tok/s")
    expect(older).to_be_disabled()
    expect(admin.locator("#audit-position")).to_have_text("The last row is the first entry.")
    # Newer goes back a page; the page is in the address: a reload stays on it, and from
    # there (the pages above it unknown) the button goes to the newest.
    newer.click()
    expect(after_cell).to_have_text("no tier, override 130 tok/s")
    expect(newer).to_have_text("← Newer")
    admin.reload()
    expect(after_cell).to_have_text("no tier, override 130 tok/s")
    expect(newer).to_have_text("← Newest")
    newer.click()
    expect(after_cell).to_have_text("no tier, override 230 tok/s")
    expect(newer).to_be_disabled()
    # Unfiltered, Older reaches the log's first entry: the seed's first tier.
    admin.goto(f"{served.url}/ui/#/audit")
    expect(rows).to_have_count(100)
    for _ in range(50):
        if older.is_disabled():
            break
        first_shown = rows.first.get_attribute("data-id")
        older.click()
        expect(rows.first).not_to_have_attribute("data-id", first_shown or "")
    expect(older).to_be_disabled()
    first = min(e["id"] for e in audit_items(served, target_kind="tier", limit=1000))
    expect(rows.last).to_have_attribute("data-id", str(first))
    expect(rows.last.locator("td").nth(3)).to_have_text("tier free")


def test_a_refused_audit_filter_is_said_next_to_its_field(
    browser: Browser, served: ControlPlane
) -> None:
    with watched_page(browser, refusals=(422,)) as watched:
        page = watched.page
        sign_in(page, served, view="audit?target=abc&target_kind=token")
        expect(page.locator("#audit-filter .field-error")).to_contain_text(
            "Target: with target_kind=token it must be a token id"
        )
        expect(page.locator("#audit-target")).to_have_attribute("aria-invalid", "true")
        page.fill("#audit-target", "1")
        page.get_by_role("button", name="Filter").click()
        expect(page.locator("#audit-filter .field-error")).to_have_count(0)
        expect(page.locator("#audit, #view p.hint").first).to_be_visible()


def test_viewer_tokens_are_created_and_revoked(admin: Page, served: ControlPlane) -> None:
    admin.goto(f"{served.url}/ui/#/tokens")
    admin.fill("#token-name", "wallboard")
    admin.get_by_role("button", name="Create viewer token").click()
    token = admin.locator("#new-token").inner_text()
    assert token.startswith("orv_")
    viewer = {"Authorization": f"Bearer {token}"}
    assert api(served, "GET", "/tiers", headers=viewer).status_code == 200
    tokens = api(served, "GET", "/tokens").json()["items"]
    name = [t for t in tokens if t["name"] == "wallboard"][-1]["name"]
    admin.get_by_role("button", name=f"Revoke token {name}").last.click()
    admin.locator("#confirm").get_by_role("button", name=f"Revoke {name}").click()
    toast(admin).to_contain_text("revoked")
    assert api(served, "GET", "/tiers", headers=viewer).status_code == 401


def test_a_viewer_session_has_no_write_controls_and_writes_are_refused(
    browser: Browser, served: ControlPlane
) -> None:
    token = api(served, "POST", "/tokens", json={"name": "ro-ui"}).json()["token"]
    key_id = ensure_key(served, "user-00001")
    with watched_page(browser) as watched:
        page = watched.page
        sign_in(page, served, token=token)
        expect(page.locator("#readonly")).to_contain_text("Read-only session")
        expect(page.locator("#role")).to_have_text("read-only")
        for view in VIEWS:
            page.goto(f"{served.url}/ui/#/{view}")
            expect(page.locator(f'#view[data-ready="{view}"]')).to_have_count(1)
            writes = page.locator(
                "#view form:not([role=search]):not(#audit-form), #view button.danger, "
                "#view button:text-matches('^(Save|Create|Edit|Delete|Remove|Revoke|Preview)')"
            )
            expect(writes).to_have_count(0)
            if view == "users/user-00001":  # the keys are listed, with no way to change them
                expect(page.locator(f'#user-keys-table tr[data-key="{key_id}"]')).to_be_visible()
                expect(page.locator("#user-keys-table thead th")).to_have_count(3)
        expect(page.locator("#view")).to_contain_text("read-only")
    viewer = {"Authorization": f"Bearer {token}"}
    before = tier(served, "pro")
    for method, path, body in [
        ("PATCH", "/tiers/pro", {"output_tokens_per_second": None}),
        ("PUT", "/tiers/pro", {"output_tokens_per_second": 1}),
        ("PATCH", "/limits/user-00001", {"output_tokens_per_second": 1}),
        ("PUT", "/default-limit", {"output_tokens_per_second": None}),
        ("DELETE", "/limits/user-00001", None),
        ("POST", "/users/user-00001/keys", None),
        ("DELETE", f"/keys/{key_id}", None),
    ]:
        response = api(served, method, path, json=body, headers=viewer)
        assert response.status_code == 403, (method, path)
    assert tier(served, "pro") == before
    assert key_id in [k["id"] for k in keys_of(served, "user-00001")]


# ---- API keys --------------------------------------------------------------------------


def keys_of(served: ControlPlane, user: str) -> list[dict[str, Any]]:
    return list(api(served, "GET", f"/users/{user}/keys").json()["items"])


def ensure_key(served: ControlPlane, user: str) -> str:
    """The id of one of the user's keys, created if it has none."""
    items = keys_of(served, user)
    if items:
        return str(items[0]["id"])
    response = api(served, "POST", f"/users/{user}/keys")
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def wait_for(condition: Callable[[], bool], timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def create_key_in_ui(
    page: Page, served: ControlPlane, user: str, known: set[str]
) -> tuple[str, dict[str, Any]]:
    """Press Create key on `user`'s page: (the key shown, its item in GET), `known` being
    the ids the user had before."""
    page.get_by_role("button", name="Create key").click()
    field = page.locator("#new-key")
    expect(field).to_be_focused()
    secret = field.input_value()
    (item,) = [k for k in keys_of(served, user) if k["id"] not in known]
    return secret, item


def test_an_api_key_is_shown_once_authenticates_and_is_revoked_after_confirmation(
    admin: Page, served: ControlPlane
) -> None:
    user = "key-holder"
    with api_server(served, "keys-engine") as engine_api:
        admin.goto(f"{served.url}/ui/#/users/{user}")
        expect(admin.locator("#user-keys")).to_have_text("No API keys.")
        secret, item = create_key_in_ui(admin, served, user, set())
        prefix = item["prefix"]
        # The list shows its prefix, the start of the key; the secret is nowhere else.
        assert secret.startswith(f"{prefix}_") and len(secret) > len(prefix) + 40
        expect(admin.locator("#new-key-box")).to_contain_text(
            "This is the only time the key is shown"
        )
        toast(admin).to_contain_text(f"API key {prefix} created for {user}.")
        row = admin.locator(f'#user-keys-table tr[data-key="{item["id"]}"]')
        expect(row.locator("td").nth(0)).to_have_text(prefix)
        expect(row.locator("td").nth(2)).to_have_text("never")
        assert secret not in row.inner_text()
        # An engine's API server, from the keys the control plane pushed, takes this key
        # as this user's.
        wait_for(lambda: engine_api.user_of(secret) == (item["id"], user))
        # Not kept by the browser: not in storage, cookies or the address.
        kept = admin.evaluate(
            "() => JSON.stringify([{...localStorage}, {...sessionStorage}, document.cookie,"
            " location.href, history.state])"
        )
        assert secret not in kept
        # The periodic refresh (10 s) redraws the list; the shown key and what the operator
        # typed and did not save stay.
        admin.fill("#user-override-rate", "77")
        other = api(served, "POST", f"/users/{user}/keys").json()
        expect(admin.locator("#user-keys-table tbody tr")).to_have_count(2)
        expect(admin.locator("#new-key")).to_have_value(secret)
        expect(admin.locator("#user-override-rate")).to_have_value("77")
        # Gone after a reload.
        admin.reload()
        expect(admin.locator(f'#view[data-ready="users/{user}"]')).to_have_count(1)
        expect(admin.locator("#user-keys-table tbody tr")).to_have_count(2)
        expect(admin.locator("#new-key")).to_have_count(0)
        assert secret not in admin.content()

        # Revoking asks first, naming the key and the effect; Cancel keeps it.
        revoke = admin.get_by_role("button", name=f"Revoke API key {prefix}")
        revoke.click()
        dialog = admin.locator("#confirm")
        expect(dialog.locator("#confirm-title")).to_have_text(f"Revoke API key {prefix}?")
        expect(dialog).to_contain_text(
            f"Requests with the key {prefix}… are refused by every engine within a moment."
        )
        dialog.get_by_role("button", name="Cancel").click()
        expect(dialog).to_be_hidden()
        assert {k["id"] for k in keys_of(served, user)} == {item["id"], other["id"]}
        revoke.click()
        dialog.get_by_role("button", name=f"Revoke {prefix}").click()
        toast(admin).to_contain_text(f"API key {prefix} of {user} revoked.")
        expect(row).to_have_count(0)
        expect(admin.locator("#user-keys-table tbody tr")).to_have_count(1)
        assert [k["id"] for k in keys_of(served, user)] == [other["id"]]
        wait_for(lambda: engine_api.user_of(secret) is None)
        assert engine_api.user_of(other["key"]) == (other["id"], user)
        # The engines view says which config version the API server's keys are of.
        version = api(served, "GET", "/engines").json()["version"]
        admin.goto(f"{served.url}/ui/#/engines")
        row = admin.locator('#engines tr[data-engine="keys-engine"]')
        expect(row.locator('td[data-label="API server"]')).to_have_text(f"keys of {version}")
        # Its engine core never connected: no vLLM said, and no mix of releases to tell.
        expect(row.locator('td[data-label="vLLM"]')).to_have_text("unknown")
        expect(admin.locator("#vllm-releases")).to_have_count(0)
        admin.go_back()
    # The user's audit trail names the key, never its secret.
    audit = admin.locator("#audit")
    expect(audit).to_contain_text("revoke key")
    expect(audit.locator("tr", has_text="create key")).to_have_count(2)
    expect(audit).to_contain_text(f"API key {prefix}")
    assert secret not in audit.inner_text()


def test_a_shown_key_goes_when_dismissed_left_or_revoked_and_last_use_is_shown(
    admin: Page, served: ControlPlane
) -> None:
    user = "key-user"
    with api_server(served, "keys-engine-2") as engine_api:
        admin.goto(f"{served.url}/ui/#/users/{user}")
        expect(admin.locator(f'#view[data-ready="users/{user}"]')).to_have_count(1)
        _, first = create_key_in_ui(admin, served, user, set())
        admin.get_by_role("button", name="Done: hide the key").click()
        expect(admin.locator("#new-key")).to_have_count(0)
        expect(admin.get_by_role("button", name="Create key")).to_be_focused()
        # Leaving the page and coming back (history): not shown again.
        _, second = create_key_in_ui(admin, served, user, {first["id"]})
        admin.get_by_role("link", name="← All users").click()
        expect(admin.locator('#view[data-ready="users"]')).to_have_count(1)
        admin.go_back()
        expect(admin.locator(f'#view[data-ready="users/{user}"]')).to_have_count(1)
        expect(admin.locator("#user-keys-table tbody tr")).to_have_count(2)
        expect(admin.locator("#new-key")).to_have_count(0)
        # Revoking the key that is shown hides it too.
        _, third = create_key_in_ui(admin, served, user, {first["id"], second["id"]})
        admin.get_by_role("button", name=f"Revoke API key {third['prefix']}").click()
        admin.locator("#confirm").get_by_role("button", name=f"Revoke {third['prefix']}").click()
        expect(admin.locator("#new-key")).to_have_count(0)
        expect(admin.locator("#user-keys-table tbody tr")).to_have_count(2)
        # An API server reports a use: the list shows when (the next flush and refresh).
        row = admin.locator(f'#user-keys-table tr[data-key="{first["id"]}"]')
        expect(row.locator("td").nth(2)).to_have_text("never")
        engine_api.report_use({first["id"]: time.time() - 30})
        wait_for(
            lambda: any(k["last_used_at"] for k in keys_of(served, user) if k["id"] == first["id"]),
            timeout_s=30,
        )
        (used_at,) = [k["last_used_at"] for k in keys_of(served, user) if k["id"] == first["id"]]
        shown = admin.evaluate("iso => new Date(iso).toLocaleString()", used_at)
        expect(row.locator("td").nth(2)).to_have_text(shown)
        other = admin.locator(f'#user-keys-table tr[data-key="{second["id"]}"]')
        expect(other.locator("td").nth(2)).to_have_text("never")


def test_copy_puts_the_key_on_the_clipboard_or_selects_it(
    admin: Page, served: ControlPlane
) -> None:
    user = "key-copier"
    admin.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=served.url)
    admin.goto(f"{served.url}/ui/#/users/{user}")
    expect(admin.locator(f'#view[data-ready="users/{user}"]')).to_have_count(1)
    secret, first = create_key_in_ui(admin, served, user, set())
    admin.get_by_role("button", name="Copy").click()
    expect(admin.locator("#new-key-status")).to_have_text("Copied to the clipboard.")
    assert admin.evaluate("navigator.clipboard.readText()") == secret
    # Without a clipboard (plain http to a host that is not this machine): the key is
    # selected for the operator's own Ctrl+C.
    admin.add_init_script(
        "Object.defineProperty(Navigator.prototype, 'clipboard', { get: () => undefined })"
    )
    admin.reload()
    expect(admin.locator(f'#view[data-ready="users/{user}"]')).to_have_count(1)
    secret, _ = create_key_in_ui(admin, served, user, {first["id"]})
    admin.get_by_role("button", name="Copy").click()
    expect(admin.locator("#new-key-status")).to_contain_text("selected: press Ctrl+C")
    selection = admin.evaluate(
        """() => { const i = document.getElementById('new-key');
        return [document.activeElement === i, i.selectionStart, i.selectionEnd]; }"""
    )
    assert selection == [True, 0, len(secret)]


def test_api_keys_at_phone_size_by_keyboard(browser: Browser, served: ControlPlane) -> None:
    user = "key-phone"
    ensure_key(served, user)
    with watched_page(browser, PHONE) as watched:
        page = watched.page
        sign_in(page, served, view=f"users/{user}")
        expect(page.locator(f'#view[data-ready="users/{user}"]')).to_have_count(1)
        revoke = page.get_by_role("button", name=re.compile("^Revoke API key "))
        revoke.first.focus()
        page.keyboard.press("Tab")
        create = page.get_by_role("button", name="Create key")
        expect(create).to_be_focused()
        page.keyboard.press("Enter")
        expect(page.locator("#new-key")).to_be_focused()
        page.keyboard.press("Tab")
        expect(page.get_by_role("button", name="Copy")).to_be_focused()
        page.keyboard.press("Tab")
        done = page.get_by_role("button", name="Done: hide the key")
        expect(done).to_be_focused()
        expect(page.locator("#user-keys-table tbody tr")).to_have_count(2)
        # At 390 px the rows stack as cards: every cell, the key and its buttons on screen.
        width = PHONE["width"]
        assert page.evaluate("document.documentElement.scrollWidth") <= width
        cells = page.locator("#user-keys-table td, #new-key, #new-key-copy, #new-key-done")
        assert cells.count() == 2 * 4 + 3
        for box in [cells.nth(i).bounding_box() for i in range(cells.count())]:
            assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width, box
        labels = page.locator("#user-keys-table td").evaluate_all(
            "tds => tds.map(td => getComputedStyle(td, '::before').content)"
        )
        assert labels[:3] == ['"Key"', '"Created"', '"Last used"']
        page.keyboard.press("Enter")
        expect(page.locator("#new-key")).to_have_count(0)
        expect(create).to_be_focused()
        # Back to the newest key's Revoke; the dialog is keyboard operable (Escape cancels).
        page.keyboard.press("Shift+Tab")
        expect(revoke.last).to_be_focused()
        page.keyboard.press("Enter")
        expect(page.locator("#confirm-cancel")).to_be_focused()
        page.keyboard.press("Escape")
        expect(page.locator("#confirm")).to_be_hidden()
        assert len(keys_of(served, user)) == 2


# ---- history chart -------------------------------------------------------------------


def chart_state(page: Page) -> dict[str, Any]:
    return dict(
        page.evaluate(
            """() => { const c = document.querySelector('.chart');
            return { canvases: c.querySelectorAll('canvas').length,
                     series: Number(c.dataset.series), points: Number(c.dataset.points),
                     swatches: [...document.querySelectorAll('.chart-summary tbody tr')].map(
                        r => [r.dataset.user, r.querySelector('.swatch').style.background]) }; }"""
        )
    )


def test_the_history_chart_draws_from_stored_history_after_a_reload(
    admin: Page, served: ControlPlane
) -> None:
    admin.goto(f"{served.url}/ui/#/overview")
    expect(admin.locator(".chart canvas")).to_have_count(1)
    expect(admin.locator(".chart-summary tbody tr")).to_have_count(8)
    first = chart_state(admin)
    # An hour of minutes, through the current one.
    assert first["series"] == 8 and first["points"] in (61, 62)
    # The three most throttled users of the history lead the list.
    users = [u for u, _ in first["swatches"]]
    assert set(users[:3]) == set(HISTORY_USERS[:3])
    colours = [c for _, c in first["swatches"]]
    assert len(set(colours)) == 8
    admin.reload()
    expect(admin.locator(".chart-summary tbody tr")).to_have_count(8)
    assert chart_state(admin)["swatches"] == first["swatches"]
    # The y axis is labelled, and the 24 h range uses 10-minute buckets.
    expect(admin.locator(".chart")).to_have_attribute(
        "aria-label", re.compile("^% of the user's limit of the 8 most throttled users")
    )
    admin.get_by_role("button", name="24 h").click()
    expect(admin.locator(".chart")).to_have_attribute("data-points", re.compile("^14[56]$"))
    # One user's page: its rate against its limit, with the disconnect as a gap.
    admin.goto(f"{served.url}/ui/#/users/user-00003")
    expect(admin.locator(".chart canvas")).to_have_count(1)
    expect(admin.locator(".chart")).to_have_attribute("data-series", "2")
    history = api(
        served, "GET", "/usage/history", params={"user": "user-00003", "since": _ago(3600)}
    ).json()
    rates = history["items"][0]["output_tokens_per_second"]
    assert rates.count(None) >= 6  # the disconnected minutes are gaps, not zeros
    assert 0 not in rates


def _ago(seconds: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(time.time() - seconds, UTC).isoformat()


def test_keyboard_only(admin: Page, served: ControlPlane) -> None:
    admin.goto(f"{served.url}/ui/#/overview")
    admin.reload()  # a fresh load: the focus starts at the top of the page
    expect(admin.locator("#fleet-rate")).to_be_visible()
    # From the top of the page to the user-id box: a handful of Tabs, not 114.
    presses = 0
    admin.keyboard.press("Tab")
    while presses < 30 and not admin.evaluate("document.activeElement.textContent === 'Users'"):
        admin.keyboard.press("Tab")
        presses += 1
    admin.keyboard.press("Enter")
    expect(admin.get_by_role("heading", name="Users", exact=True)).to_be_focused()
    # The view's heading has the focus; the user-id box is the next stop.
    admin.keyboard.press("Tab")
    expect(admin.locator("#open-user")).to_be_focused()
    admin.keyboard.type("user-00002")
    admin.keyboard.press("Enter")
    expect(admin.get_by_role("heading", name="User user-00002")).to_be_visible()
    assert presses < 12
    # The confirmation dialog is keyboard operable: Escape cancels.
    admin.goto(f"{served.url}/ui/#/tiers")
    admin.get_by_role("button", name="Edit tier pro").focus()
    admin.keyboard.press("Enter")
    # The form is drawn from the tier as the server has it now (with its ETag), then its
    # heading takes the focus.
    expect(admin.locator("#tier-edit-title")).to_be_focused()
    admin.keyboard.press("Tab")  # to the first radio ("Limit")
    admin.keyboard.press("Tab")
    admin.keyboard.type("7")
    admin.keyboard.press("Backspace")
    admin.keyboard.press("Backspace")
    admin.keyboard.press("Backspace")
    admin.keyboard.type("7")
    admin.keyboard.press("Enter")
    count = f"{tier(served, 'pro')['num_users']:,} users"
    expect(admin.locator("#confirm")).to_contain_text(f"{count}: 100 → 7 tok/s")
    expect(admin.locator("#confirm-cancel")).to_be_focused()
    admin.keyboard.press("Escape")
    expect(admin.locator("#confirm")).to_be_hidden()
    assert tier(served, "pro")["output_tokens_per_second"] == 100


# ---- screenshots ---------------------------------------------------------------------


def test_every_view_at_both_sizes(
    browser: Browser, served: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Screenshots for a person to look at (the path is printed), with live usage from two
    engines; every view fits the width of a 390 px phone."""
    kind = "postgres" if "postgresql" in served.db_url else "sqlite"
    out = Path(os.environ.get("OUTPUT_RATE_UI_SCREENSHOTS") or tmp_path_factory.mktemp("shots"))
    out = out / kind
    out.mkdir(parents=True, exist_ok=True)
    live = {f"user-{i:05d}": 20 + 3 * i for i in range(60)}
    ensure_key(served, "user-00001")  # the user page with its keys listed
    with (
        live_engine(served, "engine-a", dict(list(live.items())[:40])),
        live_engine(served, "engine-b", dict(list(live.items())[20:])),
    ):
        for name, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
            with watched_page(browser, viewport) as watched:
                page = watched.page
                sign_in(page, served)
                page.locator("#toast").evaluate("t => t.hidden = true")
                for view in VIEWS:
                    page.goto(f"{served.url}/ui/#/{view}")
                    # Set once the view rendered its data (a hash change is no page load).
                    expect(page.locator(f'#view[data-ready="{view}"]')).to_have_count(1)
                    if view == "overview":
                        expect(page.locator("#live-usage tbody tr")).to_have_count(10)
                    if view in ("overview", "users/user-00001"):
                        expect(page.locator(".chart canvas")).to_have_count(1)
                    width = page.evaluate("document.documentElement.scrollWidth")
                    assert width <= viewport["width"], (view, name, width)
                    path = out / f"{view.replace('/', '-')}-{name}.png"
                    page.screenshot(path=str(path), full_page=True)
    print(f"\nUI screenshots: {out}")
