"""The admin UI in real headless Chromium against a real `output-rate serve`.

The engine is a real protocol peer on the push endpoint (a ZMQ DEALER speaking
engine_ext.protocol), so the engines and usage views show real reports.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator

import httpx
import pytest
import zmq
from playwright.sync_api import Page, expect, sync_playwright

from engine_ext import protocol as p
from harness.servers import ControlPlane, free_port

TOKEN = ControlPlane.TOKEN
# Generous: the UI polls once a second and CI shares two cores with the server.
expect.set_options(timeout=15_000)
DASH = "\u2013"  # the UI writes ranges with an en dash
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


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    tmp = tmp_path_factory.mktemp("ui")
    server = ControlPlane(tmp / "cp.log", f"sqlite:///{tmp / 'ui.db'}", free_port(), free_port())
    server.wait_ready()
    yield server
    server.kill()


@pytest.fixture
def page(served: ControlPlane) -> Iterator[Page]:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page()
        page.goto(f"{served.url}/ui/")
        page.fill("#token", TOKEN)
        page.click("#token-form button")
        yield page
        browser.close()


def test_tiers_users_and_default_are_managed_from_the_ui(page: Page, served: ControlPlane) -> None:
    page.fill("#tier-name", "gold")
    page.fill("#tier-rate", "50")
    page.fill("#tier-description", "paid")
    page.click("#tier-form button")
    expect(page.locator('#tiers tr[data-tier="gold"]')).to_contain_text("50")

    page.fill("#user-id", "alice")
    page.select_option("#user-tier", "gold")
    page.click("#user-form button")
    row = page.locator('#users tr[data-user="alice"]')
    expect(row).to_contain_text("gold")
    expect(row).to_contain_text("tier")
    expect(page.locator('#tiers tr[data-tier="gold"]')).to_contain_text("1")

    page.fill("#default-rate", "7")
    page.click("#default-form button")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        default = httpx.get(f"{served.url}/default-limit", headers=headers).json()
        if default["output_tokens_per_second"] == 7:
            break
        time.sleep(0.1)
    assert default["output_tokens_per_second"] == 7
    assert (
        httpx.get(f"{served.url}/limits/alice", headers=headers).json()[
            "effective_output_tokens_per_second"
        ]
        == 50
    )

    # Bad input is refused by the server with the field named; nothing changes.
    page.fill("#tier-name", "bad name!")
    page.fill("#tier-rate", "5")
    page.click("#tier-form button")
    expect(page.locator("#status")).to_contain_text("name")
    expect(page.locator("#status")).to_have_class("error")
    expect(page.locator("#tiers tbody tr")).to_have_count(1)
    # The once-a-second live poll succeeding twice does not wipe the error.
    for _ in range(2):
        with page.expect_response(lambda r: "/usage" in r.url and r.ok):
            pass
    expect(page.locator("#status")).to_contain_text("name")

    # A tier in use cannot be deleted; after removing the user it can.
    page.click('#tiers tr[data-tier="gold"] button')
    expect(page.locator("#status")).to_contain_text("409")
    page.click('#users tr[data-user="alice"] button')
    expect(page.locator('#users tr[data-user="alice"]')).to_have_count(0)
    page.click('#tiers tr[data-tier="gold"] button')
    expect(page.locator('#tiers tr[data-tier="gold"]')).to_have_count(0)


def test_users_are_paged_with_a_cursor(page: Page, served: ControlPlane) -> None:
    users = [f"page-{i:03d}" for i in range(250)]
    response = httpx.post(
        f"{served.url}/limits:bulk",
        json={"items": [{"user": u, "output_tokens_per_second": 5} for u in users]},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert response.status_code == 200
    page.fill("#search", "page-")
    page.click("#search-form button[type=submit]")
    rows = page.locator("#users tbody tr")
    total = page.locator("#users-total")
    expect(total).to_contain_text(f"250 configured users (showing 1{DASH}100)")
    expect(rows).to_have_count(100)
    expect(page.locator("#users-prev")).to_be_disabled()

    page.click("#users-next")
    expect(total).to_contain_text(f"(showing 101{DASH}200)")
    expect(rows.first).to_have_attribute("data-user", "page-100")
    page.click("#users-next")
    expect(total).to_contain_text(f"(showing 201{DASH}250)")
    expect(rows).to_have_count(50)
    expect(rows.last).to_have_attribute("data-user", "page-249")
    expect(page.locator("#users-next")).to_be_disabled()

    page.click("#users-prev")
    expect(total).to_contain_text(f"(showing 101{DASH}200)")
    expect(rows.first).to_have_attribute("data-user", "page-100")
    # A new search starts again from the first page.
    page.click("#search-form button[type=submit]")
    expect(rows.first).to_have_attribute("data-user", "page-000")


def test_engines_and_live_usage_from_a_real_protocol_peer(page: Page, served: ControlPlane) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(served.zmq_endpoint)
    try:
        sock.send(p.encode(p.Hello("ui-engine", "tiny", 0)))
        assert sock.poll(10_000)
        snapshot = p.decode(sock.recv())
        assert isinstance(snapshot, p.Snapshot)
        sock.send(p.encode(p.Ack("ui-engine", snapshot.version)))
        engine_row = page.locator('#engines tr[data-engine="ui-engine"]')
        expect(engine_row).to_contain_text(str(snapshot.version), timeout=10_000)
        expect(engine_row).to_contain_text("yes")
        for _ in range(3):
            sock.send(p.encode(p.Usage("ui-engine", 1.0, {"bob": 42}, {"bob": 5})))
            time.sleep(1.0)
        expect(page.locator('#usage tr[data-user="bob"]')).to_contain_text("42", timeout=10_000)
        expect(page.locator("#chart canvas")).to_have_count(1)
    finally:
        sock.close()
        context.term()
