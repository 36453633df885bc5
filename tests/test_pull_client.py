"""The Python pull consumer (skmq/pull/consumer.py) and `skmq consume --pull`, against a
real broker: over its HTTP gateway, and over its TCP port (the `pull` frame)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from skmq.broker import Broker
from skmq.cli.broker_settings import BrokerAddresses, broker_addresses
from skmq.errors import UsageError
from skmq.pull.consumer import PullConsumer, PullError
from skmq.pull.position import BadPosition
from tests.commands import skmq_command
from tests.conftest import BrokerFactory, free_port
from tests.peers import RawClient


async def gateway(make_broker: BrokerFactory) -> tuple[Broker, str]:
    broker = await make_broker(http_port=free_port())
    return broker, f"http://127.0.0.1:{broker.gateway.port}"


@pytest.fixture(params=["http", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def consumer_url(broker: Broker, url: str, transport: str) -> str:
    """Where a pull consumer connects: the gateway, or the broker's TCP port."""
    return url if transport == "http" else f"tcp://127.0.0.1:{broker.server.port}"


async def produce(url: str, app: str, *msgids: str) -> None:
    batch = {"messages": [{"msgid": m, "content": f"body {m}"} for m in msgids]}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/apps/{app}/messages", json=batch) as r,
    ):
        assert r.status == 200


async def test_async_for_with_ack_nack_and_a_lease_kept_while_handling(
    make_broker: BrokerFactory, transport: str
) -> None:
    broker, url = await gateway(make_broker)
    where = consumer_url(broker, url, transport)
    async with (
        PullConsumer(where, "shop", "g", wait=5, visibility=0.4, batch=1) as first,
        PullConsumer(where, "shop", "g", wait=0.5, visibility=0.4, batch=1) as other,
    ):
        await produce(url, "shop", "m1", "m2")
        messages = aiter(first)
        msg = await anext(messages)
        assert (msg.msgid, msg.content, msg.attempt) == ("m1", b"body m1", 1)
        async with msg.leased():
            await asyncio.sleep(1.0)  # past the 0.4 s visibility: extended meanwhile
            assert [m.msgid for m in await other.receive()] == ["m2"]  # not m1
        assert await msg.ack()
        assert await msg.nack() == "stale"
        again = await anext(messages)  # m2's lease (other's) ran out: redelivered
        assert (again.msgid, again.attempt) == ("m2", 2)
        assert await again.nack(delay_ms=0) == "retry"
        third = await anext(messages)
        assert (third.msgid, third.attempt) == ("m2", 3)
        assert await third.ack()


async def test_messages_buffered_when_a_loop_is_left_come_back_at_once(
    make_broker: BrokerFactory, transport: str
) -> None:
    """A loop left after its first message: the batch's others, received and never
    handed out, are nacked as the consumer closes (not held until their leases run out)."""
    broker, url = await gateway(make_broker)
    where = consumer_url(broker, url, transport)
    async with PullConsumer(where, "shop", "g", wait=5, visibility=60, batch=10) as first:
        await produce(url, "shop", "m1", "m2", "m3")
        async for msg in first:
            assert msg.msgid == "m1"
            msg.ack()
            break
        assert first.buffered == 2
    async with PullConsumer(where, "shop", "g", wait=5, visibility=60, batch=10) as other:
        again = await other.receive()
        assert sorted((m.msgid, m.attempt) for m in again) == [("m2", 2), ("m3", 2)]
        assert await other.ack_all(again) == [True, True]


async def test_refusals_are_pull_errors(make_broker: BrokerFactory, transport: str) -> None:
    broker, url = await gateway(make_broker)
    where = consumer_url(broker, url, transport)
    async with PullConsumer(where, "shop", "g", create_group=False) as consumer:
        try:
            await consumer.receive()
        except PullError as exc:
            assert (exc.status, exc.error) == (404, "no group 'g' for app 'shop'")
        else:
            raise AssertionError("no PullError")


async def test_skmq_consume_pull_prints_and_acks_until_stopped(
    make_broker: BrokerFactory, transport: str
) -> None:
    broker, url = await gateway(make_broker)
    where = consumer_url(broker, url, transport)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "skmq.cli", "consume", "--pull", "--group", "cli", "--app", "shop",
        "--gateway", where, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    async with asyncio.timeout(30):
        assert b"pulling shop/cli" in await proc.stderr.readline()
        await produce(url, "shop", "c1", "c2")
        lines = [await proc.stdout.readline(), await proc.stdout.readline()]
    assert lines == [b"shop c1 body c1\n", b"shop c2 body c2\n"]
    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(30):
        _, err = await proc.communicate()
    assert proc.returncode == 0
    assert b"stopped (acked=2 nacked=0)" in err
    infos = await broker.groups.describe("shop")
    assert (infos[0].in_flight, infos[0].backlog) == (0, 0)


