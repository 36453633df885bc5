"""The operator's console (issue 39): `skmq apps`, `skmq peek` and `skmq purge` as an
operator runs them (the CLI as a process), their HTTP routes, and the store calls under
them, against a real Redis and a real broker with traffic."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from skmq.clock import now_ms
from skmq.console import PEEK_MAX, preview
from skmq.events import PENDING_PURGED
from skmq.queue.operator import OperatorFault, Request, ask_owner
from skmq.queue.owned_store import OwnedStore
from skmq.store import AliveRecipient, NewMessage, Purged
from skmq.store.wire import Wire
from skmq.throughput import Throughput
from tests.conftest import BrokerFactory, eventually, free_port
from tests.peers import FakeRecipient, RawClient
from tests.test_cli_ops import one_line, skmq
from tests.test_delivery import log_events
from tests.test_queue_owners import owners

ADMIN = "console-admin-token-0123456789ab"
TENANT = "console-tenant-token-0123456789a"
CONSUMER = "console-consumer-token-012345678"

Cli = Callable[..., Awaitable[tuple[int, str, str]]]


@pytest.fixture
async def store(make_broker: BrokerFactory) -> OwnedStore:
    """The store of a running broker (RETRY_TIMES 1), which owns each app stored through
    it: the owner the operator's commands ask."""
    return (await make_broker(retry_times=1, ack_timeout=60.0)).store


@pytest.fixture
def cli(redis_url: str, prefix: str, tmp_path: Path) -> Cli:
    env = {"SKMQ_REDIS_URL": redis_url, "SKMQ_KEY_PREFIX": prefix,
           "SKMQ_DATA_DIR": str(tmp_path / "cli")}  # fmt: skip

    async def run(*args: str) -> tuple[int, str, str]:
        return await asyncio.to_thread(skmq, *args, env=env)

    return run


async def cli_json(cli: Cli, *args: str) -> Any:
    code, out, err = await cli(*args, "--json")
    assert code == 0, err
    return json.loads(out)


async def stored(store: OwnedStore, app: str, *msgids: str, **more: Any) -> None:
    """Each stored in turn (its owner stamps it with the time it was written), content
    `<msgid>`."""
    for msgid in msgids:
        new = NewMessage(msgid, more.get("kind", "queue"), msgid.encode(), key=more.get("key", ""))
        assert (await store.store({app: [new]}, now_ms()))[app] == [True]


def cli_purges(tmp_path: Path) -> list[tuple[str, str, str | None, str]]:
    """(appid, msgid, recipient, detail) of each `purged` line the `cli` fixture logged."""
    return [
        (e["appid"], e["msgid"], e["recipient"], e["detail"])
        for e in log_events(tmp_path / "cli" / "delivery-log", event="purged")
    ]


# -- skmq apps ---------------------------------------------------------------------
async def test_apps_shows_depths_recipients_and_the_rates_of_the_last_minute(
    make_broker: BrokerFactory, cli: Cli
) -> None:
    broker = await make_broker()
    client = await RawClient.connect(broker.server.port)
    try:
        answers = await client.produce("shop", [f"m{i}" for i in range(5)])
    finally:
        await client.close()
    assert [a["status"] for a in answers] == ["ack"] * 5

    async def noted(rate: str, n: int) -> bool:
        (app,) = (await cli_json(cli, "apps"))["apps"]
        return bool(app[rate] == n / 60)

    await eventually(lambda: noted("rate_in", 5))  # (the broker notes every 0.5 s)

    async def unroutable() -> bool:  # (no recipient, no group: counted at a refresh)
        (app,) = (await cli_json(cli, "apps"))["apps"]
        return bool(app["unroutable"] == 5)

    await eventually(unroutable)
    (app,) = (await cli_json(cli, "apps"))["apps"]
    age = app.pop("oldest_pending_age_s")
    assert 0 <= age < 60
    assert app == {"app": "shop", "pending": 5, "delayed": 0, "in_flight": 0, "dead": 0,
                   "recipients": {"alive": 0, "lost": 0}, "groups": 0, "rate_in": 5 / 60,
                   "rate_out": 0.0, "unroutable": 5}  # fmt: skip
    rec = await FakeRecipient("shop", "r1").start()
    try:
        assert (await rec.register(broker.server.port))["status"] == "ack"
        await eventually(lambda: noted("rate_out", 5))
        (app,) = (await cli_json(cli, "apps"))["apps"]
        code, out, err = await cli("apps")
    finally:
        await rec.stop()
    assert (app["pending"], app["oldest_pending_age_s"], app["recipients"]) == (
        0, None, {"alive": 1, "lost": 0}
    )  # fmt: skip
    assert code == 0, err
    assert "shop" in out and "1/0" in out
    # piped, the table is as wide as it needs: no column cut to fit 80 characters
    assert all(col in out for col in ("pending", "delayed", "in flight", "unroutable")), out
    assert "…" not in out, out


