"""The web console (skmq/http/ui.py, docs/OPERATIONS.md "Web console"): its files as
served, and the page itself in a real browser (Debian's chromium, driven by Playwright)
against a real broker with auth on, a recipient and traffic."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from skmq.broker import Broker
from tests.conftest import BrokerFactory, free_port
from tests.peers import FakeRecipient, RawClient
from tests.test_auth import authed

CHROMIUM = "/usr/bin/chromium"
ADMIN = "console-admin-token-0123456789abcdef"
PRODUCER = "console-producer-token-0123456789ab"
SHOTS = Path(__file__).resolve().parent.parent / "test-output" / "console"
POISON = '<img src=x onerror="window.pwned=1">poison <script>window.pwned=1</script>'


@pytest.fixture
async def console(make_broker: BrokerFactory, tmp_path: Path) -> Broker:
    """A broker with auth on (an admin token, and a producer's that may not administer)
    and its gateway on a port of its own."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[[tokens]]\nname = "ops"\ntoken = "{ADMIN}"\napps = ["*"]\n'
        'roles = ["admin", "consume", "produce"]\n'
        f'[[tokens]]\nname = "shop"\ntoken = "{PRODUCER}"\napps = ["*"]\nroles = ["produce"]\n'
    )
    return await make_broker(http_port=free_port(), auth_file=tokens)


def gateway(broker: Broker) -> str:
    return f"http://127.0.0.1:{broker.gateway.port}"


# -- the files, over plain HTTP ------------------------------------------------------
async def test_the_page_and_its_files_are_served_without_a_token_with_a_csp(
    console: Broker,
) -> None:
    base = gateway(console)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/ui", allow_redirects=False) as r:
            assert (r.status, r.headers["Location"]) == (302, "ui/")
        bodies = {}
        for path, kind in (
            ("/ui/", "text/html"),
            ("/ui/console.js", "text/javascript"),
            ("/ui/console.css", "text/css"),
        ):
            async with http.get(base + path) as r:
                assert (r.status, r.content_type, r.charset) == (200, kind, "utf-8"), path
                assert r.headers["Content-Security-Policy"].startswith("default-src 'self';")
                assert r.headers["X-Content-Type-Options"] == "nosniff"
                bodies[path] = await r.text()
        html = bodies["/ui/"]
        assert 'src="console.js"' in html and 'href="console.css"' in html
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # nothing from elsewhere
        assert "innerHTML" not in bodies["/ui/console.js"]
        for missing in ("/ui/nope.js", "/ui/..%2Fgateway.py", "/ui/ui.py"):
            async with http.get(base + missing) as r:
                assert r.status == 404, missing
        # the page needs no token; what it reads does
        async with http.get(f"{base}/v1/apps/orders/dlq") as r:
            assert r.status == 401
        admin = {"Authorization": f"Bearer {ADMIN}"}
        async with http.get(f"{base}/v1/apps/orders/dlq", headers=admin) as r:
            assert r.status == 200


# -- the page, in a browser ----------------------------------------------------------
@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no {CHROMIUM}: apt-get install chromium (.ci/run installs it)")
    playwright = pytest.importorskip("playwright.async_api")
    async with playwright.async_playwright() as p:
        launched = await p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield launched
        await launched.close()


