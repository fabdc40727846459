"""One user's chart notes the changes its audit log records, never values read off bucket
averages, and draws its limit as set (per engine for an engine-scoped user), in headless
Chromium at desktop and phone width against a real `output-rate serve`.

History is written through the real recorder (UsageRecorder.add with real Usage reports)
with a fake clock, the one seam: it stands for the control plane's clock so that reports
can be placed minutes in the past around real changes made through the API, in the middle
of a minute (where a bucket's time-weighted limit is neither the old nor the new one); the
audit entries those changes wrote are moved to the same moments (their `at` only)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect
from sqlalchemy import func, select, update

from control_plane.db import Database
from control_plane.models import AuditEntry
from harness.servers import ControlPlane
from output_rate_core import protocol as p
from tests.web.browser import DESKTOP, PHONE, served_on_sqlite, sign_in, watched_page
from tests.web.fleet import Backdated, live_engine

HEADERS = ControlPlane.auth_headers()
expect.set_options(timeout=30_000)
OVERRIDE = "override-change"  # override 20, then 60 from the middle of a minute
LONG = "long-" + "x" * 115  # a 120-character id: override 30, then 22
SCOPE = "scope-change"  # override 100 on fleet scope, then engine scope; two engines report
ENGINE = "engine-scoped"  # override 800 on engine scope, two engines report
IDLE = "idle-user"  # a limit, no usage
MINUTES = 20
# (user, engine) -> tokens granted per second
RATES = {
    (OVERRIDE, "e1"): 15,
    (LONG, "e1"): 18,
    (SCOPE, "e1"): 40,
    (SCOPE, "e2"): 40,
    (ENGINE, "e1"): 300,
    (ENGINE, "e2"): 300,
}
CHANGES = {
    OVERRIDE: {"output_tokens_per_second": 60},
    LONG: {"output_tokens_per_second": 22},
    SCOPE: {"scope": "engine"},
}


def api(served: ControlPlane, method: str, path: str, **kwargs: Any) -> httpx.Response:
    response = httpx.request(method, f"{served.url}{path}", headers=HEADERS, timeout=60, **kwargs)
    response.raise_for_status()
    return response


def date_audit(db: Database, *, after_id: int, at: float) -> int:
    """Move the audit entries after `after_id` to unix time `at`; the newest entry's id."""
    when = datetime.fromtimestamp(at, UTC)
    with db.engine.begin() as conn:
        conn.execute(update(AuditEntry).where(AuditEntry.id > after_id).values(at=when))
        return conn.execute(select(func.max(AuditEntry.id))).scalar_one()


def write_reports(served: ControlPlane) -> None:
    """Per second for the last MINUTES minutes, from each engine at RATES; the CHANGES
    made through the API 30 s into the minute that began 10 minutes ago (the users were
    made before the range)."""
    history = Backdated(served.db_url, minutes=MINUTES)
    change_at = (int(history.now) // 60 - 10) * 60 + 30
    made = date_audit(history.db, after_id=0, at=history.start - 3600)
    changed = False
    for now in history.seconds():
        if not changed and now >= change_at:
            for user, change in CHANGES.items():
                api(served, "PATCH", f"/limits/{user}", json=change)
            date_audit(history.db, after_id=made, at=change_at)
            history.recorder.refresh_limits()
            changed = True
        for engine in ("e1", "e2"):
            granted = {u: r for (u, e), r in RATES.items() if e == engine}
            history.recorder.add(p.Usage(engine, 1.0, granted, {}))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with served_on_sqlite(tmp_path_factory.mktemp("chart-changes-ui")) as server:
        for user, limit in ((OVERRIDE, 20), (LONG, 30), (SCOPE, 100), (IDLE, 50)):
            api(server, "PUT", f"/limits/{user}", json={"output_tokens_per_second": limit})
        api(
            server,
            "PUT",
            f"/limits/{ENGINE}",
            json={"output_tokens_per_second": 800, "scope": "engine"},
        )
        write_reports(server)
        yield server


def notes(page: Page, user: str) -> list[str]:
    page.goto(page.url.split("#")[0] + f"#/users/{user}")
    expect(page.locator(f'#view[data-ready="users/{user}"]')).to_have_count(1)
    expect(page.locator("#chart-latest")).to_be_visible()
    return page.locator(".chart-change").all_text_contents()


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_the_chart_notes_the_changes_that_were_made_and_nothing_else(
    browser: Browser, served: ControlPlane, viewport: dict[str, int]
) -> None:
    # Two engines connected: the engine-scoped limit holds on each.
    with (
        live_engine(served, "e1", {}),
        live_engine(served, "e2", {}),
        watched_page(browser, viewport) as watched,
    ):
        page = watched.page
        sign_in(page, served, view=f"users/{OVERRIDE}")
        # One change, said as set (a bucket spanning it averages 20 and 60).
        (note,) = notes(page, OVERRIDE)
        assert note.endswith("override 20 tok/s → 60 tok/s"), note
        assert "would throttle" not in page.locator("#chart-latest").inner_text()
        expect(page.locator("#chart-latest")).to_contain_text("(60 tok/s)")
        # Never in shadow: nothing "while in shadow".
        expect(page.locator("#user-would-throttle")).not_to_contain_text("while in shadow")
        expect(page.locator("#user-would-throttle")).to_contain_text("this user is enforced")

        (note,) = notes(page, LONG)
        assert note.endswith("override 30 tok/s → 22 tok/s"), note
        assert page.evaluate("document.documentElement.scrollWidth") <= viewport["width"]

        # A scope-only change is no rate change (the history's limit doubles: two engines).
        (note,) = notes(page, SCOPE)
        assert note.endswith("scope inherited → engine"), note
        expect(page.locator("#chart-latest")).to_contain_text(
            "(100 tok/s per engine (2 engines connected))"
        )

        # An engine-scoped limit is the limit per engine, with the engines, never the sum.
        assert notes(page, ENGINE) == []
        latest = page.locator("#chart-latest")
        expect(latest).to_contain_text("(800 tok/s per engine (2 engines connected))")
        expect(latest).not_to_contain_text("1,6")
        expect(page.locator(".chart")).to_have_attribute(
            "aria-label",
            f"{ENGINE}: output tokens/s against its limit (800 tok/s per engine "
            "(2 engines connected)) over time, last 1 h",
        )

        # An idle user: no empty axes, the chart says so.
        assert notes(page, IDLE) == []
        expect(page.locator("#chart-latest")).to_have_text("No usage in this period.")
        expect(page.locator(".chart")).to_be_hidden()