def test_throughput_counts_only_the_last_window() -> None:
    counts: dict[tuple[str, str], int] = {("stored", "a"): 10, ("acked", "a"): 4}
    clock = [0.0]
    rates = Throughput(counts, window=60.0, clock=lambda: clock[0])
    assert rates.last_minute() == {}  # (nothing since the first sample)
    counts[("stored", "a")] += 6
    counts[("pushed", "a")] = 99  # neither in nor out
    clock[0] = 30.0
    assert rates.last_minute() == {"a": [6, 0]}
    counts[("acked", "a")] += 3
    clock[0] = 61.0  # (the sample at 0 s is the last one at or before the window)
    assert rates.last_minute() == {"a": [6, 3]}
    clock[0] = 91.0  # the one at 30 s is now
    assert rates.last_minute() == {"a": [0, 3]}
    clock[0] = 200.0
    assert rates.last_minute() == {}


# -- skmq peek -----------------------------------------------------------------------
async def test_peek_lists_what_waits_oldest_first_and_changes_nothing(
    make_broker: BrokerFactory, cli: Cli
) -> None:
    broker = await make_broker()
    store = broker.store
    now = now_ms()
    await stored(store, "p", "k1", key="k")
    await stored(store, "p", "m2", "m1")
    await stored(store, "p", "k2", key="k")  # waits for k1
    raw = NewMessage("bin", "queue", b"\x00\x07caf\xc3\xa9\xff\\" + b"x" * 100)
    assert (await store.store({"p": [raw]}, now))["p"] == [True]
    before = await store.counts(["p"], now)
    first = await cli_json(cli, "peek", "--app", "p")
    assert [m["msgid"] for m in first["messages"]] == ["k1", "m2", "m1", "k2", "bin"]
    assert [m["key"] for m in first["messages"]] == ["k", None, None, "k", None]
    k1 = first["messages"][0]
    assert (k1["attempts"], k1["size"], k1["preview"]) == (0, 2, "k1")
    assert 0 <= k1["age_s"] < 60
    binary = first["messages"][-1]
    assert binary["size"] == 109
    assert binary["preview"] == "\\x00\\x07café\\xff\\\\" + "x" * 55  # 64 bytes shown
    two = await cli_json(cli, "peek", "--app", "p", "--max", "2")
    assert _without_ages(two) == _without_ages(first)[:2]
    again = await cli_json(cli, "peek", "--app", "p")
    assert _without_ages(again) == _without_ages(first)  # a second look sees the same
    assert await store.counts(["p"], now) == before
    code, out, err = await cli("peek", "--app", "p", "--max", "1")
    assert code == 0, err
    assert out.splitlines()[0].startswith("k1 age=") and "key=k" in out
    assert out.splitlines()[-1] == "1 message(s)"
    rec = await FakeRecipient("p", "r1").start()
    try:
        assert (await rec.register(broker.server.port))["status"] == "ack"
        got = {(await rec.next_push()).fields["msgid"] for _ in range(5)}
    finally:
        await rec.stop()
    assert got == {"k1", "m2", "m1", "k2", "bin"}  # every one still delivered


