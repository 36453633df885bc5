"""Consumer groups, pull consumption and long polls over HTTP (docs/HTTP.md), with real
brokers on one Redis and a real HTTP client."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from skmq.broker import Broker
from tests.conftest import BrokerFactory, BrokerProcess, eventually, free_port
from tests.openapi_check import check_against_openapi
from tests.test_delivery import logged

CONSUMER = "consumer-a-token-0123456789abcdef"
ADMIN = "admin-a-token-0123456789abcdefgh"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=30), middlewares=(check_against_openapi,)
    ) as session:
        yield session


async def gateway(make_broker: BrokerFactory, **settings: Any) -> tuple[Broker, str]:
    broker = await make_broker(http_port=free_port(), **settings)
    return broker, f"http://127.0.0.1:{broker.gateway.port}/v1/apps"


async def call(
    http: aiohttp.ClientSession, method: str, url: str, body: Any = None, **headers: str
) -> tuple[int, Any]:
    async with http.request(method, url, json=body, headers=headers) as response:
        return response.status, await response.json()


async def produce(http: aiohttp.ClientSession, base: str, app: str, *msgids: str) -> None:
    batch = {"messages": [{"msgid": m, "content": f"body {m}"} for m in msgids]}
    status, _ = await call(http, "POST", f"{base}/{app}/messages", batch)
    assert status == 200


async def receive(
    http: aiohttp.ClientSession, base: str, app: str, group: str, **body: Any
) -> list[dict[str, Any]]:
    status, got = await call(http, "POST", f"{base}/{app}/groups/{group}/receive", body)
    assert status == 200, got
    messages: list[dict[str, Any]] = got["messages"]
    return messages


async def settle(
    http: aiohttp.ClientSession, base: str, app: str, group: str, verb: str, **body: Any
) -> list[str]:
    status, got = await call(http, "POST", f"{base}/{app}/groups/{group}/{verb}", body)
    assert status == 200, got
    return [r["status"] for r in got["results"]]


async def test_groups_each_get_every_message_and_members_share_one_group(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    _, base = await gateway(make_broker)
    for group in ("billing", "audit"):
        status, body = await call(http, "POST", f"{base}/shop/groups", {"group": group})
        assert (status, body) == (201, {"group": group, "created": True})
    assert (await call(http, "POST", f"{base}/shop/groups", {"group": "audit"}))[0] == 200
    await produce(http, base, "shop", "m1", "m2", "m3", "m4")
    got = await receive(http, base, "shop", "billing", max=10)
    assert [m["msgid"] for m in got] == ["m1", "m2", "m3", "m4"]
    assert got[0]["content"] == "body m1" and got[0]["attempt"] == 1
    members = await asyncio.gather(
        *(receive(http, base, "shop", "audit", max=2, wait=5) for _ in range(2))
    )
    seen = [m["msgid"] for member in members for m in member]
    assert sorted(seen) == ["m1", "m2", "m3", "m4"]  # each to one member
    status, body = await call(http, "GET", f"{base}/shop/groups")
    assert status == 200
    states = {g["group"]: g for g in body["groups"]}
    assert states["billing"]["in_flight"] == 4 and states["billing"]["backlog"] == 0
    assert 0 <= states["billing"]["oldest_age_s"] < 60  # m1, in flight
    async with http.get(base.replace("/v1/apps", "/metrics")) as r:
        text = await r.text()
    assert 'skmq_group_in_flight{app="shop",group="billing"} 4.0' in text
    assert 'skmq_group_backlog{app="shop",group="billing"} 0.0' in text
    # settled every one: none is left to be old
    receipts = [m["receipt"] for m in got]
    assert (await call(http, "POST", f"{base}/shop/groups/billing/ack", {"receipts": receipts}))[
        0
    ] == 200
    body = (await call(http, "GET", f"{base}/shop/groups"))[1]
    assert {g["group"]: g["oldest_age_s"] for g in body["groups"]}["billing"] is None


async def test_a_long_poll_on_one_broker_wakes_for_a_message_stored_through_another(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    _, base_a = await gateway(make_broker)
    _, base_b = await gateway(make_broker)
    await call(http, "POST", f"{base_a}/x/groups", {"group": "g"})
    started = time.monotonic()
    poll = asyncio.create_task(receive(http, base_b, "x", "g", wait=10))
    await asyncio.sleep(0.3)  # let the poll find nothing and wait (the test is the wake-up)
    assert not poll.done()
    await produce(http, base_a, "x", "cross")
    got = await asyncio.wait_for(poll, 5)
    assert [m["msgid"] for m in got] == ["cross"]
    assert time.monotonic() - started < 5
    started = time.monotonic()
    assert await receive(http, base_b, "x", "g", wait=0.3) == []
    assert time.monotonic() - started >= 0.3


async def test_an_expired_lease_redelivers_and_its_stale_receipt_is_refused(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    _, base = await gateway(make_broker)
    await call(http, "POST", f"{base}/x/groups", {"group": "g"})
    await produce(http, base, "x", "m")
    (first,) = await receive(http, base, "x", "g", visibility=0.2)
    (again,) = await receive(http, base, "x", "g", wait=5)  # after the lease and backoff
    assert again["msgid"] == "m" and again["attempt"] == 2
    assert await settle(http, base, "x", "g", "ack", receipts=[first["receipt"]]) == ["stale"]
    assert await settle(http, base, "x", "g", "extend", receipts=[first["receipt"]],
                        visibility=5) == ["stale"]  # fmt: skip
    assert await settle(http, base, "x", "g", "ack", receipts=[again["receipt"]]) == ["acked"]
    assert await receive(http, base, "x", "g", wait=0.5) == []


async def test_a_group_never_hands_out_a_message_whose_ttl_ran_out(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    broker, base = await gateway(make_broker)
    await call(http, "POST", f"{base}/x/groups", {"group": "g"})
    short = {"msgid": "short", "content": "s", "ttl": 1, "delay": 50}
    batch = {"messages": [short, {"msgid": "long", "content": "l", "ttl": 60_000, "delay": 50}]}
    assert (await call(http, "POST", f"{base}/x/messages", batch))[0] == 200
    (got,) = await receive(http, base, "x", "g", wait=5, max=10)
    assert got["msgid"] == "long"
    (line,) = await logged(broker, "expired", "short")
    assert (line["recipient"], line["detail"]) == ("group:g", "dead-lettered")
    await logged(broker, "dead_lettered", "short")
    status, groups = await call(http, "GET", f"{base}/x/groups")
    assert status == 200 and groups["groups"][0]["dead"] == 1


async def test_a_group_hands_out_messages_of_one_key_in_order_one_at_a_time(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    _, base = await gateway(make_broker)
    await call(http, "POST", f"{base}/x/groups", {"group": "g"})
    batch = {"messages": [{"msgid": m, "content": m, "key": "k"} for m in ("k1", "k2", "k3")]}
    assert (await call(http, "POST", f"{base}/x/messages", batch))[0] == 200
    for msgid in ("k1", "k2", "k3"):
        (got,) = await receive(http, base, "x", "g", wait=5, max=10)
        assert got["msgid"] == msgid
        assert await receive(http, base, "x", "g", max=10) == []  # the next one waits
        assert await settle(http, base, "x", "g", "ack", receipts=[got["receipt"]]) == ["acked"]


async def test_a_receipt_from_before_a_group_reset_is_stale(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    _, base = await gateway(make_broker)
    await call(http, "POST", f"{base}/x/groups", {"group": "g"})
    await produce(http, base, "x", "m")
    (before,) = await receive(http, base, "x", "g")
    reset = {"position": "earliest"}
    assert (await call(http, "POST", f"{base}/x/groups/g/reset", reset))[0] == 200
    (after,) = await receive(http, base, "x", "g")
    assert after["attempt"] == before["attempt"] == 1
    assert await settle(http, base, "x", "g", "ack", receipts=[before["receipt"]]) == ["stale"]
    assert await settle(http, base, "x", "g", "ack", receipts=[after["receipt"]]) == ["acked"]


async def test_settling_in_a_group_that_is_gone_is_404_and_after_it_is_made_again_stale(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    """ack, nack and extend answer 404 for a group that does not exist (as receive does),
    not 200 `stale`: the consumer's group is gone, not its lease."""
    _, base = await gateway(make_broker)
    assert (await call(http, "POST", f"{base}/x/groups", {"group": "g"}))[0] == 201
    await produce(http, base, "x", "m1", "m2")
    first, second = await receive(http, base, "x", "g", max=2)
    assert await settle(http, base, "x", "g", "ack", receipts=[first["receipt"]]) == ["acked"]
    assert (await call(http, "DELETE", f"{base}/x/groups/g"))[0] == 200
    gone = {"error": "no group 'g' for app 'x'"}
    receipts = [first["receipt"], second["receipt"]]
    for verb, extra in (("ack", {}), ("nack", {"delay": 0}), ("extend", {"visibility": 5})):
        url = f"{base}/x/groups/g/{verb}"
        assert await call(http, "POST", url, {"receipts": receipts, **extra}) == (404, gone)
    assert (await call(http, "POST", f"{base}/x/groups", {"group": "g"}))[0] == 201
    assert await settle(http, base, "x", "g", "ack", receipts=receipts) == ["stale", "stale"]


