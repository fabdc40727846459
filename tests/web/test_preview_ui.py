"""The console's confirmations show what the server previews (?dry_run=true), in real
headless Chromium against a real `output-rate serve` (SQLite; the preview itself is
tested on both databases in tests/control_plane/limits/test_preview.py) with 5,000
users in 4 tiers and an hour of usage history.

Requests are counted from the page (Playwright's request events): a 10,000-line import is
previewed in one POST /limits:bulk?dry_run=true, bad lines are named before any
confirmation, and nothing is written until the operator confirms.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, Request, expect

from harness.control_plane import fresh_database
from harness.servers import ControlPlane, free_port
from tests.web.browser import DESKTOP, PHONE, shot, sign_in, watched_page
from tests.web.fleet import seed, write_history

HEADERS = ControlPlane.auth_headers()
expect.set_options(timeout=20_000)
# user-00005..: 21 tok/s and more in each minute, over the free tier's 10.
HISTORY_USERS = [f"user-{i:05d}" for i in range(12)]
BULK = "/limits:bulk"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    tmp = tmp_path_factory.mktemp("preview-ui")
    with fresh_database("sqlite", tmp) as url:
        server = ControlPlane(tmp / "cp.log", url, free_port(), free_port())
        server.wait_ready()
        try:
            seed(server)
            write_history(url, users=HISTORY_USERS, minutes=30)
            yield server
        finally:
            server.kill()


def api(served: ControlPlane, method: str, path: str, **kwargs: Any) -> httpx.Response:
    headers = {**HEADERS, **kwargs.pop("headers", {})}
    return httpx.request(method, f"{served.url}{path}", headers=headers, timeout=60, **kwargs)


def version(served: ControlPlane) -> int:
    return int(api(served, "GET", "/default-limit").json()["version"])


def bulk_posts(page: Page) -> list[str]:
    """The URLs of the page's POST /limits:bulk requests, as they are sent."""
    sent: list[str] = []

    def on_request(request: Request) -> None:
        if request.method == "POST" and BULK in request.url:
            sent.append(request.url)

    page.on("request", on_request)
    return sent


def import_csv() -> str:
    """10,000 lines with a header: the 5,000 seeded users moved to free with no override
    (every other id quoted), and 5,000 new users in basic."""
    lines = ["user,tier,override,scope,enforcement"]
    for i in range(5000):
        user = f"user-{i:05d}"
        lines.append(f'"{user}",free,,,' if i % 2 else f"{user},free")
    lines += [f"new-{i:05d},basic,,fleet,enforce" for i in range(5000)]
    return "\n".join(lines) + "\n"


def test_tier_rate_change_confirmation_shows_the_cut_count(
    browser: Browser, served: ControlPlane
) -> None:
    api(served, "PUT", "/tiers/gold", json={"output_tokens_per_second": 100}).raise_for_status()
    items = [{"user": f"gold-{i:02d}", "tier": "gold"} for i in range(30)]
    items[0]["output_tokens_per_second"] = 500  # keeps its override: not cut
    api(served, "POST", BULK, json={"items": items}).raise_for_status()
    with watched_page(browser) as watched:
        page = watched.page
        sign_in(page, served, "tiers")
        page.get_by_role("button", name="Edit tier gold").click()
        page.fill("#edit-rate-rate", "40")
        page.get_by_role("button", name="Save tier gold").click()
        dialog = page.locator("#confirm")
        expect(dialog).to_be_visible()
        expect(dialog).to_contain_text("30 users: 100 → 40 tok/s")
        expect(page.locator("#preview-counts")).to_have_text(
            "29 users held to a lower rate, 0 to a higher one, 0 unchanged."
        )
        expect(page.locator("#preview-cuts li").first).to_have_text("gold-01: 100 tok/s → 40 tok/s")
        dialog.get_by_role("button", name="Cancel").click()
        assert api(served, "GET", "/tiers/gold").json()["output_tokens_per_second"] == 100
        page.get_by_role("button", name="Save tier gold").click()
        dialog.get_by_role("button", name="Set gold to 40 tok/s").click()
        expect(page.locator("#toast")).to_contain_text("rate 100 tok/s → 40 tok/s")
        assert api(served, "GET", "/tiers/gold").json()["output_tokens_per_second"] == 40
        # shadow -> enforce holds every user of the tier (gold-00 too, at its override):
        # unlimited -> a rate, equal cuts by user id.
        api(served, "PATCH", "/tiers/gold", json={"enforcement": "shadow"}).raise_for_status()
        page.reload()
        expect(page.locator('#tiers tr[data-tier="gold"]')).to_contain_text("(shadow)")
        page.get_by_role("button", name="Edit tier gold").click()
        page.select_option("#edit-enforcement", "enforce")
        page.get_by_role("button", name="Save tier gold").click()
        expect(page.locator("#preview-counts")).to_have_text(
            "30 users held to a lower rate, 0 to a higher one, 0 unchanged."
        )
        # Titled by what changes, and worded as what holds whom: 30 -> 30 no more.
        expect(dialog.locator("#confirm-title")).to_have_text("Enforce the limit of tier gold?")
        expect(page.locator("#preview-cuts li").first).to_have_text(
            "gold-00: unlimited (shadow 500 tok/s) → 500 tok/s enforced"
        )
        expect(dialog).not_to_contain_text("keep their own rate")
        expect(page.locator("#preview-csv")).to_have_text("Download all 30 users as CSV")
        shot(page, "preview-tier-enforce")
        dialog.get_by_role("button", name="Set the enforcement of gold to enforce").click()
        expect(page.locator("#toast")).to_contain_text("enforcement shadow → enforce")
    assert api(served, "GET", "/tiers/gold").json()["enforcement"] == "enforce"