def _without_ages(listed: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k != "age_s"} for m in listed["messages"]]


async def test_peek_dead_lists_the_dead_letters_the_same_way(store: OwnedStore, cli: Cli) -> None:
    now = now_ms()
    await stored(store, "d", "d1")
    got, _, _ = await store.claim("d", now, 1, [AliveRecipient("r", 1, True)], ["r"])
    (failed,) = await store.fail("d", [(got[0].delivery_id, "errored", "boom", "r", 1)], now)
    assert failed.code == failed.DEAD
    listed = await cli_json(cli, "peek", "--app", "d", "--dead")
    (d1,) = listed["messages"]
    assert (d1["msgid"], d1["attempts"], d1["key"], d1["size"], d1["preview"]) == (
        "d1", 1, None, 2, "d1"
    )  # fmt: skip
    assert (await cli_json(cli, "peek", "--app", "d"))["messages"] == []


async def test_peek_shows_at_most_its_cap(store: OwnedStore, cli: Cli) -> None:
    now = now_ms()
    many = [NewMessage(f"c{i:04d}", "queue", b"x") for i in range(PEEK_MAX + 5)]
    assert (await store.store({"cap": many}, now))["cap"] == [True] * len(many)
    listed = await cli_json(cli, "peek", "--app", "cap", "--max", str(PEEK_MAX))
    assert len(listed["messages"]) == PEEK_MAX
    assert listed["messages"][0]["msgid"] == "c0000"
    code, out, err = await cli("peek", "--app", "cap", "--max", str(PEEK_MAX + 1))
    assert code == 2 and out == ""
    assert f"expected 1-{PEEK_MAX}" in one_line(err)
    code, _, err = await cli("peek", "--app", "a\x01b")
    assert code == 2 and "--app" in one_line(err)


async def test_peek_and_purge_from_another_process(
    make_broker: BrokerFactory, cli: Cli, tmp_path: Path
) -> None:
    """As an operator runs them beside a running broker (asked of the app's owner through
    its inbox): peek in stored order, twice the same, then a purge of the
    oldest two, logged, and the rest still delivered."""
    broker = await make_broker()
    client = await RawClient.connect(broker.server.port)
    try:
        answers = await client.produce("e", [f"e{i}" for i in range(5)])
    finally:
        await client.close()
    assert all(a["status"] == "ack" for a in answers)
    first = await cli_json(cli, "peek", "--app", "e")
    assert [m["msgid"] for m in first["messages"]] == [f"e{i}" for i in range(5)]
    assert all((m["attempts"], m["size"], m["preview"]) == (0, 1, "x") for m in first["messages"])
    again = await cli_json(cli, "peek", "--app", "e")
    assert [m["msgid"] for m in again["messages"]] == [f"e{i}" for i in range(5)]
    dry = await cli_json(cli, "purge", "--app", "e", "--max", "2", "--dry-run")
    assert dry == {"app": "e", "purged": 2, "dry_run": True, "msgids": ["e0", "e1"]}
    assert cli_purges(tmp_path) == []
    done = await cli_json(cli, "purge", "--app", "e", "--max", "2")
    assert done == {"app": "e", "purged": 2, "dry_run": False, "msgids": ["e0", "e1"]}
    assert [p[1] for p in cli_purges(tmp_path)] == ["e0", "e1"]
    left = await cli_json(cli, "peek", "--app", "e")
    assert [m["msgid"] for m in left["messages"]] == ["e2", "e3", "e4"]
    rec = await FakeRecipient("e", "r1").start()
    try:
        assert (await rec.register(broker.server.port))["status"] == "ack"
        got = {(await rec.next_push()).fields["msgid"] for _ in range(3)}
    finally:
        await rec.stop()
    assert got == {"e2", "e3", "e4"}


