"""A Redis without AOF (`appendonly no`) loses every message acked since its last snapshot
when it restarts: `skmq serve` refuses it in one line naming the setting to change and
the override; with ALLOW_VOLATILE_REDIS it starts, warns, and says so on /healthz and
/metrics. `skmq status` shows appendonly and appendfsync. A real redis-server (Debian's)
started here on a free port, and the local cluster's nodes."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis as syncredis

from skmq.embedded import EmbeddedRedis
from skmq.embedded_cluster import LocalCluster
from skmq.errors import Misconfigured
from tests.conftest import BrokerFactory, BrokerProcess, free_port
from tests.test_metrics import http_get
from tests.test_sentinel import sentinel

__all__ = ["sentinel"]  # the fixture, shared with tests/test_sentinel.py

REFUSAL = (
    "Redis runs with appendonly no: every message acked since its last snapshot is lost "
    "when it restarts; set appendonly yes (redis.conf, or CONFIG SET appendonly yes), or "
    "SKMQ_ALLOW_VOLATILE_REDIS=true to accept the loss"
)
VOLATILE = (
    "Redis runs with appendonly no: a restart of it loses the messages acked since its "
    "last snapshot (ALLOW_VOLATILE_REDIS)"
)


@pytest.fixture
def volatile_redis(tmp_path: Path) -> Iterator[str]:
    """redis-server with `--appendonly no` on a free port of loopback: its URL."""
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--appendonly", "no",
         "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    client = syncredis.Redis(port=port, socket_timeout=1.0)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except syncredis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    client.close()
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


def test_serve_refuses_a_redis_without_aof(volatile_redis: str, broker_env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "skmq.cli", "serve"],
        env={**broker_env, "SKMQ_REDIS_URL": volatile_redis},
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"skmq serve: {REFUSAL}"


async def test_with_the_override_it_starts_and_says_so(
    volatile_redis: str, broker_process: BrokerProcess, broker_env: dict[str, str]
) -> None:
    mport = free_port()
    broker_env.update(
        SKMQ_REDIS_URL=volatile_redis,
        SKMQ_ALLOW_VOLATILE_REDIS="true",
        SKMQ_METRICS_PORT=str(mport),
        SKMQ_LOG_LEVEL="info",
    )
    await asyncio.to_thread(broker_process.start)
    assert VOLATILE in broker_process.log_path.read_text()
    assert await http_get(mport, "/healthz") == (200, f"ok\nvolatile store: {VOLATILE}\n")
    status, metrics = await http_get(mport, "/metrics")
    assert status == 200 and "\nskmq_store_volatile 1.0\n" in metrics
    assert await asyncio.to_thread(broker_process.terminate) == 0


async def test_a_redis_with_aof_is_not_volatile(make_broker: BrokerFactory) -> None:
    broker = await make_broker(metrics_port=free_port())
    port = broker.settings.metrics_port
    assert await http_get(port, "/healthz") == (200, "ok\n")
    assert "\nskmq_store_volatile 0.0\n" in (await http_get(port, "/metrics"))[1]


async def test_a_sentinel_master_without_aof_is_refused(
    sentinel: tuple[EmbeddedRedis, int], make_broker: BrokerFactory
) -> None:
    master, port = sentinel
    direct = syncredis.Redis.from_url(master.url)
    direct.config_set("appendonly", "no")
    direct.close()
    with pytest.raises(Misconfigured) as refused:
        await make_broker(redis_url=f"redis+sentinel://127.0.0.1:{port}/skmq/0")
    assert str(refused.value) == REFUSAL


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    return subprocess.run(
        [sys.executable, "-m", "skmq.cli", "status", *args],
        env={**env, "COLUMNS": "120"}, capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_status_shows_how_redis_persists(volatile_redis: str, redis_url: str) -> None:
    done = _status("--json", "--redis-url", volatile_redis)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["redis"] == {"appendonly": "no", "appendfsync": "everysec"}
    done = _status("--redis-url", volatile_redis)
    assert "Redis: appendonly no, appendfsync everysec (volatile: no AOF)" in done.stdout
    done = _status("--redis-url", redis_url)  # the session's embedded Redis
    assert done.returncode == 0, done.stderr
    assert "Redis: appendonly yes, appendfsync everysec\n" in done.stdout


def replicas_serving(cluster: LocalCluster) -> None:
    """Until CLUSTER SLOTS lists every replica (one is left out until it has synced
    something): a key written on each master, then waiting on it, bounded."""
    client = syncredis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    for i in range(64):
        client.set(f"k{i}", "v")
    client.close()
    node = cluster.client(cluster.ports[0])
    deadline = time.monotonic() + 20
    while sum(len(s) - 2 for s in node.execute_command("CLUSTER SLOTS")) < len(cluster.ports):
        assert time.monotonic() < deadline, "replicas not in CLUSTER SLOTS"
        time.sleep(0.05)
    node.close()


async def test_a_cluster_replica_without_aof_is_refused(
    make_broker: BrokerFactory, tmp_path: Path
) -> None:
    """Every node is checked, replicas too: one promoted after its master fails would
    serve (and lose) what the master had acked."""
    cluster = await asyncio.to_thread(
        LocalCluster(tmp_path / "cluster", masters=3, replicas=1).start
    )
    try:
        await asyncio.to_thread(replicas_serving, cluster)
        replica = next(p for p in cluster.ports if p not in cluster.master_ports)
        node = cluster.client(replica)
        node.config_set("appendonly", "no")
        node.close()
        with pytest.raises(Misconfigured) as refused:
            await make_broker(redis_url=cluster.url)
        assert str(refused.value).startswith(
            f"Redis runs with appendonly no (nodes 127.0.0.1:{replica}): every message acked"
        )
    finally:
        await asyncio.to_thread(cluster.stop)
