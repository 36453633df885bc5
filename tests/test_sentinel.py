"""REDIS_URL through Redis Sentinel: the broker asks a real Sentinel (valkey-server in
sentinel mode) for the master and stores there."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from skmq.embedded import EmbeddedRedis, _wait_port, server_binary
from skmq.queue.journal import AppKeys
from tests.conftest import BrokerFactory, eventually, free_port
from tests.peers import FakeRecipient, RawClient


@contextlib.contextmanager
def _sentinel_of(tmp_path: Path, master: EmbeddedRedis) -> Iterator[int]:
    """A Sentinel (quorum 1) watching `master` (service `skmq`): its port."""
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor skmq 127.0.0.1 {master.port} 1\n"
        "sentinel down-after-milliseconds skmq 1000\n"
        "sentinel failover-timeout skmq 5000\n"
    )
    proc = subprocess.Popen(
        [str(server_binary()), str(conf), "--sentinel"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_port("127.0.0.1", port, proc, 10.0)  # a Sentinel, not a broker: no pong
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, int]]:
    master = EmbeddedRedis(tmp_path / "master", auth=False)  # Sentinel would need its password
    master.start()
    try:
        with _sentinel_of(tmp_path, master) as port:
            yield master, port
    finally:
        master.stop()


async def test_broker_stores_through_sentinel(
    sentinel: tuple[EmbeddedRedis, int], make_broker: BrokerFactory
) -> None:
    master, port = sentinel
    broker = await make_broker(redis_url=f"redis+sentinel://127.0.0.1:{port}/skmq/0")
    client = await RawClient.connect(broker.server.port)
    resp = await client.request("queue", b"via sentinel", appid="s", msgid="s1")
    assert resp["status"] == "ack"
    direct = aioredis.Redis.from_url(master.url)
    try:  # (the owner's log, on the master)
        (_, fields), *_ = await direct.xrange(AppKeys.of(broker.settings.key_prefix, "s").log)
        assert fields[b"c"] == b"via sentinel"
    finally:
        await direct.aclose()
    await client.close()


@pytest.fixture
def sentinel_pair(tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis, int]]:
    """A master, its replica (synced) and a Sentinel watching them."""
    master = EmbeddedRedis(tmp_path / "master", auth=False)
    replica = EmbeddedRedis(tmp_path / "replica", auth=False)
    master.start()
    replica.start()
    try:
        with redis.Redis(port=replica.port) as client:
            client.replicaof("127.0.0.1", master.port)
            for _ in range(200):  # (its first sync: a failover before it would lose all)
                if client.info("replication").get("master_link_status") == "up":
                    break
                time.sleep(0.05)
            else:
                raise RuntimeError("the replica did not sync")
        with _sentinel_of(tmp_path, master) as port:
            yield master, replica, port
    finally:
        replica.stop()
        master.stop()


async def _acked(port: int, app: str, msgid: str) -> bool:
    """Whether a store of `msgid` is answered `ack` now (a producer's retry)."""
    client = await RawClient.connect(port)
    try:
        return (await client.request("queue", b"x", appid=app, msgid=msgid))["status"] == "ack"
    finally:
        await client.close()


async def test_owner_engine_runs_through_sentinel_and_follows_a_failover(
    sentinel_pair: tuple[EmbeddedRedis, EmbeddedRedis, int], make_broker: BrokerFactory
) -> None:
    """Through Sentinel: stored, pushed and acked on the master; after a
    failover (SENTINEL FAILOVER: the old master goes on running, a replica now, so the
    owner's connection to it reads READONLY), the owner lets the app go, takes it again
    on the new master, and stores and pushes there."""
    master, replica, port = sentinel_pair
    url = f"redis+sentinel://127.0.0.1:{port}/skmq/0"
    broker = await make_broker(redis_url=url)
    rec = await FakeRecipient("s", "r").start()
    try:
        assert (await rec.register(broker.server.port))["status"] == "ack"
        assert await _acked(broker.server.port, "s", "before")
        assert (await rec.next_push()).fields["msgid"] == "before"
        sentinel = aioredis.Redis(port=port)
        try:

            async def failing_over() -> bool:  # (once the Sentinel has found the replica)
                try:
                    await sentinel.execute_command("SENTINEL", "FAILOVER", "skmq")
                except ResponseError as exc:
                    if "NOGOODSLAVE" not in str(exc):
                        raise
                    return False
                return True

            await eventually(failing_over, timeout=30)

            async def promoted() -> bool:
                addr = await sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "skmq")
                return int(addr[1]) == replica.port

            await eventually(promoted, timeout=30)
        finally:
            await sentinel.aclose()

        async def demoted() -> bool:  # (until then it takes writes, lost with the switch)
            old = aioredis.Redis.from_url(master.url)
            try:
                return (await old.info("replication"))["role"] == "slave"
            except RedisConnectionError:  # (its clients are dropped as its role changes)
                return False
            finally:
                await old.aclose()

        await eventually(demoted, timeout=30)

        async def stored_after() -> bool:
            return await _acked(broker.server.port, "s", "after")

        await eventually(stored_after, timeout=30)
        assert (await rec.next_push()).fields["msgid"] == "after"
        new_master = aioredis.Redis.from_url(replica.url)
        try:  # taken again there, with a new epoch
            assert int(await new_master.get(AppKeys.of(broker.settings.key_prefix, "s").epoch)) == 2
        finally:
            await new_master.aclose()
    finally:
        await rec.stop()