async def test_an_app_that_does_not_exist_has_nothing_waiting(
    make_broker: BrokerFactory, cli: Cli, http: aiohttp.ClientSession
) -> None:
    """A mistyped app name is answered at once with nothing, not as a store to try
    again (no broker owns an app that was never stored), from the CLI and over HTTP."""
    broker = await make_broker(http_port=free_port())
    assert (await cli_json(cli, "peek", "--app", "typo"))["messages"] == []
    dry = await cli_json(cli, "purge", "--app", "typo", "--dry-run")
    assert dry == {"app": "typo", "purged": 0, "dry_run": True, "msgids": []}
    base = f"http://127.0.0.1:{broker.gateway.port}/v1/apps/typo"
    async with http.get(f"{base}/messages") as response:
        assert (response.status, await response.json()) == (200, {"messages": []})
    async with http.post(f"{base}/purge", json={}) as response:
        assert response.status == 200 and (await response.json())["purged"] == 0


# -- skmq purge ----------------------------------------------------------------------
async def test_purge_removes_exactly_what_waits_and_logs_each(
    store: OwnedStore, cli: Cli, tmp_path: Path
) -> None:
    now = now_ms()
    await stored(store, "q", "f1")  # in flight: never purged
    got, _, _ = await store.claim("q", now, 1, [AliveRecipient("r", 1, True)], ["r"])
    assert [c.msgid for c in got] == ["f1"]
    await stored(store, "q", "o1", "o2", "o3", "y1", "y2")
    waiting = ["o1", "o2", "o3", "y1", "y2"]
    older = await store.purge_waiting("q", 3_600_000, None, True, now_ms())
    assert older == []  # none stored an hour ago

    async def left() -> list[str]:
        return [w.msgid for w in await store.peek("q", 100, now_ms())]

    dry = await cli_json(cli, "purge", "--app", "q", "--dry-run")
    assert dry == {"app": "q", "purged": 5, "dry_run": True, "msgids": waiting}
    assert await left() == waiting and cli_purges(tmp_path) == []
    code, out, err = await cli("purge", "--app", "q", "--max", "3", "--dry-run")
    assert (code, out.strip()) == (0, "dry run: would purge 3 message(s) of app q; nothing done")
    picked = await cli_json(cli, "purge", "--app", "q", "--older-than", "0.001", "--max", "2")
    assert picked == {"app": "q", "purged": 2, "dry_run": False, "msgids": ["o1", "o2"]}
    assert await left() == ["o3", "y1", "y2"]
    code, out, err = await cli("purge", "--app", "q", "--max", "1")
    assert (code, out.strip()) == (0, "purged 1 message(s) of app q"), err
    assert await left() == ["y1", "y2"]
    assert await cli_json(cli, "purge", "--app", "q") == {
        "app": "q", "purged": 2, "dry_run": False, "msgids": ["y1", "y2"]
    }  # fmt: skip
    counts = (await store.counts(["q"], now_ms()))["q"]
    assert (counts.pending, counts.delayed, counts.in_flight) == (0, 0, 1)
    logged = cli_purges(tmp_path)
    assert [(app, msgid, rid) for app, msgid, rid, _ in logged] == [("q", m, None) for m in waiting]
    assert all(d.startswith(f"{PENDING_PURGED} by an operator (user ") for *_, d in logged)
    (ack,) = await store.finish("q", [(got[0].delivery_id, 0)], now_ms())
    assert ack.ok  # the one in flight was left alone


