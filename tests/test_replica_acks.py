"""REPLICA_ACKS on one Redis with a real replica: a store is answered `ack` once the
replica has it, and `error` (outcome unknown: stored on its master) while the replica
does not answer."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from skmq.embedded import EmbeddedRedis
from skmq.queue.journal import AppKeys
from skmq.queue.owned_store import OwnedStore
from skmq.store.shards import ReplicasMissing, WriteFailed
from skmq.store.store import AppStored
from skmq.store.wire import Wire
from tests.conftest import BrokerFactory, eventually
from tests.peers import RawClient


@pytest.fixture
async def replicated(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    """A master and its replica, in sync."""
    master = EmbeddedRedis(tmp_path / "master", auth=False)
    replica = EmbeddedRedis(tmp_path / "replica", auth=False)
    master.start()
    replica.start()
    try:
        to_replica = aioredis.Redis.from_url(replica.tcp_url)
        to_master = aioredis.Redis.from_url(master.tcp_url)
        await to_replica.execute_command("REPLICAOF", master.host, str(master.port))
        async with asyncio.timeout(20):  # until the master counts it online
            while (await to_master.info("replication")).get("connected_slaves") != 1 or (
                (await to_replica.info("replication")).get("master_link_status") != "up"
            ):
                await asyncio.sleep(0.05)
        await to_master.aclose()
        await to_replica.aclose()
        yield master, replica
    finally:
        replica.stop()
        master.stop()


async def test_an_ack_waits_for_the_replica_and_a_stalled_replica_is_said(
    replicated: tuple[EmbeddedRedis, EmbeddedRedis], make_broker: BrokerFactory
) -> None:
    master, replica = replicated
    broker = await make_broker(redis_url=master.tcp_url, replica_acks=1, replica_ack_timeout=0.3)
    client = await RawClient.connect(broker.server.port)
    try:
        resp = await client.request("queue", b"one", appid="r", msgid="r1")
        assert resp["status"] == "ack", resp
        assert replica.proc is not None
        os.kill(replica.proc.pid, signal.SIGSTOP)
        try:
            resp = await client.request("queue", b"two", appid="r", msgid="r2")
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        assert resp["status"] == "error", resp
        assert resp["content"].startswith("outcome unknown: stored on its master"), resp
        # The replica back: sent again with its msgid, one message (a duplicate, acked).
        resp = await client.request("queue", b"two", appid="r", msgid="r2")
        assert resp["status"] == "ack", resp
    finally:
        await client.close()


async def test_the_wait_asks_the_server_that_stored(
    replicated: tuple[EmbeddedRedis, EmbeddedRedis],
    make_broker: BrokerFactory,
    redis_url: str,
) -> None:
    """REPLICA_ACKS's WAIT goes to the server the store was written on (a second
    connection to it), not to the master of the app's keys now: after a failover that
    is another server, whose replicas may lack the write. Here the broker's Redis has a
    replica and the server the messages were written on (the session's) has none."""
    master, _ = replicated
    broker = await make_broker(redis_url=master.tcp_url, replica_acks=1, replica_ack_timeout=0.3)
    store = broker.store
    assert isinstance(store, OwnedStore)
    listed = AppKeys.of(store.prefix, "r").listed
    elsewhere, here = await Wire.connect(redis_url), await Wire.connect(master.tcp_url)
    try:
        for wire in (elsewhere, here):
            await wire.call("SET", listed, 1)
        outcome: dict[str, AppStored] = {"r": [True]}
        missing = await store._unconfirmed(outcome, {"r": elsewhere}, None)
        assert isinstance(missing.get("r"), ReplicasMissing), missing
        assert await store._unconfirmed(outcome, {"r": here}, None) == {}
        # A mark gone meanwhile: the SET wrote nothing, so the WAIT confirms nothing.
        await here.call("DEL", listed)
        missing = await store._unconfirmed(outcome, {"r": here}, None)
        assert isinstance(missing.get("r"), ReplicasMissing), missing
    finally:
        for wire in (elsewhere, here):
            await wire.call("DEL", listed)
            wire.close()


async def _waits(url: str) -> int:
    """The WAITs the server at `url` has run (INFO commandstats)."""
    client = aioredis.Redis.from_url(url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


async def test_the_stores_meanwhile_share_a_wait(
    make_broker: BrokerFactory, redis_url: str
) -> None:
    """A burst of stores on a server whose replicas are gone, asking while a WAIT runs:
    each answered within two WAITs (the one running when it asked, and the next, which
    covers every store that asked meanwhile), not behind the WAIT of every store before
    it (6 WAITs, one after the other, before)."""
    broker = await make_broker(redis_url=redis_url, replica_acks=1, replica_ack_timeout=1.0)
    store = broker.store
    assert isinstance(store, OwnedStore)
    apps = [f"burst{i}" for i in range(6)]
    wire = await Wire.connect(redis_url)
    client = aioredis.Redis.from_url(redis_url)

    async def waiting() -> bool:  # a WAIT runs (its connection blocked in it)
        return "cmd=wait" in str(await client.execute_command("CLIENT", "LIST"))

    def unconfirmed(app: str) -> Awaitable[dict[str, WriteFailed]]:
        return store._unconfirmed({app: [True]}, {app: wire}, None)

    try:
        for app in apps:
            await wire.call("SET", AppKeys.of(store.prefix, app).listed, 1)
        before = await _waits(redis_url)
        first = asyncio.ensure_future(unconfirmed(apps[0]))
        await eventually(waiting)
        missing = [*await asyncio.gather(*map(unconfirmed, apps[1:])), await first]
        assert all(
            isinstance(m.get(a), ReplicasMissing)
            for m, a in zip(missing, [*apps[1:], apps[0]], strict=True)
        )
        assert await _waits(redis_url) - before == 2  # one for the first, one for the 5 after
    finally:
        for app in apps:
            await wire.call("DEL", AppKeys.of(store.prefix, app).listed)
        wire.close()
        await client.aclose()
