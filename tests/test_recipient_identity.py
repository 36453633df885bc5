"""Capability `identity` (docs/PROTOCOL.md 6.3): the broker's heartbeat names the
registration it checks, and our consumer answers only its own; so a registration left
behind at an address that another app's consumer listens on later is lost, not alive
again (that consumer would get the old app's pushes)."""

from __future__ import annotations

import asyncio

from skmq.client import Consumer, Message
from skmq.codec import PONG, encode_frame
from skmq.registry.heartbeat import ping
from tests.conftest import BrokerFactory, free_port
from tests.test_delivery import log_events, logged, produce


async def nothing(msg: Message) -> None:
    return None


async def test_our_consumer_answers_a_ping_of_its_own_registration_only(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker()
    async with Consumer("billing", "b1", nothing, broker_port=broker.server.port) as consumer:
        port = consumer.port
        assert await ping("127.0.0.1", port, 5.0)  # (an original broker's: names no one)
        assert await ping("127.0.0.1", port, 5.0, names=("billing", "b1"))
        assert not await ping("127.0.0.1", port, 5.0, names=("shop", "c3"))
        assert not await ping("127.0.0.1", port, 5.0, names=("billing", "b2"))


async def test_a_push_of_another_app_is_refused_unhandled(make_broker: BrokerFactory) -> None:
    broker = await make_broker()
    handled: list[str] = []

    async def handle(msg: Message) -> None:
        handled.append(msg.msgid)

    async with Consumer("billing", "b1", handle, broker_port=broker.server.port) as consumer:
        reader, writer = await asyncio.open_connection("127.0.0.1", consumer.port)
        writer.write(encode_frame("push", {"appid": "shop", "msgid": "s1"}, b"x"))
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.write(encode_frame("ping"))
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == PONG
        writer.close()
    assert b"type=error" in answer and b"msgid=s1" in answer
    assert handled == [] and consumer.stats["errored"] == 1


async def test_a_registration_left_behind_is_lost_when_another_app_listens_on_its_port(
    make_broker: BrokerFactory,
) -> None:
    broker = await make_broker()
    port = free_port()
    shop = Consumer("shop", "c3", nothing, broker_port=broker.server.port, port=port)
    await shop.start()
    await shop.stop()  # (no unregister: the registration stays, as `skmq consume`'s does)
    async with Consumer("billing", "b1", nothing, broker_port=broker.server.port, port=port):
        await logged(broker, "recipient_lost", app="shop")
        await produce(broker.server.port, "shop", ["s1"])
        await produce(broker.server.port, "billing", ["b1-1"])
        await logged(broker, "acked", "b1-1")
        (c3,) = [r for r in broker.engine.registry.all("shop") if r.id == "c3"]
        assert not c3.alive
    assert log_events(broker, "s1", "pushed") == []