async def test_a_purged_first_message_of_a_key_lets_the_next_go(store: OwnedStore) -> None:
    now = now_ms()
    await stored(store, "o", "k1", "k2", "k3", key="k")
    assert [p.msgid for p in await store.purge_waiting("o", None, 1, False, now)] == ["k1"]
    got, _, _ = await store.claim("o", now, 5, [AliveRecipient("r", 5, True)], ["r"] * 5)
    assert [c.msgid for c in got] == ["k2"]  # k3 still waits behind it
    assert [p.msgid for p in await store.purge_waiting("o", None, None, False, now)] == ["k3"]
    (ack,) = await store.finish("o", [(got[0].delivery_id, 0)], now)
    assert ack.ok  # (k3 purged meanwhile: nothing left behind its key)
    counts = (await store.counts(["o"], now))["o"]
    assert (counts.pending, counts.delayed, counts.in_flight, counts.dead) == (0, 0, 0, 0)
    assert await store.peek("o", 10, now) == []  # nothing left behind


async def test_a_topic_copy_waiting_is_purged_alone(
    wire: Wire, redis: aioredis.Redis, prefix: str
) -> None:
    store = OwnedStore(redis, prefix)  # (this process owns the app, its recipients r1, r2)
    store.owners = await owners(wire, prefix, "t", rids=("r1", "r2"))
    now = now_ms()
    await stored(store, "t", "t1", kind="topic")
    alive = [AliveRecipient("r1", 1, True), AliveRecipient("r2", 0, True)]
    got, _, _ = await store.claim("t", now, 5, alive, [])
    assert [(c.msgid, c.recipient) for c in got] == [("t1", "r1")]  # r2's copy waits
    purged = await store.purge_waiting("t", None, None, False, now)
    assert purged == [Purged("t1", "topic", "r2")]
    (ack,) = await store.finish("t", [(got[0].delivery_id, 0)], now)
    assert ack.ok
    assert not store.owners.owned["t"].queue.deliveries  # nothing left behind


# -- HTTP ------------------------------------------------------------------------------
async def test_an_age_or_a_limit_past_any_stores_means_none_or_all(
    make_broker: BrokerFactory, cli: Cli, http: aiohttp.ClientSession, redis_url: str, prefix: str
) -> None:
    """A purge older than 1e308 s finds nothing and one of at most 2**64 or 10**30 finds
    everything, from the CLI (another process: the owner asked through its inbox) and
    over HTTP: no 500, no owner that never replies (an OverflowError, islice's
    ValueError)."""
    broker = await make_broker(http_port=free_port())
    await stored(broker.store, "hx", "h1", "h2")
    everything = {"app": "hx", "purged": 2, "dry_run": True, "msgids": ["h1", "h2"]}
    nothing = {**everything, "purged": 0, "msgids": []}
    huge = str(2**64)
    assert await cli_json(cli, "purge", "--app", "hx", "--max", huge, "--dry-run") == everything
    assert await cli_json(cli, "purge", "--app", "hx", "--older-than", "1e308", "--dry-run") == (
        nothing
    )
    url = f"http://127.0.0.1:{broker.gateway.port}/v1/apps/hx/purge"
    for body, expected in (
        ({"older_than_s": 1e308, "dry_run": True}, nothing),
        ({"max": 2**64, "dry_run": True}, everything),
        ({"max": 10**30, "dry_run": True}, everything),
        ({"older_than_s": 1e308}, {**nothing, "dry_run": False}),
    ):
        async with http.post(url, json=body) as response:
            assert (response.status, await response.json()) == (200, expected), body
    # a request the owner fails on (islice's ValueError) is answered with the fault, not
    # left to the asker's timeout
    async with aioredis.from_url(redis_url) as redis:
        with pytest.raises(OperatorFault, match="the owner of app 'hx' failed: ValueError"):
            await ask_owner(redis, prefix, "hx", Request("purge", -1, None, True), timeout=30)


