"""The bounds on creating API keys, as the admin UI says them, against a real
`output-rate serve` set tight: two live keys per user, three creations at once and then
one a minute. (The rest of the keys UI is in test_admin_ui.py, on both databases.)"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, expect

from harness.servers import ControlPlane, free_port
from tests.web.browser import watched_page
from tests.web.test_admin_ui import keys_of, sign_in

MAX_KEYS_PER_USER = 2
BURST = 3


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    tmp = tmp_path_factory.mktemp("keys-ui")
    server = ControlPlane(
        tmp / "cp.log",
        f"sqlite:///{tmp / 'ui.db'}",
        free_port(),
        free_port(),
        extra_env={
            "OUTPUT_RATE_MAX_KEYS_PER_USER": str(MAX_KEYS_PER_USER),
            "OUTPUT_RATE_KEY_CREATIONS_PER_MINUTE": "1",
            "OUTPUT_RATE_KEY_CREATION_BURST": str(BURST),
        },
    )
    server.wait_ready()
    yield server
    server.kill()


def test_the_per_user_cap_and_the_creation_rate_are_said_plainly(
    browser: Browser, served: ControlPlane
) -> None:
    # The cap and the rate are refused by the server itself: the page sees a 409 and a 429.
    with watched_page(browser, refusals=(409, 429)) as watched:
        page = watched.page
        sign_in(page, served, view="users/capped")
        create = page.get_by_role("button", name="Create key")
        rows = page.locator("#user-keys-table tbody tr")
        for n in range(1, MAX_KEYS_PER_USER + 1):
            create.click()
            expect(rows).to_have_count(n)
        shown = page.locator("#new-key").input_value()
        create.click()
        error = page.locator("#key-create .field-error")
        expect(error).to_have_text(
            re.compile(
                rf"^User id: 'capped' already has {MAX_KEYS_PER_USER} API keys, the most one "
                r"user may hold .*; revoke one first$"
            )
        )
        # Nothing was made, and the key shown before the refusal is still there.
        assert len(keys_of(served, "capped")) == MAX_KEYS_PER_USER
        expect(page.locator("#new-key")).to_have_value(shown)

        # The cap took no creation: the burst's last one is left, then one a minute.
        page.goto(f"{served.url}/ui/#/users/fast")
        expect(page.locator('#view[data-ready="users/fast"]')).to_have_count(1)
        create.click()
        expect(rows).to_have_count(BURST - MAX_KEYS_PER_USER)
        create.click()
        expect(error).to_have_text(
            re.compile(r"^API keys are being created faster .* Try again in \d+ seconds\.$")
        )
        wait_s = int(re.findall(r"in (\d+) seconds", error.inner_text())[0])
        assert 1 <= wait_s <= 60
        assert len(keys_of(served, "fast")) == BURST - MAX_KEYS_PER_USER
