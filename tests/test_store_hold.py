"""STORE_HOLD_BACKLOG and STORE_HOLD_CPU (skmq/workers/store_hold.py), over real TCP
against a real broker: new producer frames wait while an owned app's line of due
messages is long and its recipients have room for more, never for a recipient that is
slow (its window full). STORE_HOLD_CPU=0 counts the CPU as full whatever it is, so that
the tests need not load the machine."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest

from skmq.broker import Broker
from skmq.clock import now_ms
from skmq.pull.consumer import PullConsumer
from skmq.workers.store_hold import PAUSE, StoreHold
from tests.conftest import BrokerFactory, eventually
from tests.peers import FakeRecipient, RawClient


async def _held_broker(make_broker: BrokerFactory, **settings: int) -> Broker:
    broker = await make_broker(store_hold_cpu=0.0, **settings)

    async def busy() -> bool:
        return broker.engine.store_hold.busy

    await eventually(busy)
    return broker


async def _produce(port: int, app: str, msgids: list[str], **fields: str) -> None:
    """Queue messages pipelined on one connection; every one acknowledged."""
    client = await RawClient.connect(port)
    try:
        for msgid in msgids:
            client.send("queue", b"x", appid=app, msgid=msgid, **fields)
        answers = [await client.resp() for _ in msgids]
    finally:
        await client.close()
    assert {a["status"] for a in answers} == {"ack"}


async def test_stores_wait_while_an_apps_deliveries_fall_behind(
    make_broker: BrokerFactory,
) -> None:
    broker = await _held_broker(make_broker, store_hold_backlog=64, push_window=100_000)
    rec = await FakeRecipient("behind", "r1").start()
    port = broker.server.port
    try:
        assert (await rec.register(port))["status"] == "ack"
        # Due a ms after they are stored: all of them through the dispatcher's claims
        # (4, 8, ... 512 a claim), which a window of 100,000 never holds back.
        first = [f"d{i}" for i in range(10_000)]
        # Then one key, in batches on another connection, each sent once the one before
        # waits (held, or behind one held): stored, and delivered, in the order sent.
        then = [f"n{i:03d}" for i in range(200)]
        bulk, keyed = await RawClient.connect(port), await RawClient.connect(port)
        try:
            for msgid in first:
                bulk.send("queue", b"x", appid="behind", msgid=msgid, delay="1")
            waits: list[object] = [None]
            for chunk in range(0, len(then), 20):
                for msgid in then[chunk : chunk + 20]:
                    keyed.send("queue", b"x", appid="behind", msgid=msgid, key="k")

                async def held_anew() -> bool:
                    wait = broker.enqueuer.held("behind")
                    return wait is not None and wait not in waits

                await eventually(held_anew)
                waits.append(broker.enqueuer.held("behind"))
            others = asyncio.create_task(_produce(port, "other", [f"o{i}" for i in range(500)]))
            answers = [await bulk.resp() for _ in first] + [await keyed.resp() for _ in then]
            await others
        finally:
            await bulk.close()
            await keyed.close()
        assert {a["status"] for a in answers} == {"ack"}
        held = broker.engine.store_hold.held
        assert held["behind"] > 0 and held["other"] == 0  # (no recipient: never held)
        scraped = generate_latest(broker.metrics.registry).decode()
        assert f'skmq_stores_held_total{{app="behind"}} {held["behind"]:.1f}' in scraped

        async def all_delivered() -> bool:
            return len({f.fields["msgid"] for f in rec.received}) == len(first) + len(then)

        await eventually(all_delivered, timeout=60)
        assert len(rec.received) == len(first) + len(then)  # (none twice)
        in_key = [f.fields["msgid"] for f in rec.received if f.fields["msgid"] in then]
        assert in_key == then
    finally:
        await rec.stop()


async def test_a_slow_recipient_never_holds_a_store(make_broker: BrokerFactory) -> None:
    broker = await _held_broker(make_broker, store_hold_backlog=8, push_window=4)
    rec = await FakeRecipient("slow", "r1", lambda frame: "silent").start()
    try:
        assert (await rec.register(broker.server.port))["status"] == "ack"
        await _produce(broker.server.port, "slow", [f"a{i}" for i in range(100)])

        async def window_full() -> bool:
            d = broker.engine.dispatchers.get("slow")
            return len(rec.received) == 4 and d is not None and d.starved

        await eventually(window_full)
        await _produce(broker.server.port, "slow", [f"b{i}" for i in range(2_000)])
        assert broker.engine.store_hold.held["slow"] == 0
        assert len(rec.received) == 4
        waiting = await broker.store.counts(["slow"], now_ms())
        assert waiting["slow"].pending == 2_100 - 4
    finally:
        await rec.stop()


async def test_a_hold_in_which_the_line_gets_no_shorter_ends_for_a_while() -> None:
    """A line that does not move (pushes that fail, say) is not helped by holding stores:
    after a hold of MAX_HOLD in which it got no shorter, none starts for PAUSE."""
    lines = {"stuck": 1_000, "other": 0}
    hold = StoreHold([lambda app, limit: lines[app] if lines[app] > limit else 0], 10, 0.0)
    hold.start()
    try:

        async def stuck_held() -> bool:
            return hold.holding(lines) == {"stuck"}

        await eventually(stuck_held)
        loop = asyncio.get_running_loop()
        await hold.wait("stuck", 1)
        paused_at = loop.time()
        assert (hold.held["stuck"], hold.holding(lines)) == (1, set())
        await hold.wait("stuck", 1)  # (no hold)
        assert hold.held == {"stuck": 1}
        await eventually(stuck_held)  # (PAUSE after)
        assert loop.time() - paused_at >= PAUSE
        lines["stuck"] = 0
        await hold.wait("stuck", 1)
        assert hold.holding(lines) == set()
    finally:
        hold.stop()


async def test_stores_wait_while_a_consumer_groups_line_is_long(
    make_broker: BrokerFactory,
) -> None:
    """A pull app: while its consumers go on receiving and a group had more than the
    limit left to read, the app's producers wait; every message is received once."""
    broker = await _held_broker(make_broker, store_hold_backlog=64)
    port = broker.server.port
    async with PullConsumer(f"tcp://127.0.0.1:{port}", "pulled", "g", wait=0, batch=10) as g:
        assert await g.receive() == []  # (the group made: it gets what is stored now)
        first, then = [f"f{i}" for i in range(1_000)], [f"t{i}" for i in range(200)]
        await _produce(port, "pulled", first)
        got: list[str] = []
        received = asyncio.Event()

        async def consume() -> None:
            while len(got) < len(first) + len(then):
                msgs = await g.receive()
                got.extend(m.msgid for m in msgs)
                await g.ack_all(msgs)
                received.set()

        consuming = asyncio.create_task(consume())
        await received.wait()  # (a receive found the line: more than the limit left)
        await _produce(port, "pulled", then)
        await asyncio.wait_for(consuming, 60)
    assert broker.engine.store_hold.held["pulled"] > 0
    assert sorted(got) == sorted(first + then)