@pytest.mark.parametrize("scheme", ["http", "tcp"])
async def test_skmq_consume_pull_stops_on_sigterm_while_the_gateway_says_nothing(
    scheme: str,
) -> None:
    """A gateway that accepts and never answers: SIGTERM ends the start at once, one
    line, status 1 (it was waiting for the gateway, not for a message it holds)."""
    accepted = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        await reader.read()  # until the consumer goes
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    where = f"{scheme}://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "skmq.cli", "consume", "--pull", "--group", "g", "--app", "a",
        "--gateway", where, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(30):
        await accepted.wait()  # (its signal handlers are set before it connects)
        proc.send_signal(signal.SIGTERM)
        _, err = await proc.communicate()
    server.close()
    assert (proc.returncode, err.decode()) == (
        1,
        f"skmq consume: stopped before {where} answered\n",
    )


async def test_skmq_consume_needs_a_group_to_pull_and_an_id_to_be_pushed_to() -> None:
    for args, said in (
        (
            ["--pull", "--group", "g", "--gateway", "ftp://h/"],
            b"skmq consume: --gateway must be http://, https:// or tcp://HOST:PORT\n",
        ),
        (["--pull"], b"skmq consume: --pull needs --group G\n"),
        ([], b"skmq consume: --id and --port are required (or --pull --group G)\n"),
    ):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "skmq.cli", "consume", "--app", "a", *args,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await proc.communicate()
        assert (proc.returncode, err) == (2, said)