def test_the_users_held_back_now_come_first_and_the_full_list_downloads_as_csv(
    browser: Browser, served: ControlPlane
) -> None:
    """Equal cuts are listed by user id, but a user who used more than the new limit in
    the last hour is named before them; the CSV holds every listed user."""
    api(served, "PUT", "/tiers/silver", json={"output_tokens_per_second": 100}).raise_for_status()
    items = [{"user": f"silver-{i}", "tier": "silver"} for i in range(5)]
    api(served, "POST", BULK, json={"items": items}).raise_for_status()
    write_history(served.db_url, users=["silver-3"], minutes=5)  # 6-10 tok/s a minute
    with watched_page(browser) as watched:
        page = watched.page
        sign_in(page, served, "tiers")
        page.get_by_role("button", name="Edit tier silver").click()
        page.fill("#edit-rate-rate", "5")
        page.get_by_role("button", name="Save tier silver").click()
        dialog = page.locator("#confirm")
        expect(dialog.locator("#confirm-title")).to_have_text("Change the rate of tier silver?")
        cuts = page.locator("#preview-cuts li")
        expect(cuts).to_have_count(5)
        expect(cuts.first).to_contain_text("silver-3: 100 tok/s → 5 tok/s; used up to")
        expect(cuts.nth(1)).to_have_text("silver-0: 100 tok/s → 5 tok/s")
        with page.expect_download() as download:
            page.locator("#preview-csv").click()
        lines = Path(download.value.path()).read_text().splitlines()
        assert lines[0].startswith("user,change,before,after,")
        assert sorted(line.split(",")[0] for line in lines[1:]) == [f"silver-{i}" for i in range(5)]
        assert all(",down,100 tok/s,5 tok/s," in line for line in lines[1:])
        dialog.get_by_role("button", name="Cancel").click()
    assert api(served, "GET", "/tiers/silver").json()["output_tokens_per_second"] == 100


def test_a_bad_csv_names_its_line_before_any_confirmation_and_writes_nothing(
    browser: Browser, served: ControlPlane
) -> None:
    at = version(served)
    lines = [f"bad-{i},free" for i in range(1, 11)]
    lines[6] = "bad-7,free,,,,,extra"  # line 7: a seventh column
    lines[8] = "bad-9,nope"  # line 9: an unknown tier
    with watched_page(browser, refusals=(422,)) as watched:
        page = watched.page
        sign_in(page, served, "users")
        sent = bulk_posts(page)
        page.fill("#bulk-text", "\n".join(lines))
        page.get_by_role("button", name="Preview and import").click()
        error = page.locator("#bulk-form .field-error")
        expect(error).to_contain_text("Line 7: 7 fields; at most 6")
        expect(error).to_contain_text("Line 9: Tier: unknown tier 'nope'")
        expect(page.locator("#bulk-text")).to_have_attribute("aria-invalid", "true")
        expect(page.locator("#confirm")).to_be_hidden()
        assert len(sent) == 1 and "dry_run=true" in sent[0]
    assert version(served) == at
    assert api(served, "GET", "/limits", params={"q": "bad-"}).json()["total"] == 0