async def test_the_console_over_http_is_for_admins(
    make_broker: BrokerFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[[tokens]]\nname = "ops"\ntoken = "{ADMIN}"\napps = ["*"]\nroles = ["admin"]\n'
        f'[[tokens]]\nname = "tenant"\ntoken = "{TENANT}"\napps = ["h"]\nroles = ["admin"]\n'
        f'[[tokens]]\nname = "c"\ntoken = "{CONSUMER}"\napps = ["h"]\nroles = ["consume"]\n'
    )
    broker = await make_broker(http_port=free_port(), auth_file=tokens)
    base = f"http://127.0.0.1:{broker.gateway.port}/v1/apps"
    await stored(broker.store, "h", "h1", "h2", "h3")
    await stored(broker.store, "other", "x1")

    async def call(method: str, path: str, token: str | None, body: Any = None) -> Any:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with http.request(method, base + path, json=body, headers=headers) as response:
            return response.status, await response.json()

    status, listed = await call("GET", "", ADMIN)
    assert status == 200
    assert sorted(a["app"] for a in listed["apps"]) == ["h", "other"]
    status, listed = await call("GET", "", TENANT)
    (h,) = listed["apps"]
    assert (status, h["app"], h["pending"], h["rate_in"]) == (200, "h", 3, 0.0)
    assert set(h) == {"app", "pending", "delayed", "in_flight", "dead", "oldest_pending_age_s",
                      "recipients", "groups", "rate_in", "rate_out", "unroutable"}  # fmt: skip
    status, peeked = await call("GET", "/h/messages?max=2", TENANT)
    assert (status, [m["msgid"] for m in peeked["messages"]]) == (200, ["h1", "h2"])
    assert set(peeked["messages"][0]) == {"msgid", "age_s", "attempts", "key", "size", "preview"}
    for query in (f"max={PEEK_MAX + 1}", "max=0", "max=x", "dead=2"):
        status, error = await call("GET", f"/h/messages?{query}", TENANT)
        assert status == 400 and error["error"].startswith(query[:3]), query
    assert (await call("GET", "/h/messages?dead=1", TENANT)) == (200, {"messages": []})
    dry = {"older_than_s": 0.001, "max": 2, "dry_run": True}
    assert await call("POST", "/h/purge", TENANT, dry) == (
        200, {"app": "h", "purged": 2, "dry_run": True, "msgids": ["h1", "h2"]}
    )  # fmt: skip
    assert await call("POST", "/h/purge", TENANT, {"max": 1}) == (
        200, {"app": "h", "purged": 1, "dry_run": False, "msgids": ["h1"]}
    )  # fmt: skip
    assert (await call("POST", "/h/purge", TENANT, {"max": 0}))[0] == 400
    assert (await call("POST", "/h/purge", TENANT, {"older_than_s": "1"}))[0] == 400
    for method, path, body in (("GET", "", None), ("GET", "/h/messages", None),
                               ("POST", "/h/purge", {})):  # fmt: skip
        assert (await call(method, path, None, body))[0] == 401
        assert (await call(method, path, CONSUMER, body))[0] == 403
    assert (await call("GET", "/other/messages", TENANT))[0] == 403
    assert (await call("POST", "/other/purge", TENANT, {}))[0] == 403
    assert [w.msgid for w in await broker.store.peek("h", 10, now_ms())] == ["h2", "h3"]
    assert [w.msgid for w in await broker.store.peek("other", 10, now_ms())] == ["x1"]
    (line,) = log_events(broker, event="purged")
    assert (line["msgid"], line["appid"], line["kind"]) == ("h1", "h", "queue")
    assert line["detail"] == f"{PENDING_PURGED} by an operator (token tenant)"


def test_a_preview_escapes_what_a_terminal_would_act_on() -> None:
    assert preview(b"a\x1b[31mb\r\n\t\x7f\xe2\x80\x8b") == "a\\x1b[31mb\\r\\n\\t\\x7f\\u200b"
    assert preview("é".encode() * 40) == "é" * 32  # 64 bytes
    assert preview(b"\xc3") == "\\xc3"  # a character cut short
