"""A store written by an earlier SKMQ (the per-transition scripts engine) is converted by
`skmq serve` when it starts (skmq/queue/migrate.py: what it converts is checked in
tests/test_migrate.py), refused in one line while a broker of that version still serves
it, and refused by operator commands until a broker converted it
(skmq/store/engine_mark.py); a new store is marked as this SKMQ's by its first broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import redis as syncredis
import redis.asyncio as aioredis

from skmq.clock import now_ms
from skmq.queue.journal import AppKeys
from skmq.store.directory import shard_key
from skmq.store.engine_mark import OWNER, mark_key
from skmq.store.messages import header
from tests.conftest import BrokerFactory, eventually
from tests.peers import WAIT
from tests.test_delivery import produce

REFUSED = (
    "holds data of an earlier SKMQ (the per-transition scripts engine): start a broker "
    "of this version (`skmq serve`), which converts it"
)


def legacy_store(url: str, prefix: str, kind: str) -> None:
    """A store as the scripts engine left it, a message waiting in its app's `ready` list:
    the app listed in the apps directory, unmarked (`listed`: every version before the
    mark) or marked `scripts` (`marked`), or listed in the one set of the versions before
    the directory was sharded (`unsharded`)."""
    client = syncredis.Redis.from_url(url)
    try:
        client.sadd(f"{prefix}:apps" if kind == "unsharded" else shard_key(prefix, "a"), "a")
        client.hset(f"{prefix}:{{a}}:msgs", "m1", header("queue", now_ms(), False) + b"hello")
        client.rpush(f"{prefix}:{{a}}:ready", "m1")
        if kind == "marked":
            client.set(mark_key(prefix), "scripts")
    finally:
        client.close()


def skmq(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skmq.cli", command],
        env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["listed", "marked", "unsharded"])
async def test_skmq_serve_converts_a_store_of_the_scripts_engine_and_serves_it(
    broker_env: dict[str, str], redis: aioredis.Redis, redis_url: str, prefix: str, kind: str
) -> None:
    legacy_store(redis_url, prefix, kind)
    env = {**broker_env, "SKMQ_REDIS_URL": redis_url, "SKMQ_KEY_PREFIX": prefix}
    proc = subprocess.Popen(
        [sys.executable, "-m", "skmq.cli", "serve"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )  # fmt: skip

    async def converted() -> bool:
        assert proc.poll() is None, proc.communicate()
        return await redis.get(mark_key(prefix)) == OWNER.encode()

    try:
        await eventually(converted, WAIT)
        assert await redis.xlen(AppKeys.of(prefix, "a").inbox) == 1
        old = (f"{prefix}:{{a}}:msgs", f"{prefix}:{{a}}:ready", f"{prefix}:apps")
        assert not await redis.exists(*old)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 0, err


def test_skmq_serve_refuses_a_store_a_running_earlier_broker_serves_in_one_line(
    broker_env: dict[str, str], redis_url: str, prefix: str
) -> None:
    legacy_store(redis_url, prefix, "listed")
    client = syncredis.Redis.from_url(redis_url)
    seen = {"last_seen": now_ms(), "host": "10.0.0.7", "port": 13000}
    client.hset(f"{prefix}:brokers", "old", json.dumps(seen))
    client.close()
    env = {**broker_env, "SKMQ_REDIS_URL": redis_url, "SKMQ_KEY_PREFIX": prefix}
    done = skmq("serve", env)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "brokers of an earlier SKMQ (10.0.0.7:13000): stop them" in lines[0]


def test_an_operator_command_refuses_a_store_of_the_scripts_engine(
    redis_url: str, prefix: str
) -> None:
    legacy_store(redis_url, prefix, "listed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    env.update(SKMQ_REDIS_URL=redis_url, SKMQ_KEY_PREFIX=prefix)
    done = skmq("status", env)
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and REFUSED in lines[0], done.stderr


async def test_a_new_store_is_marked_by_its_first_broker_and_served_by_every_other(
    make_broker: BrokerFactory, redis: aioredis.Redis, prefix: str
) -> None:
    first = await make_broker()
    assert await redis.get(mark_key(prefix)) == OWNER.encode()
    await produce(first.server.port, "a", ["m1"])
    second = await make_broker()  # a store with apps, marked: this SKMQ's
    assert second.store.prefix == prefix


async def test_a_broker_converts_a_store_marked_by_the_scripts_engine(
    make_broker: BrokerFactory, redis: aioredis.Redis, prefix: str
) -> None:
    await redis.set(mark_key(prefix), "scripts")
    await make_broker()
    assert await redis.get(mark_key(prefix)) == OWNER.encode()