def test_skmq_consume_pull_without_aiohttp_says_what_to_install() -> None:
    """A client-only install (no `server` extra): one line, what to do."""
    done = subprocess.run(
        skmq_command("consume", "--pull", "--app", "a", "--group", "g", without=["aiohttp"]),
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")},
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (
        2,
        "skmq consume: the HTTP gateway needs aiohttp: pip install 'skmq[server]', "
        "or use --gateway tcp://HOST:PORT (the broker's port)\n",
    )


async def consume_from(gateway: str) -> tuple[int | None, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "skmq.cli", "consume", "--pull", "--group", "g", "--app", "a",
        "--gateway", gateway, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(30):
        _, err = await proc.communicate()
    return proc.returncode, err.decode()


async def test_skmq_consume_pull_at_the_protocol_port_over_http_says_so(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker()
    where = f"127.0.0.1:{broker.server.port}"
    assert await consume_from(f"http://{where}") == (
        2,
        f"skmq consume: http://{where} does not answer HTTP (the broker's protocol port? "
        f"use tcp://{where} for that)\n",
    )


async def test_skmq_consume_pull_at_an_http_server_that_is_not_the_gateway_says_so() -> None:
    async def page(_: web.Request) -> web.Response:
        return web.Response(text="<html>hello</html>")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", page)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        where = f"http://127.0.0.1:{runner.addresses[0][1]}"
        assert await consume_from(where) == (
            2,
            f"skmq consume: {where} does not answer as SKMQ's HTTP gateway\n",
        )
    finally:
        await runner.cleanup()


async def test_the_pull_frame_on_the_raw_tcp_protocol(make_broker: BrokerFactory) -> None:
    """`pull` frames as a client in any language would write them (docs/PROTOCOL.md):
    create, receive, ack by receipt; refusals carry the HTTP status first."""
    broker, url = await gateway(make_broker)
    client = await RawClient.connect(broker.server.port)
    try:
        created = await client.request("pull", b"", appid="shop", group="raw", op="create")
        assert created["status"] == "ack", created
        assert json.loads(created["content"]) == {"group": "raw", "created": True}
        none = await client.request("pull", None, appid="shop", group="raw", op="receive")
        assert json.loads(none["content"]) == {"messages": []}  # no content: the defaults
        await produce(url, "shop", "t1")
        got = await client.request("pull", b'{"max": 5, "wait": 1}', appid="shop", group="raw",
                                   op="receive")  # fmt: skip
        (msg,) = json.loads(got["content"])["messages"]
        assert (msg["msgid"], msg["content"], msg["attempt"]) == ("t1", "body t1", 1)
        body = json.dumps({"receipts": [msg["receipt"]]}).encode()
        acked = await client.request("pull", body, appid="shop", group="raw", op="ack")
        assert json.loads(acked["content"])["results"][0]["status"] == "acked"
        for content, fields, said in (
            (b"{", {"group": "raw", "op": "ack"}, "400 content is not valid JSON"),
            (b"[" * 60_000, {"group": "raw", "op": "ack"}, "400 content is nested too deeply"),
            (
                b'{"max": 1' + b"0" * 5000 + b"}",
                {"group": "raw", "op": "receive"},
                "400 content holds a number of more than 4300 digits",
            ),
            (b"{}", {"group": "raw", "op": "reset"}, "400 op must be one of"),
            (b"{}", {"group": "bad name", "op": "receive"}, "400 group must be"),
            (b"{}", {"group": "none", "op": "receive"}, "404 no group 'none' for app 'shop'"),
            (
                body,  # the receipt of group raw, in a group that does not exist
                {"group": "none", "op": "ack"},
                "404 no group 'none' for app 'shop'",
            ),
            (b'{"max": 100000}', {"group": "raw", "op": "receive"}, "400 max: at most"),
        ):
            refused = await client.request("pull", content, appid="shop", **fields)
            assert refused["status"] == "reject", refused
            assert refused["content"].startswith(said), refused
    finally:
        await client.close()


@pytest.mark.parametrize("found_by", ["environment", "config file", "http off: tcp", "flag"])
async def test_skmq_consume_pull_finds_the_gateway_from_the_brokers_settings(
    make_broker: BrokerFactory, tmp_path: Path, found_by: str
) -> None:
    """Without --gateway, the broker's own settings say where: SKMQ_HOST and
    SKMQ_HTTP_PORT, or its TOML file (--config); the protocol port (tcp://) when
    HTTP_PORT is 0. --gateway still wins over them."""
    broker, url = await gateway(make_broker)
    http_port, port = broker.gateway.port, broker.server.port
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    args: list[str] = []
    expected = url
    if found_by == "environment":
        env.update(SKMQ_HOST="0.0.0.0", SKMQ_HTTP_PORT=str(http_port))  # (any address)
    elif found_by == "config file":
        config = tmp_path / "skmq.toml"
        config.write_text(f'host = "127.0.0.1"\nhttp_port = {http_port}\nport = 9\n')
        env["SKMQ_PORT"] = str(port)  # (the environment beats the file, as for the broker)
        args = ["--config", str(config)]
    elif found_by == "http off: tcp":
        env.update(SKMQ_HTTP_PORT="0", SKMQ_PORT=str(port))
        expected = f"tcp://127.0.0.1:{port}"
    else:
        env.update(SKMQ_HTTP_PORT=str(free_port()))  # nothing there: the flag is what counts
        args = ["--gateway", url]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "skmq.cli", "consume", "--pull", "--group", "cli", "--app", "shop",
        *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    async with asyncio.timeout(30):
        said = await proc.stderr.readline()
        assert said == f"skmq consume: pulling shop/cli from {expected}\n".encode(), said
        await produce(url, "shop", "c1")
        assert await proc.stdout.readline() == b"shop c1 body c1\n"
    proc.send_signal(signal.SIGTERM)
    async with asyncio.timeout(30):
        await proc.communicate()
    assert proc.returncode == 0


def test_broker_addresses_are_read_as_the_broker_reads_its_settings(tmp_path: Path) -> None:
    config = tmp_path / "skmq.toml"
    config.write_text('host = "::"\nport = 2000\nhttp_port = 2001\nlog_level = "debug"\n')
    assert broker_addresses(None, {}) == BrokerAddresses("127.0.0.1", 1734, 1735)
    from_file = broker_addresses(config, {})
    assert from_file == BrokerAddresses("::1", 2000, 2001)
    assert from_file.gateway == "http://[::1]:2001"
    env = {"SKMQ_HOST": "broker.internal", "SKMQ_HTTP_PORT": "0"}
    assert broker_addresses(config, env).gateway == "tcp://broker.internal:2000"


@pytest.mark.parametrize(
    ("toml", "env", "said"),
    [
        (None, {"SKMQ_HTTP_PORT": "http"}, "invalid setting SKMQ_HTTP_PORT='http': not a port"),
        (None, {"SKMQ_PORT": "70000"}, "invalid setting SKMQ_PORT='70000': not a port"),
        ("http_port = true", {}, "invalid setting http_port in {config}=True: not a port"),
        ("host = 5", {}, "invalid setting host in {config}=5: not a host"),
        ("host = ", {}, "config file {config}: not valid TOML"),
        ("port = 1\nPORT = 2", {}, "config file {config}: 'port' and 'PORT' name one setting"),
    ],
)
def test_a_broker_setting_the_broker_would_refuse_is_one_line(
    tmp_path: Path, toml: str | None, env: dict[str, str], said: str
) -> None:
    config = tmp_path / "skmq.toml"
    if toml is not None:
        config.write_text(toml + "\n")
    with pytest.raises(UsageError) as refused:
        broker_addresses(config if toml is not None else None, env)
    assert str(refused.value).startswith(said.format(config=config))


def test_upper_case_keys_of_the_config_file_are_read_as_the_broker_reads_them(
    tmp_path: Path,
) -> None:
    config = tmp_path / "skmq.toml"
    port = free_port()  # nothing listens there: the error names where the consumer went
    config.write_text(f'HOST = "::"\nPORT = {port}\nHTTP_PORT = 0\n')
    assert broker_addresses(config, {}) == BrokerAddresses("::1", port, 0)
    config.write_text(f"PORT = {port}\nHTTP_PORT = 0\n")
    for args, said in (
        (["--pull", "--group", "g"], f"cannot reach tcp://127.0.0.1:{port}"),
        (["--id", "r", "--port", "0"], f"cannot reach broker at 127.0.0.1:{port}"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "skmq.cli", "consume", "--app", "a", "--config", str(config),
             *args],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
            env={k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")},
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(f"skmq consume: {said}: "), done.stderr


async def test_skmq_consume_with_a_config_file_that_is_not_there_says_so(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    for args in (["--pull", "--group", "g"], ["--id", "r", "--port", "0"]):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "skmq.cli", "consume", "--app", "a", "--config", str(missing),
            *args, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await proc.communicate()
        assert (proc.returncode, err) == (
            2,
            f"skmq consume: config file {missing}: no such file\n".encode(),
        )


async def test_a_consumer_creates_its_group_at_a_position(
    make_broker: BrokerFactory, transport: str
) -> None:
    broker, url = await gateway(make_broker)
    where = consumer_url(broker, url, transport)
    async with PullConsumer(where, "shop", "first", wait=0):
        pass  # (the app has a group: what is stored now is in its group log)
    await produce(url, "shop", "m1", "m2")
    async with (
        PullConsumer(where, "shop", "latest", wait=0) as latest,
        PullConsumer(where, "shop", "earliest", wait=0, position="earliest") as earliest,
        PullConsumer(where, "shop", "epoch", wait=0, position="1970-01-01T00:00:00Z") as epoch,
    ):
        assert await latest.receive() == []
        for consumer in (earliest, epoch):
            assert [m.msgid for m in await consumer.receive()] == ["m1", "m2"]
    with pytest.raises(BadPosition):
        PullConsumer(where, "shop", "g", position="yesterday")
    with pytest.raises(PullError) as refused:
        async with PullConsumer(where, "shop", "soon", position=253402300799999):
            pass
    assert refused.value.status == 400
    assert refused.value.error.startswith("position: 253402300799999 (unix ms) is after")


async def test_the_pull_frame_creates_a_group_at_a_position(make_broker: BrokerFactory) -> None:
    broker, url = await gateway(make_broker)
    client = await RawClient.connect(broker.server.port)
    try:
        await client.request("pull", None, appid="shop", group="first", op="create")
        await produce(url, "shop", "t1")
        created = await client.request(
            "pull", b'{"position": "earliest"}', appid="shop", group="e", op="create"
        )
        assert json.loads(created["content"]) == {"group": "e", "created": True}
        got = await client.request("pull", b"{}", appid="shop", group="e", op="receive")
        assert [m["msgid"] for m in json.loads(got["content"])["messages"]] == ["t1"]
        for content, said in (
            (b'{"position": "soon"}', "400 position: 'soon' is not one of latest"),
            (b'{"position": true}', "400 position: must be a string or an integer"),
            (b'{"position": 253402300799999}', "400 position: 253402300799999 (unix ms) is"),
            (b'{"group": "other"}', "400 content: a JSON object, its group (if any)"),
            (b'["earliest"]', "400 content: a JSON object"),
            (b'{"position": "earliest", "x": 1}', "400 x: Extra inputs are not permitted"),
        ):
            refused = await client.request("pull", content, appid="shop", group="n", op="create")
            assert refused["status"] == "reject", refused
            assert refused["content"].startswith(said), refused
    finally:
        await client.close()
