"""REDIS_URL through Redis Sentinel: the broker asks a real Sentinel (valkey-server in
sentinel mode) for the master and stores there."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from skmq.clock import now_ms
from skmq.embedded import EmbeddedRedis, _wait_port, server_binary
from skmq.store.messages import read as read_message
from tests.conftest import BrokerFactory, free_port
from tests.peers import RawClient


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[tuple[EmbeddedRedis, int]]:
    master = EmbeddedRedis(tmp_path / "master", auth=False)  # Sentinel would need its password
    master.start()
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor skmq 127.0.0.1 {master.port} 1\n"
        "sentinel down-after-milliseconds skmq 1000\n"
    )
    proc = subprocess.Popen(
        [str(server_binary()), str(conf), "--sentinel"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_port("127.0.0.1", port, proc, 10.0)  # a Sentinel, not a broker: no pong
        yield master, port
    finally:
        proc.terminate()
        proc.wait(10)
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
    try:
        value = await direct.hget(f"{broker.store.base('s')}msgs", "s1")
        assert read_message(value, now_ms())[2] == b"via sentinel"
    finally:
        await direct.aclose()
    await client.close()
