"""The Python pull consumer (skmq/pull/consumer.py) and `skmq consume --pull`, against a
real broker's HTTP gateway."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import aiohttp

from skmq.broker import Broker
from skmq.pull.consumer import PullConsumer, PullError
from tests.conftest import BrokerFactory, free_port


async def gateway(make_broker: BrokerFactory) -> tuple[Broker, str]:
    broker = await make_broker(http_port=free_port())
    return broker, f"http://127.0.0.1:{broker.gateway.port}"


async def produce(url: str, app: str, *msgids: str) -> None:
    batch = {"messages": [{"msgid": m, "content": f"body {m}"} for m in msgids]}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/apps/{app}/messages", json=batch) as r,
    ):
        assert r.status == 200


async def test_async_for_with_ack_nack_and_a_lease_kept_while_handling(
    make_broker: BrokerFactory,
) -> None:
    _, url = await gateway(make_broker)
    async with (
        PullConsumer(url, "shop", "g", wait=5, visibility=0.4, batch=1) as first,
        PullConsumer(url, "shop", "g", wait=0.5, visibility=0.4, batch=1) as other,
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


async def test_refusals_are_pull_errors(make_broker: BrokerFactory) -> None:
    _, url = await gateway(make_broker)
    async with PullConsumer(url, "shop", "g", create_group=False) as consumer:
        try:
            await consumer.receive()
        except PullError as exc:
            assert (exc.status, exc.error) == (404, "no group 'g' for app 'shop'")
        else:
            raise AssertionError("no PullError")


async def test_skmq_consume_pull_prints_and_acks_until_stopped(
    make_broker: BrokerFactory,
) -> None:
    broker, url = await gateway(make_broker)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "skmq.cli", "consume", "--pull", "--group", "cli", "--app", "shop",
        "--gateway", url, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
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


async def test_skmq_consume_needs_a_group_to_pull_and_an_id_to_be_pushed_to() -> None:
    for args, said in (
        (["--pull"], b"skmq consume: --pull needs --group G\n"),
        ([], b"skmq consume: --id and --port are required (or --pull --group G)\n"),
    ):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "skmq.cli", "consume", "--app", "a", *args,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await proc.communicate()
        assert (proc.returncode, err) == (2, said)