async def produce(http: aiohttp.ClientSession, base: str, app: str, body: dict[str, Any]) -> None:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with http.post(f"{base}/v1/apps/{app}/messages", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()


def batch(prefix: str, first: int, n: int) -> dict[str, Any]:
    return {"messages": [{"msgid": f"{prefix}{i}", "content": f"tick {i}"}
                         for i in range(first, first + n)]}  # fmt: skip


async def traffic(http: aiohttp.ClientSession, base: str, app: str) -> None:
    """Messages to `app` until cancelled, 10 a request."""
    for n in itertools.count(0, 10):
        await produce(http, base, app, batch("t", n, 10))
        await asyncio.sleep(0.05)  # a steady rate, not a wait for anything


@pytest.mark.timeout(120)
async def test_the_console_in_a_browser(console: Broker, browser: Any) -> None:
    base = gateway(console)
    rejecting = {"on": True}
    rec = FakeRecipient(
        "orders", "r1", lambda f: "reject" if rejecting["on"] and b"poison" in f.content else "ack"
    )
    await rec.start()
    client = await authed(console.server.port, ADMIN)
    try:
        async with aiohttp.ClientSession() as http:
            await look_and_act(browser, base, http, client, rec, rejecting)
    finally:
        await client.close()
        await rec.stop()


async def look_and_act(
    browser: Any,
    base: str,
    http: aiohttp.ClientSession,
    client: RawClient,
    rec: FakeRecipient,
    rejecting: dict[str, bool],
) -> None:
    from playwright.async_api import expect

    assert (await client.request("register", rec.registration()))["status"] == "ack"
    await produce(http, base, "orders", {"msgid": "poison-1", "content": POISON})
    await produce(http, base, "idle", batch("w", 0, 3))  # no recipient: they wait
    for _ in range(3):  # RETRY_TIMES
        await rec.next_push()

    page = await browser.new_page(viewport={"width": 1280, "height": 800})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    await page.goto(f"{base}/ui#orders")
    # auth is on: the page asks; a token without the admin role is refused clearly
    await expect(page.locator("#token-form")).to_be_visible()
    await page.fill("#token", PRODUCER)
    await page.click("#token-form button[type=submit]")
    await expect(page.locator("#token-why")).to_contain_text("403")
    await expect(page.locator("#token-why")).to_contain_text("admin role")
    await page.fill("#token", ADMIN)
    await page.click("#token-form button[type=submit]")
    await expect(page.locator("#token-form")).to_be_hidden()

    # the app, its depths and its dead letter, whose content is shown as text only
    app_row = page.locator('#apps tr[data-app="orders"]')
    cells = ["orders", re.compile(r"/s / .*/s"), "0", "0", "0", "1", "\u2013", "1 alive", "0"]
    await expect(app_row.locator("td")).to_have_text(cells, timeout=10_000)
    idle_row = page.locator('#apps tr[data-app="idle"]')
    await expect(idle_row.locator("td").nth(2)).to_have_text("3")  # pending
    await expect(idle_row.locator("td").nth(6)).to_have_text(re.compile(r"^\d+\.\d s$"))
    dead = page.locator('#dead tr[data-msgid="poison-1"]')
    await expect(dead).to_contain_text("<script>window.pwned=1</script>")
    await expect(dead).to_contain_text("rejected")
    await dead.get_by_role("button", name="Peek").click()
    await expect(page.locator("#dead tr.peek pre").first).to_have_text(POISON)
    assert await page.evaluate("window.pwned") is None
    await expect(page.locator("#recipients tbody tr td").first).to_have_text("r1")

    # the rate chart moves once traffic flows
    line = app_row.locator("polyline.in")
    before = await line.get_attribute("points")
    flowing = asyncio.create_task(traffic(http, base, "orders"))
    try:
        await page.wait_for_function(
            """() => {
              const p = document.querySelector('tr[data-app="orders"] polyline.in')
                .getAttribute("points").split(" ").map((xy) => Number(xy.split(",")[1]));
              return p[p.length - 1] < 16;  // the newest sample: above half the peak
            }""",
            timeout=20_000,
        )
    finally:
        flowing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await flowing
    assert await line.get_attribute("points") != before
    await expect(app_row.locator(".rate")).not_to_have_text("0.0/s / 0.0/s")
    SHOTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=SHOTS / "desktop.png", full_page=True)

    # replay: the recipient takes it now, and it leaves the dead letters
    rejecting["on"] = False
    await dead.get_by_role("button", name="Replay").click()
    await expect(page.locator("#notice")).to_have_text("Replayed 1 of 1")
    await expect(dead).to_have_count(0)
    await expect(page.locator("#dead .empty")).to_be_visible()
    await expect(app_row.locator("td").nth(5)).to_have_text("0")

    # another app, chosen in the table: its pending messages, purged
    await idle_row.get_by_role("link", name="idle").click()
    await expect(page.locator("#detail-app")).to_have_text("idle")
    pending = page.locator("#pending tbody tr")
    await expect(pending).to_have_count(3)
    await expect(pending.first).to_contain_text("tick 0")
    purge = page.locator("#purge-form")
    await purge.get_by_role("button", name="Purge pending").click()  # a dry run first
    await expect(page.locator("#notice")).to_have_text("Would purge 3: w0, w1, w2")
    await expect(pending).to_have_count(3)
    await purge.get_by_label("Dry run").uncheck()
    page.once("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
    await purge.get_by_role("button", name="Purge pending").click()
    await expect(page.locator("#notice")).to_have_text("Purged 3: w0, w1, w2")
    await expect(pending).to_have_count(0)
    # its row shows 0 pending, or is gone: an app left with nothing is forgotten (the
    # sweep may come first)
    await page.wait_for_function(
        """() => {
          const row = document.querySelector('#apps tr[data-app="idle"]');
          return !row || row.querySelectorAll("td")[2].textContent.trim() === "0";
        }""",
        timeout=10_000,
    )
    assert errors == []

    phone = await browser.new_page(viewport={"width": 390, "height": 844}, is_mobile=True)
    await phone.add_init_script(f"sessionStorage.setItem('skmq-token', '{ADMIN}')")
    await phone.goto(f"{base}/ui#orders")
    await expect(phone.locator('#apps tr[data-app="orders"]')).to_be_visible()
    await phone.screenshot(path=SHOTS / "phone.png", full_page=True)
