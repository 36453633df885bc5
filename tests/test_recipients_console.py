"""The operator's console (issue 39), against a real broker with real TCP recipients:
`skmq recipients` (list, remove), `skmq connections`, takeovers of a recipient id,
unroutable messages and `mandatory`, and the same over HTTP with and without the admin
token."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from skmq.broker import Broker
from skmq.client import Consumer, Message, Producer
from skmq.clock import now_ms
from skmq.connections import ConnectionInfo, Connections, live_connections
from tests.conftest import BrokerFactory, eventually, free_port
from tests.peers import FakeRecipient, RawClient
from tests.test_cli_ops import skmq
from tests.test_delivery import log_events, logged

ADMIN = "console-admin-token-0123456789"
CONSUMER = "console-consume-token-0123456789"


@pytest.fixture
def env(redis_url: str, prefix: str, tmp_path: Path) -> dict[str, str]:
    """The settings of an operator's command run beside the brokers of a test."""
    return {"SKMQ_REDIS_URL": redis_url, "SKMQ_KEY_PREFIX": prefix,
            "SKMQ_DATA_DIR": str(tmp_path / "cli")}  # fmt: skip


async def run(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    return await asyncio.to_thread(skmq, *args, env=env)


async def recipients_json(env: dict[str, str], app: str) -> list[dict[str, Any]]:
    code, out, err = await run(env, "recipients", "--app", app, "--json")
    assert code == 0, err
    listed: list[dict[str, Any]] = json.loads(out)["recipients"]
    return listed


async def state_of(broker: Broker, app: str, rid: str) -> str | None:
    for r in (await broker.store.recipients([app]))[app]:
        if r["id"] == rid:
            return "alive" if r["alive"] else "lost"
    return None


# -- skmq recipients ---------------------------------------------------------------------


async def test_remove_of_a_lost_recipient_frees_its_topic_copies(
    make_broker: BrokerFactory, env: dict[str, str], tmp_path: Path
) -> None:
    broker = await make_broker(retry_times=10)
    app = "rc"
    stays = await FakeRecipient(app, "stays", weight=2).start()
    gone = await FakeRecipient(app, "gone", lambda f: "silent").start()
    for r in (stays, gone):
        assert (await r.register(broker.server.port))["status"] == "ack"

    listed = await recipients_json(env, app)
    assert [(r["app"], r["id"], r["state"], r["weight"]) for r in listed] == [
        (app, "gone", "alive", 0), (app, "stays", "alive", 2)
    ]  # fmt: skip
    assert listed[1]["address"] == f"127.0.0.1:{stays.port}"
    assert 0 <= listed[1]["last_seen_age_s"] < 60

    client = await RawClient.connect(broker.server.port)
    assert (await client.request("topic", b"t1", appid=app, msgid="t1"))["status"] == "ack"
    assert (await stays.next_push()).fields["msgid"] == "t1"
    assert (await gone.next_push()).fields["msgid"] == "t1"  # and never answered
    await gone.stop()  # its push connection breaks; no pong to the next heartbeat: lost
    await eventually(lambda: _is(state_of(broker, app, "gone"), "lost"), 20)
    code, out, err = await run(env, "recipients", "--app", app)
    assert code == 0, err
    assert "gone" in out and "lost" in out and "stays" in out, out
    # The lost recipient's copy waits for it (spending no attempt), never in flight.
    await eventually(lambda: _waiting(broker, app, 1), 20)

    code, out, err = await run(env, "recipients", "remove", "--app", app, "--id", "gone")
    assert (code, out.strip()) == (0, f"removed recipient gone of app {app}"), err
    assert "operator action" in err and "recipients remove" in err, err
    code, out, _ = await run(env, "recipients", "remove", "--app", app, "--id", "gone", "--json")
    assert (code, json.loads(out)) == (1, {"app": app, "id": "gone", "removed": False})
    assert [r["id"] for r in await recipients_json(env, app)] == ["stays"]

    # Nothing waits for the removed one: its copy fails as undeliverable and is
    # dead-lettered; the other recipient gets the next topic message alone.
    async def copy_dead() -> bool:
        return [(d.msgid, d.recipient) for d in await broker.store.dead_letters(app)] == [
            ("t1", "gone")
        ]

    await eventually(copy_dead, 20)
    assert (await client.request("topic", b"t2", appid=app, msgid="t2"))["status"] == "ack"
    assert (await stays.next_push()).fields["msgid"] == "t2"
    await eventually(lambda: _settled(broker, app))
    await client.close()
    await stays.stop()

    (removed,) = [e for e in log_events(tmp_path / "cli" / "delivery-log")
                  if e["event"] == "recipient_removed"]  # fmt: skip
    assert (removed["appid"], removed["recipient"]) == (app, "gone")
    assert removed["detail"].startswith("by ") and removed["detail"].endswith(" via cli")


async def _is(value: Any, expected: Any) -> bool:
    return await value == expected


async def _waiting(broker: Broker, app: str, n: int) -> bool:
    c = (await broker.store.counts([app], now_ms()))[app]
    return (c.pending + c.delayed, c.in_flight) == (n, 0)


async def _settled(broker: Broker, app: str) -> bool:
    c = (await broker.store.counts([app], now_ms()))[app]
    return (c.pending, c.delayed, c.in_flight) == (0, 0, 0)


# -- skmq connections --------------------------------------------------------------------


async def test_connections_list_a_producer_a_push_link_and_pull_polls(
    make_broker: BrokerFactory, env: dict[str, str]
) -> None:
    broker = await make_broker(http_port=free_port())
    rec = await FakeRecipient("cx", "r").start()
    assert (await rec.register(broker.server.port))["status"] == "ack"
    producer = await RawClient.connect(broker.server.port)
    assert (await producer.request("queue", b"m", appid="cx", msgid="m1"))["status"] == "ack"
    await rec.next_push()  # the push link is open (and stays: it takes pipelined pushes)
    puller = await RawClient.connect(broker.server.port)
    created = await puller.request("pull", b'{"group":"g"}', appid="cy", op="create", group="g")
    assert created["status"] == "ack", created
    puller.send("pull", b'{"max":1,"wait":20}', appid="cy", op="receive", group="g")
    base = f"http://127.0.0.1:{broker.gateway.port}"
    async with aiohttp.ClientSession() as http:
        poll = asyncio.create_task(
            http.post(f"{base}/v1/apps/cy/groups/g/receive", json={"max": 1, "wait": 20})
        )
        producer_at = "127.0.0.1:{}".format(producer.writer.get_extra_info("sockname")[1])
        puller_at = "127.0.0.1:{}".format(puller.writer.get_extra_info("sockname")[1])
        wanted = {
            ("producer", producer_at, ("cx",)),
            ("recipient push link", f"127.0.0.1:{rec.port}", ("cx",)),
            ("pull consumer", puller_at, ("cy",)),
        }

        async def listed() -> bool:
            rows, _ = live_connections(await broker.store.brokers(), now_ms())
            roles = {(r["role"], r["peer"], tuple(r["apps"])) for r in rows}
            return wanted <= roles and any(r["role"] == "http" for r in rows)

        await eventually(listed)
        code, out, err = await run(env, "connections", "--json")
        assert code == 0, err
        shown = json.loads(out)
        assert shown["truncated"] == 0
        rows = shown["connections"]
        assert wanted <= {(r["role"], r["peer"], tuple(r["apps"])) for r in rows}
        (http_row,) = [r for r in rows if r["role"] == "http"]
        assert http_row["apps"] == ["cy"] and http_row["broker"] == broker.broker_id
        assert all(r["broker"] == broker.broker_id and r["since_s"] >= 0 for r in rows)
        code, out, err = await run(env, "connections")
        assert code == 0 and "recipient push link" in out and "pull consumer" in out, err

        async with http.get(f"{base}/v1/connections") as response:
            assert response.status == 200
            body = await response.json()
        assert set(body) == {"connections", "truncated"}
        assert {"broker", "peer", "role", "apps", "since_s"} == set(body["connections"][0])
        poll.cancel()
    for c in (producer, puller):
        await c.close()
    await rec.stop()


def test_a_broker_note_lists_at_most_its_cap_and_counts_the_rest() -> None:
    table = Connections()
    table.add_source(
        lambda: (ConnectionInfo(f"10.0.0.1:{p}", "producer", ("a",), 1) for p in range(5))
    )
    with table.polling("10.0.0.2:9", "b"):
        note = table.note(most=2)
        assert [c["role"] for c in note["connections"]] == ["http", "producer"]
        assert note["truncated"] == 4
    now = now_ms()
    notes = {
        "live": {"last_seen": now, **note},
        "stopped": {"last_seen": now - 60_000, **note},  # a stopped broker's note
        "old": {"last_seen": now},  # a broker of an earlier release: no connections
    }
    rows, truncated = live_connections(notes, now)
    assert [(r["broker"], r["role"]) for r in rows] == [("live", "http"), ("live", "producer")]
    assert truncated == 4


# -- takeovers ---------------------------------------------------------------------------


async def test_a_takeover_is_logged_counted_and_shown(
    make_broker: BrokerFactory, env: dict[str, str]
) -> None:
    broker = await make_broker()
    app = "tk"
    first = await FakeRecipient(app, "same").start()
    second = await FakeRecipient(app, "same").start()
    assert (await first.register(broker.server.port))["status"] == "ack"
    assert (await first.register(broker.server.port))["status"] == "ack"  # same address
    client = await RawClient.connect(broker.server.port)
    client.send("register", second.registration())
    resp = await client.recv()
    assert json.loads(resp.content or b"")["status"] == "ack"
    assert resp.fields["took_over"] == f"127.0.0.1:{first.port}"
    await client.close()

    (line,) = await logged(broker, "recipient_taken_over", app=app)
    assert line["recipient"] == "same"
    assert line["detail"] == f"from 127.0.0.1:{first.port} to 127.0.0.1:{second.port}"
    tally = (await broker.store.tallies([app]))[app]
    assert tally.takeovers == 1
    assert tally.last_takeover is not None
    assert tally.last_takeover["from"] == f"127.0.0.1:{first.port}"

    code, out, err = await run(env, "status", "--json")
    assert code == 0, err
    (shown,) = [a for a in json.loads(out)["apps"] if a["appid"] == app]
    assert shown["takeovers"] == 1 and shown["last_takeover"]["id"] == "same"
    code, out, err = await run(env, "status")
    assert code == 0 and f"takeover: app {app} recipient same taken over from" in out, out

    # A consumer started with the id in use says whose place it took.
    consumer = Consumer(app, "same", ignore, port=0, broker_port=broker.server.port)
    await consumer.start()
    assert consumer.took_over == f"127.0.0.1:{second.port}"
    await consumer.stop()
    assert (await broker.store.tallies([app]))[app].takeovers == 2
    for r in (first, second):
        await r.stop()


async def ignore(_: Message) -> None:
    """(the handler of a consumer whose messages the test does not look at)"""


async def test_skmq_consume_says_it_took_the_id_over(make_broker: BrokerFactory) -> None:
    broker = await make_broker()
    first = await FakeRecipient("tc", "dup").start()
    assert (await first.register(broker.server.port))["status"] == "ack"
    base = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "skmq.cli", "consume", "--app", "tc", "--id", "dup",
        "--port", "0", "--broker-port", str(broker.server.port),
        stderr=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL, env=base,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(30):
            while b"took the id" not in (line := await proc.stderr.readline()):
                assert line, "skmq consume ended without saying so"
        assert f"over from 127.0.0.1:{first.port}".encode() in line, line
    finally:
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
        await first.stop()


# -- unroutable messages and mandatory ---------------------------------------------------


def metric(text: str, app: str) -> float | None:
    start = f'skmq_unroutable_total{{app="{app}"}} '
    found = [line for line in text.splitlines() if line.startswith(start)]
    return float(found[0].split()[-1]) if found else None


async def test_mandatory_refuses_what_no_one_can_receive_and_the_rest_is_counted(
    make_broker: BrokerFactory, env: dict[str, str]
) -> None:
    broker = await make_broker(http_port=free_port())
    app = "nobody"
    client = await RawClient.connect(broker.server.port)
    refused = await client.request("queue", b"x", appid=app, msgid="m1", mandatory="1")
    assert refused["status"] == "reject"
    assert refused["content"] == "unroutable: no recipient and no group for app nobody"
    bad = await client.request("queue", b"x", appid=app, msgid="m1", mandatory="yes")
    assert (bad["status"], bad["content"]) == ("error", "mandatory must be 0 or 1")
    assert (await client.request("queue", b"x", appid=app, msgid="m2"))["status"] == "ack"
    counts = (await broker.store.counts([app], now_ms()))[app]
    assert counts.pending == 1  # m2 only: m1 was never stored
    never, stored = await broker.store.stored_of(app, ["m1", "m2"], now_ms())
    assert never is None and stored

    base = f"http://127.0.0.1:{broker.gateway.port}"
    async with aiohttp.ClientSession() as http:
        body = {"content": "x", "msgid": "h1", "mandatory": True}
        async with http.post(f"{base}/v1/apps/{app}/messages", json=body) as response:
            assert response.status == 422
            assert (await response.json())["error"] == (
                "unroutable: no recipient and no group for app nobody"
            )
        body = {"content": "x", "msgid": "h2"}
        async with http.post(f"{base}/v1/apps/{app}/messages", json=body) as response:
            assert (response.status, (await response.json())["status"]) == (200, "stored")

        async def counted() -> bool:
            async with http.get(f"{base}/metrics") as response:
                return metric(await response.text(), app) == 2

        await eventually(counted)

    async with Producer("127.0.0.1", broker.server.port) as producer:
        resp = await producer.send(app, b"x", mandatory=True)
        assert (resp.status, resp.content.startswith("unroutable:")) == ("reject", True)
        # A recipient registered through this broker makes the app routable at once.
        rec = await FakeRecipient(app, "r").start()
        assert (await rec.register(broker.server.port))["status"] == "ack"
        assert (await producer.send(app, b"x", mandatory=True)).status == "ack"
        await rec.stop()

    async def in_status() -> bool:
        code, out, _ = await run(env, "status", "--json")
        return code == 0 and [a["unroutable"] for a in json.loads(out)["apps"]
                              if a["appid"] == app] == [2]  # fmt: skip

    await eventually(in_status, 20)
    await client.close()


async def test_a_consumer_group_makes_an_app_routable(make_broker: BrokerFactory) -> None:
    broker = await make_broker()
    client = await RawClient.connect(broker.server.port)
    made = await client.request("pull", b'{"group":"g"}', appid="grouped", op="create", group="g")
    assert made["status"] == "ack", made
    sent = await client.request("queue", b"x", appid="grouped", msgid="m1", mandatory="1")
    assert sent["status"] == "ack", sent
    await client.close()


# -- HTTP: admin only ---------------------------------------------------------------------


async def test_http_routes_need_the_admin_token(make_broker: BrokerFactory, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(
        f'[[tokens]]\nname = "ops"\ntoken = "{ADMIN}"\napps = ["h"]\nroles = ["admin"]\n'
        f'[[tokens]]\nname = "c"\ntoken = "{CONSUMER}"\napps = ["h", "other"]\n'
        'roles = ["consume"]\n'
    )
    broker = await make_broker(http_port=free_port(), auth_file=tokens)
    recipients = [await FakeRecipient(app, "r").start() for app in ("h", "other")]
    for r in recipients:
        client = await RawClient.connect(broker.server.port)
        assert (await client.request("auth", token=CONSUMER))["status"] == "ack"
        assert (await client.request("register", r.registration()))["status"] == "ack"
        await client.close()
    base = f"http://127.0.0.1:{broker.gateway.port}/v1"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    consumer = {"Authorization": f"Bearer {CONSUMER}"}
    async with aiohttp.ClientSession() as http:

        async def call(method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
            async with http.request(method, f"{base}/{path}", headers=headers) as response:
                return response.status, await response.json()

        status, listed = await call("GET", "recipients", admin)  # only its apps
        assert status == 200
        assert [(r["app"], r["id"], r["state"]) for r in listed["recipients"]] == [
            ("h", "r", "alive")
        ]
        assert set(listed["recipients"][0]) == {
            "app", "id", "address", "weight", "state", "last_seen_age_s"
        }  # fmt: skip
        assert (await call("GET", "recipients?app=h", admin))[1] == listed
        assert (await call("GET", "recipients?app=other", admin))[0] == 403
        assert (await call("GET", "recipients?app=h", consumer))[0] == 403
        assert (await call("GET", "recipients", consumer))[0] == 403
        assert (await call("GET", "recipients", {}))[0] == 401
        assert (await call("GET", "connections", admin))[0] == 200
        assert (await call("GET", "connections", consumer))[0] == 403
        assert (await call("GET", "connections", {}))[0] == 401

        assert (await call("DELETE", "apps/h/recipients/r", consumer))[0] == 403
        assert (await call("DELETE", "apps/other/recipients/r", admin))[0] == 403
        assert (await call("DELETE", "apps/h/recipients/r", {}))[0] == 401
        assert await call("DELETE", "apps/h/recipients/r", admin) == (
            200, {"app": "h", "id": "r", "removed": True}
        )  # fmt: skip
        assert await call("DELETE", "apps/h/recipients/r", admin) == (
            200, {"app": "h", "id": "r", "removed": False}
        )  # fmt: skip
        assert (await call("DELETE", "apps/h/recipients/a%01b", admin))[0] == 400
    assert await broker.store.recipients(["h", "other"]) == {
        "h": [], "other": (await broker.store.recipients(["other"]))["other"]
    }  # fmt: skip
    (line,) = await logged(broker, "recipient_removed", app="h")
    assert (line["recipient"], line["detail"]) == ("r", "by ops via http")
    assert broker.engine.registry.get("h", "r") is None
    for r in recipients:
        await r.stop()
