"""Batched settles of the Python pull consumer (skmq/pull/consumer.py), against a real
broker over HTTP and over TCP: the acks of one event-loop turn go in one request,
ack_all/nack_all settle a batch in one request, each message keeps its own outcome, and
the default batch is the broker's cap. Requests are counted on the broker's side: its
PullApi's ack, nack and extend are wrapped (and still run), whichever transport calls
them."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from skmq.broker import Broker
from skmq.config import Settings
from skmq.pull.consumer import DEFAULT_BATCH, PullConsumer, PullError
from tests.conftest import BrokerFactory, eventually, free_port
from tests.test_pull_client import consumer_url, gateway, produce
from tests.test_smoke import SERVER_MODULES

Call = Callable[[str, str, Any], Awaitable[dict[str, Any]]]


@pytest.fixture(params=["http", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def requests_of(broker: Broker, verb: str) -> list[dict[str, Any]]:
    """The bodies of the `verb` requests (ack, nack, extend) the broker answers from now."""
    bodies: list[dict[str, Any]] = []
    real: Call = getattr(broker.pull, verb)

    async def counted(app: str, group: str, raw: Any) -> dict[str, Any]:
        bodies.append(raw)
        return await real(app, group, raw)

    setattr(broker.pull, verb, counted)
    return bodies


async def test_the_default_batch_is_the_brokers_cap(
    make_broker: BrokerFactory, transport: str
) -> None:
    assert DEFAULT_BATCH == Settings.model_fields["pull_max_messages"].default == 100
    broker, url = await gateway(make_broker)
    async with PullConsumer(consumer_url(broker, url, transport), "shop", "g", wait=1) as c:
        assert c.batch == DEFAULT_BATCH
        await produce(url, "shop", *(f"m{i}" for i in range(150)))
        assert len(await c.receive()) == 100  # one request: the broker accepts its cap
        assert len(await c.receive()) == 50
    async with PullConsumer(url, "shop", "g", batch=101) as over:
        with pytest.raises(PullError) as refused:
            await over.receive()
    assert refused.value.status == 400
    assert "max: at most 100 (PULL_MAX_MESSAGES)" in refused.value.error


async def test_the_default_batch_follows_a_broker_with_a_lower_cap(
    make_broker: BrokerFactory, transport: str
) -> None:
    broker = await make_broker(http_port=free_port(), pull_max_messages=30)
    url = f"http://127.0.0.1:{broker.gateway.port}"
    async with PullConsumer(consumer_url(broker, url, transport), "shop", "g", wait=1) as c:
        await produce(url, "shop", *(f"m{i}" for i in range(50)))
        assert len(await c.receive()) == 30  # refused at 100, then asked for 30
        assert (c.batch, len(await c.receive())) == (30, 20)
    async with PullConsumer(url, "shop", "g", batch=50) as given:  # asked for: refused
        with pytest.raises(PullError, match="max: at most 30"):
            await given.receive()


async def test_acks_made_in_one_turn_go_in_one_request(
    make_broker: BrokerFactory, transport: str
) -> None:
    broker, url = await gateway(make_broker)
    acks, nacks = requests_of(broker, "ack"), requests_of(broker, "nack")
    async with PullConsumer(consumer_url(broker, url, transport), "shop", "g", wait=1) as c:
        await produce(url, "shop", *(f"m{i}" for i in range(8)))
        msgs = await c.receive()
        assert len(msgs) == 8
        # many handlers settling at once: one request a verb (and nack delay)
        outcomes = await asyncio.gather(
            *(m.ack() for m in msgs[:4]),
            msgs[4].nack(delay_ms=0), msgs[5].nack(delay_ms=0),
            msgs[6].nack(delay_ms=60_000), msgs[7].nack(delay_ms=60_000),
        )  # fmt: skip
        assert outcomes == [True] * 4 + ["retry"] * 4
        assert [b["receipts"] for b in acks] == [[m.receipt for m in msgs[:4]]]
        assert sorted((b["delay"], len(b["receipts"])) for b in nacks) == [(0, 2), (60_000, 2)]
        # one at a time, awaited: one request each, as before
        retried = await c.receive()
        assert sorted(m.msgid for m in retried) == ["m4", "m5"]
        for m in retried:
            assert await m.ack()
        assert [len(b["receipts"]) for b in acks] == [4, 1, 1]
    (info,) = await broker.groups.describe("shop")
    assert (info.in_flight, info.delayed, info.backlog) == (0, 2, 0)


async def test_async_for_acks_a_batch_in_one_request_as_the_readme_does(
    make_broker: BrokerFactory, transport: str
) -> None:
    """The README's loop (leased, then `msg.ack()` not awaited): a received batch is
    handed out and acked without a turn of the event loop, so its acks are one request;
    those the consumer sent are answered before it closes."""
    broker, url = await gateway(make_broker)
    acks, extends = requests_of(broker, "ack"), requests_of(broker, "extend")
    async with PullConsumer(consumer_url(broker, url, transport), "shop", "g", wait=1) as c:
        await produce(url, "shop", *(f"m{i}" for i in range(50)))
        handled = []
        async for msg in c:
            async with msg.leased():
                handled.append(msg.msgid)
            msg.ack()
            if len(handled) == 50:
                break
    assert sorted(handled) == sorted(f"m{i}" for i in range(50))
    assert [len(b["receipts"]) for b in acks] == [50]
    assert extends == []  # (handled well within its lease)
    (info,) = await broker.groups.describe("shop")
    assert (info.in_flight, info.backlog) == (0, 0)


async def test_messages_held_at_once_have_their_leases_extended_in_one_request(
    make_broker: BrokerFactory, transport: str
) -> None:
    """Handlers holding messages in `leased()` at once: the consumer's one keeper extends
    the leases that are half gone together, a request a look, until the blocks end."""
    broker, url = await gateway(make_broker)
    extends = requests_of(broker, "extend")
    where = consumer_url(broker, url, transport)
    async with PullConsumer(where, "shop", "g", wait=1, visibility=0.6) as c:
        await produce(url, "shop", "a", "b")
        msgs = await c.receive()
        released = asyncio.Event()

        async def handle(msg: Any) -> bool:
            async with msg.leased():
                await released.wait()
            return bool(await msg.ack())

        handlers = [asyncio.ensure_future(handle(m)) for m in msgs]
        await asyncio.sleep(1.5)  # (the time under test: 2.5 visibilities)
        released.set()
        assert await asyncio.gather(*handlers) == [True, True]
    assert len(extends) >= 2
    assert all(sorted(b["receipts"]) == sorted(m.receipt for m in msgs) for b in extends)


async def test_ack_all_is_sent_whether_or_not_it_is_awaited(
    make_broker: BrokerFactory, transport: str
) -> None:
    """As msg.ack(): sent at the end of the turn, so a batch loop need not wait for its
    answer before it receives again (the ack and the next receive go together)."""
    broker, url = await gateway(make_broker)
    acks = requests_of(broker, "ack")

    async def settled() -> bool:
        (info,) = await broker.groups.describe("shop")
        return info.in_flight == 0

    async with PullConsumer(consumer_url(broker, url, transport), "shop", "g", wait=5) as c:
        await produce(url, "shop", *(f"m{i}" for i in range(30)))
        first = await c.receive()
        acked = c.ack_all(first)  # not awaited
        await eventually(settled)
        await produce(url, "shop", "late")
        assert [m.msgid for m in await c.receive()] == ["late"]
        assert await acked == [True] * 30
    assert [len(b["receipts"]) for b in acks] == [30]


async def test_ack_all_and_nack_all_settle_a_batch_in_one_request(
    make_broker: BrokerFactory, transport: str
) -> None:
    broker, url = await gateway(make_broker)
    acks, nacks = requests_of(broker, "ack"), requests_of(broker, "nack")
    async with PullConsumer(consumer_url(broker, url, transport), "shop", "g", wait=1) as c:
        await produce(url, "shop", *(f"m{i}" for i in range(100)))
        msgs = await c.receive()
        assert await c.ack_all(msgs[:90]) == [True] * 90
        assert await c.nack_all(msgs[90:], delay_ms=60_000) == ["retry"] * 10
        assert await c.ack_all([]) == []  # nothing to send: no request
    assert [len(b["receipts"]) for b in acks] == [90]
    assert [(len(b["receipts"]), b["delay"]) for b in nacks] == [(10, 60_000)]
    (info,) = await broker.groups.describe("shop")
    assert (info.in_flight, info.delayed, info.backlog) == (0, 10, 0)


async def test_a_stale_receipt_in_a_batch_is_stale_alone(
    make_broker: BrokerFactory, transport: str
) -> None:
    broker, url = await gateway(make_broker)
    acks = requests_of(broker, "ack")
    async with PullConsumer(consumer_url(broker, url, transport), "shop", "g", wait=1) as c:
        await produce(url, "shop", "a", "b", "c", "d")
        a, b, c_, d = await c.receive()
        assert await b.ack()  # b's receipt is spent: stale from now on
        assert await c.ack_all([a, b, c_]) == [True, False, True]
        outcomes = await asyncio.gather(d.ack(), b.ack(), b.nack())
        assert list(outcomes) == [True, False, "stale"]
    assert [len(body["receipts"]) for body in acks] == [1, 3, 2]


async def test_a_refused_batch_reaches_every_caller(
    make_broker: BrokerFactory, transport: str
) -> None:
    broker, url = await gateway(make_broker)
    async with PullConsumer(consumer_url(broker, url, transport), "shop", "g", wait=1) as c:
        await produce(url, "shop", "a", "b", "c")
        msgs = await c.receive()
        assert await broker.groups.delete("shop", "g")
        outcomes = await asyncio.gather(*(m.ack() for m in msgs), return_exceptions=True)
        for outcome in outcomes:
            assert isinstance(outcome, PullError) and outcome.status == 404, outcome
        with pytest.raises(PullError, match="no group 'g' for app 'shop'"):
            await c.ack_all(msgs)


async def test_messages_waiting_in_the_buffer_keep_their_leases(
    make_broker: BrokerFactory, transport: str
) -> None:
    """A slow handler: once the leases of the messages still in the buffer are half
    gone, one request extends them all, so they are not handed out again meanwhile."""
    broker, url = await gateway(make_broker)
    extends = requests_of(broker, "extend")
    where = consumer_url(broker, url, transport)
    async with PullConsumer(where, "shop", "g", wait=1, visibility=3) as c:
        await produce(url, "shop", "a", "b", "c")
        messages = aiter(c)
        first = await anext(messages)
        await asyncio.sleep(1.8)  # handling it: past half the 3 s lease of b and c
        second = await anext(messages)
        assert [len(b["receipts"]) for b in extends] == [2]  # b and c, in one request
        third = await anext(messages)
        assert len(extends) == 1  # (their leases are whole again)
        await asyncio.sleep(1.8)  # handling b: past the leases b and c were received with
        assert [m.msgid for m in (first, second, third)] == ["a", "b", "c"]
        assert await c.ack_all([first, second, third]) == [False, True, True]  # a's ran out


async def test_a_client_only_install_pulls_and_settles_in_batches_over_tcp(
    make_broker: BrokerFactory,
) -> None:
    """Without the server's modules (structlog, aiohttp, ...) or uvloop, as `pip install`
    of the client alone leaves it: the TCP pull consumer still works."""
    broker, url = await gateway(make_broker)
    assert await broker.groups.create("shop", "g")
    await produce(url, "shop", "a", "b")
    hidden = sorted({"uvloop", *SERVER_MODULES})
    code = (
        f"import asyncio, sys; sys.modules.update(dict.fromkeys({hidden!r}))\n"
        "from skmq.pull.consumer import PullConsumer\n"
        "async def main():\n"
        f"    async with PullConsumer('tcp://127.0.0.1:{broker.server.port}', 'shop', 'g',"
        " wait=5) as c:\n"
        "        msgs = await c.receive()\n"
        "        print([m.msgid for m in msgs], await c.ack_all(msgs))\n"
        "asyncio.run(main())\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(30):
        out, err = await proc.communicate()
    assert (proc.returncode, out) == (0, b"['a', 'b'] [True, True]\n"), err