async def test_nacks_retry_then_dead_letter_after_retry_times(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    _, base = await gateway(make_broker, retry_times=3)
    await call(http, "POST", f"{base}/x/groups", {"group": "g"})
    await produce(http, base, "x", "m")
    statuses = []
    for _ in range(3):
        (got,) = await receive(http, base, "x", "g", wait=5)
        statuses += await settle(http, base, "x", "g", "nack", receipts=[got["receipt"]], delay=0)
    assert statuses == ["retry", "retry", "dead"]
    assert await receive(http, base, "x", "g", wait=0.3) == []
    _, body = await call(http, "GET", f"{base}/x/groups")
    assert body["groups"][0]["dead"] == 1
    assert body["groups"][0]["oldest_age_s"] is None  # (a dead letter is not waiting)


async def test_extend_keeps_a_message_hidden(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    _, base = await gateway(make_broker)
    await call(http, "POST", f"{base}/x/groups", {"group": "g"})
    await produce(http, base, "x", "m")
    (got,) = await receive(http, base, "x", "g", visibility=0.5)
    assert await settle(http, base, "x", "g", "extend", receipts=[got["receipt"]],
                        visibility=30) == ["extended"]  # fmt: skip
    assert await receive(http, base, "x", "g", wait=1.0) == []
    assert await settle(http, base, "x", "g", "ack", receipts=[got["receipt"]]) == ["acked"]


async def test_a_waiting_poll_wakes_for_a_delayed_nack_and_a_shortened_lease(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    """The poll waits 60 s: had the nack or the extend not woken it, it would still be
    waiting (and then answer []) when the 30 s bound below ends the test."""
    broker, base = await gateway(make_broker, pull_max_wait=60, retry_backoff=[0.2])
    await call(http, "POST", f"{base}/x/groups", {"group": "g"})
    await produce(http, base, "x", "m")
    (got,) = await receive(http, base, "x", "g", visibility=60)

    async def one_waits() -> bool:
        return broker.wakeups.count == 1

    async def woken_by(verb: str, receipt: str, answer: str, **body: Any) -> dict[str, Any]:
        """What a poll waiting 60 s gets once `verb` settled `receipt`."""
        poll = asyncio.create_task(receive(http, base, "x", "g", wait=60))
        await eventually(one_waits)
        assert await settle(http, base, "x", "g", verb, receipts=[receipt], **body) == [answer]
        (woken,) = await asyncio.wait_for(poll, 30)
        return woken

    again = await woken_by("nack", got["receipt"], "retry", delay=300)
    assert (again["msgid"], again["attempt"]) == ("m", 2)
    third = await woken_by("extend", again["receipt"], "extended", visibility=0.3)
    assert (third["msgid"], third["attempt"]) == ("m", 3)


async def test_a_poll_finds_a_ready_message_behind_a_long_run_of_delayed_ones(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    """One receive reads 1,000 new log entries at most; the poll reads on."""
    _, base = await gateway(make_broker)
    await call(http, "POST", f"{base}/x/groups", {"group": "g"})
    for batch in range(3):
        later = [{"msgid": f"d{batch}-{i}", "content": "x", "delay": 60_000} for i in range(500)]
        status, _ = await call(http, "POST", f"{base}/x/messages", {"messages": later})
        assert status == 200
    await produce(http, base, "x", "now")
    assert [m["msgid"] for m in await receive(http, base, "x", "g", wait=0)] == ["now"]


# `skmq serve` on a machine whose clock is 30 s ahead.
SKEWED_SERVE = """
import sys, time
real = time.time_ns
time.time_ns = lambda: real() + 30 * 10**9
time.time = lambda: time.time_ns() / 1e9
from skmq.cli import main
sys.argv = ["skmq", "serve"]
sys.exit(main())
"""


async def test_brokers_whose_machine_clocks_differ_agree_on_due_times_and_leases(
    make_broker: BrokerFactory,
    http: aiohttp.ClientSession,
    broker_env: dict[str, str],
    redis_url: str,
    prefix: str,
    tmp_path: Path,
) -> None:
    _, base = await gateway(make_broker)
    script = tmp_path / "skewed_serve.py"
    script.write_text(SKEWED_SERVE)
    http_port = free_port()
    env = {**broker_env, "SKMQ_REDIS_URL": redis_url, "SKMQ_KEY_PREFIX": prefix,
           "SKMQ_HTTP_PORT": str(http_port)}  # fmt: skip
    skewed = BrokerProcess(env, tmp_path / "skewed.log", [sys.executable, str(script)]).start()
    try:
        ahead = f"http://127.0.0.1:{http_port}/v1/apps"
        await call(http, "POST", f"{base}/x/groups", {"group": "g"})
        later = {"messages": [{"msgid": "later", "content": "x", "delay": 10_000}]}
        assert (await call(http, "POST", f"{base}/x/messages", later))[0] == 200
        await produce(http, base, "x", "now")
        # through the broker ahead: "later" is not due, and "now" stays leased for 20 s
        (got,) = await receive(http, ahead, "x", "g", max=10, visibility=20)
        assert got["msgid"] == "now"
        assert await receive(http, base, "x", "g", max=10) == []
        assert await settle(http, base, "x", "g", "ack", receipts=[got["receipt"]]) == ["acked"]
    finally:
        assert skewed.terminate() == 0


@pytest.mark.parametrize(
    ("path", "body", "status", "error"),
    [
        ("g/receive", {"max": 11}, 400, "max: at most 10 (PULL_MAX_MESSAGES)"),
        ("g/receive", {"wait": 2.5}, 400, "wait: at most 2 s (PULL_MAX_WAIT)"),
        ("g/receive", {"visibility": 61}, 400, "visibility: at most 60 s"),
        ("g/receive", {"max": 0}, 400, "max: Input should be greater than or equal to 1"),
        ("g/extend", {"receipts": ["x"], "visibility": 61}, 400, "visibility: at most 60 s"),
        ("g/ack", {"receipts": ["not-a-receipt"]}, 400, "not a receipt: 'not-a-receipt'"),
        ("g/ack", {"receipts": ["١٢٣-0.1"]}, 400, "not a receipt: '١٢٣-0.1'"),
        ("g/nack", {"receipts": ["1-0.1"], "delay": 10**30}, 400, "delay: at most 5000 ms"),
        ("g/ack", {"receipts": []}, 400, "receipts: List should have at least 1 item"),
        ("nope/receive", {}, 404, "no group 'nope' for app 'x'"),
        ("nope/ack", {"receipts": ["1-0.1"]}, 404, "no group 'nope' for app 'x'"),
        ("nope/nack", {"receipts": ["1-0.1"]}, 404, "no group 'nope' for app 'x'"),
        ("nope/extend", {"receipts": ["1-0.1"], "visibility": 5}, 404, "no group 'nope' for"),
        ("bad%20name/receive", {}, 400, "group must be 1 to 64 letters"),
    ],
)
async def test_pull_limits_and_refusals(
    make_broker: BrokerFactory,
    http: aiohttp.ClientSession,
    path: str,
    body: Any,
    status: int,
    error: str,
) -> None:
    _, base = await gateway(
        make_broker, pull_max_messages=10, pull_max_wait=2, pull_max_visibility=60, max_delay=5000
    )
    await call(http, "POST", f"{base}/x/groups", {"group": "g"})
    got = await call(http, "POST", f"{base}/x/groups/{path}", body)
    assert got[0] == status and got[1]["error"].startswith(error), got


async def test_a_receive_with_no_body_takes_the_defaults(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    """As a `pull` frame with no content: one message, the default lease, no wait; with
    no Content-Type too (curl -X POST). Other verbs still need their body."""
    _, base = await gateway(make_broker)
    await call(http, "POST", f"{base}/nb/groups", {"group": "g"})
    await produce(http, base, "nb", "m1", "m2")
    url = f"{base}/nb/groups/g/receive"
    for headers in ({}, {"Content-Type": "application/json"}):
        async with http.post(url, headers=headers) as response:
            assert response.status == 200
            (got,) = (await response.json())["messages"]
            assert got["msgid"] in ("m1", "m2")
    async with http.post(f"{base}/nb/groups/g/ack") as response:
        assert (response.status, await response.json()) == (
            415, {"error": "send Content-Type: application/json"}
        )  # fmt: skip


async def test_long_polls_past_pull_max_waiting_are_refused(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    broker, base = await gateway(make_broker, pull_max_waiting=1)
    await call(http, "POST", f"{base}/x/groups", {"group": "g"})
    first = asyncio.create_task(receive(http, base, "x", "g", wait=10))
    deadline = time.monotonic() + 5
    while broker.wakeups.count < 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    status, body = await call(http, "POST", f"{base}/x/groups/g/receive", {"wait": 1})
    assert status == 503 and "PULL_MAX_WAITING" in body["error"]
    await produce(http, base, "x", "m")
    assert len(await asyncio.wait_for(first, 5)) == 1


async def test_idle_long_polls_send_no_commands_to_redis(make_broker: BrokerFactory) -> None:
    broker, base = await gateway(make_broker)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        await idle_polls(broker, base, http)


async def idle_polls(broker: Broker, base: str, http: aiohttp.ClientSession) -> None:
    await call(http, "POST", f"{base}/x/groups", {"group": "g"})

    async def commands_in(seconds: float) -> int:
        before = (await broker.redis.info("stats"))["total_commands_processed"]
        await asyncio.sleep(seconds)
        after = (await broker.redis.info("stats"))["total_commands_processed"]
        return int(after) - int(before)

    async def scripts_run() -> int:
        return int((await broker.redis.info("commandstats"))["cmdstat_evalsha"]["calls"])

    baseline = await commands_in(1.0)
    before = await scripts_run()
    polls = [asyncio.create_task(receive(http, base, "x", "g", wait=8)) for _ in range(200)]
    deadline = time.monotonic() + 10
    # each poll waits once its first receive (a script) ran: a poll is counted waiting
    # from before that receive, which a loaded machine may run a second later
    while (
        broker.wakeups.count < 200 or await scripts_run() < before + 200
    ) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert broker.wakeups.count == 200
    with_polls = await commands_in(1.0)
    assert with_polls - baseline < 100, (baseline, with_polls)  # 200 busy polls: thousands

    before = await scripts_run()
    await produce(http, base, "x", "wake")
    await asyncio.wait(polls, return_when=asyncio.FIRST_COMPLETED, timeout=15)
    await asyncio.sleep(0.5)  # (a window for the other 199 to run a receive, if woken)
    # the first waiting poll is woken, not all 200: a store and a few receives
    assert await scripts_run() - before < 20
    results = await asyncio.wait_for(asyncio.gather(*polls), 15)
    assert sum(len(r) for r in results) == 1


async def test_a_batch_reaches_every_waiting_poll_of_the_group_one_after_another(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    """A wake-up goes to the group's first waiting poll, which passes it on once it took
    a message: 20 polls, 20 messages in one store, each poll gets one, none waits out."""
    broker, base = await gateway(make_broker)
    await call(http, "POST", f"{base}/x/groups", {"group": "g"})
    polls = [asyncio.create_task(receive(http, base, "x", "g", wait=20)) for _ in range(20)]

    async def all_wait() -> bool:
        return broker.wakeups.count == 20

    await eventually(all_wait)
    await produce(http, base, "x", *(f"m{i}" for i in range(20)))
    results = await asyncio.wait_for(asyncio.gather(*polls), 10)
    assert sorted(m["msgid"] for r in results for m in r) == sorted(f"m{i}" for i in range(20))


async def test_a_delay_falling_due_after_the_first_poll_left_reaches_the_next(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    """Only the first waiting poll of a group sleeps until the next due time; leaving
    before it, it hands its turn on. Had it not, the second would wait out its 30 s."""
    broker, base = await gateway(make_broker, pull_max_wait=30)
    await call(http, "POST", f"{base}/x/groups", {"group": "g"})
    first = asyncio.create_task(receive(http, base, "x", "g", wait=0.5))

    async def waiting(n: int) -> bool:
        return broker.wakeups.count == n

    await eventually(lambda: waiting(1))
    second = asyncio.create_task(receive(http, base, "x", "g", wait=30))
    await eventually(lambda: waiting(2))
    later = {"messages": [{"msgid": "later", "content": "x", "delay": 1_500}]}
    assert (await call(http, "POST", f"{base}/x/messages", later))[0] == 200
    assert await asyncio.wait_for(first, 10) == []
    got = await asyncio.wait_for(second, 10)
    assert [m["msgid"] for m in got] == ["later"]


async def test_a_reset_to_earliest_wakes_a_waiting_poll(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    broker, base = await gateway(make_broker, pull_max_wait=30)
    await call(http, "POST", f"{base}/x/groups", {"group": "g"})
    await produce(http, base, "x", "m")
    (got,) = await receive(http, base, "x", "g")
    assert await settle(http, base, "x", "g", "ack", receipts=[got["receipt"]]) == ["acked"]
    poll = asyncio.create_task(receive(http, base, "x", "g", wait=30))

    async def one_waits() -> bool:
        return broker.wakeups.count == 1

    await eventually(one_waits)
    status, _ = await call(http, "POST", f"{base}/x/groups/g/reset", {"position": "earliest"})
    assert status == 200
    assert [m["msgid"] for m in await asyncio.wait_for(poll, 10)] == ["m"]


@pytest.fixture
def auth_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(
        f'[[tokens]]\nname = "c"\ntoken = "{CONSUMER}"\napps = ["a"]\n'
        'roles = ["consume", "produce"]\n'
        f'[[tokens]]\nname = "o"\ntoken = "{ADMIN}"\napps = ["a"]\nroles = ["admin"]\n'
    )
    return path


async def test_group_reset_and_delete_need_the_admin_role(
    make_broker: BrokerFactory, http: aiohttp.ClientSession, auth_file: Path
) -> None:
    _, base = await gateway(make_broker, auth_file=auth_file)
    consumer = {"Authorization": f"Bearer {CONSUMER}"}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert (await call(http, "POST", f"{base}/a/groups", {"group": "g"}, **consumer))[0] == 201
    assert (await call(http, "POST", f"{base}/b/groups", {"group": "g"}, **consumer))[0] == 403
    assert (await call(http, "POST", f"{base}/a/groups/g/receive", {}))[0] == 401
    status, _ = await call(http, "DELETE", f"{base}/a/groups/g", **consumer)
    assert status == 403
    reset = {"position": "earliest"}
    assert (await call(http, "POST", f"{base}/a/groups/g/reset", reset, **admin))[0] == 200
    assert (await call(http, "DELETE", f"{base}/a/groups/g", **admin))[0] == 200
    assert (await call(http, "DELETE", f"{base}/a/groups/g", **admin))[0] == 404


@pytest.mark.parametrize("over", ["http", "tcp"])
async def test_a_long_poll_whose_client_went_away_takes_nothing(
    make_broker: BrokerFactory, http: aiohttp.ClientSession, over: str
) -> None:
    """A receive waiting for messages ends with its client (an HTTP request, or a `pull`
    frame on the broker's port): a message stored after the client hung up goes to the
    next live receive, not to nobody."""
    broker, base = await gateway(make_broker)
    assert (await call(http, "POST", f"{base}/gone/groups", {"group": "g"}))[0] == 201
    body = json.dumps({"wait": 20}).encode()
    if over == "http":
        port, request = (
            broker.gateway.port,
            (
                b"POST /v1/apps/gone/groups/g/receive HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            ),
        )
    else:
        port = broker.server.port
        request = b"type=pull\r\nappid=gone\r\ngroup=g\r\nop=receive\r\ncontent=%s\r\n\r\n" % body
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)

    async def waiting(n: int) -> bool:
        return broker.wakeups.count == n

    await eventually(lambda: waiting(1))
    writer.close()
    await eventually(lambda: waiting(0), 5)  # not at the end of its 20 s wait
    await produce(http, base, "gone", "m1")
    got = await receive(http, base, "gone", "g", wait=5)
    assert [(m["msgid"], m["attempt"]) for m in got] == [("m1", 1)]


async def test_groups_start_at_latest_earliest_or_a_time(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    broker, base = await gateway(make_broker)
    assert (await call(http, "POST", f"{base}/x/groups", {"group": "first"}))[0] == 201
    glog = broker.store.base("x") + "glog"

    async def entries() -> list[tuple[str, int]]:
        got = await broker.store.redis.xrange(glog)
        return [(f[b"m"].decode(), int(eid.split(b"-")[0])) for eid, f in got]

    n = 0  # stored until the log spans two ms of Redis's clock, however fast that goes
    while len({ms for _, ms in await entries()}) < 2:
        n += 1
        await produce(http, base, "x", f"m{n}")
    log = await entries()
    at = log[-1][1]
    iso = datetime.fromtimestamp(at / 1000, UTC).isoformat(timespec="milliseconds")
    for group, position in (("e", "earliest"), ("l", "latest"), ("t", at), ("iso", iso)):
        body = {"group": group, "position": position}
        assert await call(http, "POST", f"{base}/x/groups", body) == (
            201, {"group": group, "created": True},
        )  # fmt: skip
    since = [m for m, ms in log if ms >= at]
    status, listed = await call(http, "GET", f"{base}/x/groups")
    assert {g["group"]: g["backlog"] for g in listed["groups"]} == {
        "first": len(log), "e": len(log), "l": 0, "t": len(since), "iso": len(since),
    }  # fmt: skip
    assert [m["msgid"] for m in await receive(http, base, "x", "iso", max=100)] == since
    assert await receive(http, base, "x", "l", max=100) == []
    status, moved = await call(http, "POST", f"{base}/x/groups/l/reset", {"position": iso})
    assert (status, moved) == (200, {"group": "l", "position": at})
    assert [m["msgid"] for m in await receive(http, base, "x", "l", max=100)] == since


@pytest.mark.parametrize(
    ("path", "body", "error"),
    [
        ("", {"group": "n", "position": "Latest"}, "position: 'Latest' is not one of latest"),
        ("", {"group": "n", "position": -5}, "position: a time in unix ms is 0 to"),
        ("", {"group": "n", "position": 1.5}, "position: must be a string or an integer"),
        ("", {"group": "n", "position": None}, "position: must be a string or an integer"),
        (
            "",
            {"group": "n", "position": "2026-11-28T12:00"},
            "position: '2026-11-28T12:00': an ISO",
        ),
        ("", {"group": "n", "position": "x" * 5000}, "position: not one of latest"),
        ("", {"group": "n", "position": 10**40}, "position: a time in unix ms is 0 to"),
        ("", {"group": "n", "position": 253402300799999}, "position: 253402300799999 (unix"),
        ("/g/reset", {"position": "soon"}, "position: 'soon' is not one of latest"),
        ("/g/reset", {}, "position: Field required"),
        ("/g/reset", {"position": 253402300799999}, "position: 253402300799999 (unix ms) is"),
    ],
)
async def test_bad_group_positions_are_400(
    make_broker: BrokerFactory,
    http: aiohttp.ClientSession,
    path: str,
    body: Any,
    error: str,
) -> None:
    _, base = await gateway(make_broker)
    await call(http, "POST", f"{base}/x/groups", {"group": "g"})
    status, got = await call(http, "POST", f"{base}/x/groups{path}", body)
    assert status == 400 and got["error"].startswith(error), got
    status, listed = await call(http, "GET", f"{base}/x/groups")
    assert [g["group"] for g in listed["groups"]] == ["g"]  # nothing made