def test_a_10000_line_import_previews_in_one_request_then_applies(
    browser: Browser, served: ControlPlane
) -> None:
    # A user with a large override the import drops: the largest cut, listed first (its
    # history is over the free tier's 10 tok/s in every minute).
    api(served, "PUT", "/limits/user-00005", json={"tier": "pro", "output_tokens_per_second": 9000})
    text = import_csv()
    expected = api(
        served, "POST", f"{BULK}?dry_run=true", content=text, headers={"Content-Type": "text/csv"}
    ).json()
    assert expected["num_users"] == 10_000 and expected["num_created"] == 5000
    # The seeded users already in free with no override: their lines change nothing.
    pages = (
        api(served, "GET", "/limits", params={"tier": "free", "limit": 1000, "offset": o}).json()
        for o in range(0, 5000, 1000)
    )
    num_kept = sum(
        item["output_tokens_per_second"] is None and item["user"].startswith("user-")
        for page in pages
        for item in page["items"]
    )
    assert 0 < num_kept == expected["num_records_unchanged"]
    at = version(served)
    shots = os.environ.get("OUTPUT_RATE_UI_SCREENSHOTS")
    for name, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
        with watched_page(browser, viewport) as watched:
            page = watched.page
            sign_in(page, served, "users")
            sent = bulk_posts(page)
            # As a paste would put it there (typing 330 KB through fill() takes minutes).
            page.locator("#bulk-text").evaluate("(el, text) => { el.value = text; }", text)
            page.get_by_role("button", name="Preview and import").click()
            dialog = page.locator("#confirm")
            expect(dialog).to_be_visible()
            assert len(sent) == 1 and sent[0].endswith(f"{BULK}?dry_run=true"), sent
            expect(dialog).to_contain_text("Import 10,000 users?")
            expect(dialog).to_contain_text(
                f"{5000 - num_kept:,} existing users: their records are replaced."
            )
            expect(dialog).to_contain_text(
                f"{num_kept:,} lines equal to the stored record: nothing changes."
            )
            expect(page.locator("#preview-counts")).to_have_text(
                f"{expected['num_down']:,} users held to a lower rate, "
                f"{expected['num_up']:,} to a higher one, {expected['num_same']:,} "
                "unchanged, 5,000 new."
            )
            expect(page.locator("#preview-over")).to_have_text(
                f"{expected['num_over_new_limit']} of them used more than the new limit in "
                "the last hour."
            )
            cuts = page.locator("#preview-cuts li")
            expect(cuts).to_have_count(21)  # 20 named, and "and N more"
            expect(cuts.first).to_have_text(
                "user-00005: 9,000 tok/s → 10 tok/s (override dropped); used up to "
                f"{math.floor(first_peak(expected) + 0.5)} tok/s in the last hour "
                f"({first_minutes(expected)} minutes over)"
            )
            expect(cuts.last).to_have_text(
                f"and {expected['num_down'] - 20:,} more (in the CSV below)"
            )
            expect(page.locator("#preview-dropped li").first).to_have_text(
                "user-00005: 9,000 tok/s"
            )
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= viewport["width"], (name, width)
            if shots:
                Path(shots).mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(Path(shots) / f"preview-{name}.png"))
            if name == "desktop":
                dialog.get_by_role("button", name="Cancel").click()
                expect(page.locator("#toast")).to_contain_text("Not imported.")
                assert len(sent) == 1 and version(served) == at
                continue
            dialog.get_by_role("button", name="Import 10,000 users").click()
            # Seeded users already in free with nothing else set are not changed.
            expect(page.locator("#toast")).to_contain_text(
                re.compile(rf"Imported: [0-9,]+ users changed \(version {at + 1}\)"),
                timeout=60_000,
            )
            assert [BULK in u and "dry_run" not in u for u in sent] == [False, True]
    assert version(served) == at + 1
    moved = api(served, "GET", "/limits/user-00005").json()
    assert (moved["tier"], moved["output_tokens_per_second"]) == ("free", None)
    assert api(served, "GET", "/limits/new-04999").json()["tier"] == "basic"


def first_peak(preview: dict[str, Any]) -> float:
    return float(preview["items"][0]["last_hour"]["peak_output_tokens_per_second"])


def first_minutes(preview: dict[str, Any]) -> int:
    minutes = int(preview["items"][0]["last_hour"]["num_minutes_over_new_limit"])
    assert minutes == 30  # every minute of its history
    return minutes


def test_default_change_confirmation_shows_whom_it_holds(
    browser: Browser, served: ControlPlane
) -> None:
    # A record with neither tier nor override follows the default (5 tok/s, seeded).
    api(served, "PUT", "/limits/loose-1", json={"scope": "engine"}).raise_for_status()
    with watched_page(browser) as watched:
        page = watched.page
        sign_in(page, served, "tiers")
        sent: list[str] = []
        page.on("request", lambda r: sent.append(r.url) if r.method == "PUT" else None)
        page.fill("#default-rate-rate", "3")
        page.get_by_role("button", name="Save default limit").click()
        dialog = page.locator("#confirm")
        expect(dialog).to_be_visible()
        expect(page.locator("#preview-counts")).to_have_text(
            "1 user held to a lower rate, 0 to a higher one, 0 unchanged."
        )
        expect(page.locator("#preview-cuts li").first).to_have_text("loose-1: 5 tok/s → 3 tok/s")
        assert sent == [f"{served.url}/default-limit?dry_run=true"]
        dialog.get_by_role("button", name="Cancel").click()
    assert api(served, "GET", "/default-limit").json()["output_tokens_per_second"] == 5
