"""Issue 42 as measured from outside: a `skmq serve` with REPLICA_ACKS=1 on a 3+3 cluster
while a master is killed (kill -9), left down, and started again.

    python bench/failover_broker.py [--down 10] [--rate 400] [--full-coverage no]

A local 3 masters + 3 replicas cluster (cluster-node-timeout 2 s,
cluster-require-full-coverage as `--full-coverage`), one broker (REPLICA_ACKS=1), and
one producer connection an app for 6 apps (2 a master) sending queue messages with
unique msgids at `--rate` msg/s in all, one frame at a time a connection. After 2 s the
master of 2 apps (`dead`) is killed; `--down` s later it is started again (it comes
back as a replica of its replica, promoted meanwhile); the run ends 5 s after that.
Run it with PYTHONPATH naming the tree to measure (the broker child inherits it).

Each app has a recipient (skmq.client.Consumer, acking every push).

Prints the answers by phase (`before` the kill, `down`, `back` after the restart), side
(`dead`, `healthy`) and kind (`ack`, `unknown`: an `error` that says or, before issue 42,
may mean the message may be stored, `not_stored`), then each `error` looked up in the
store (stored or absent); for each side the longest pause between two deliveries to an
app's recipient while its master was down and after, and the messages acked but not
delivered 5 s after the end (lost); and the broker's log lines from the restart on that
name the error storm of issue 42.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import itertools
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from redis.asyncio.cluster import RedisCluster

from skmq.client import Consumer, Message, Producer
from skmq.embedded import free_port
from skmq.embedded_cluster import LocalCluster
from skmq.queue.owned_store import OwnedStore
from skmq.store import connect_redis

PREFIX = "fb"
STORM = ("Connection closed by server", "writelines", "handler is closed")


def kind(status: str, content: str) -> str:
    if status == "ack":
        return "ack"
    return "not_stored" if content.startswith("not stored") else "unknown"


async def run(args: argparse.Namespace, workdir: Path) -> None:
    cluster = LocalCluster(workdir / "cluster", masters=3, replicas=1).start()
    proc: subprocess.Popen[bytes] | None = None
    try:
        for port in cluster.ports:
            node = cluster.client(port)
            node.config_set("cluster-require-full-coverage", args.full_coverage)
            node.close()
        port = free_port()
        log_path = workdir / "broker.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
        env.update(SKMQ_HOST="127.0.0.1", SKMQ_PORT=str(port), SKMQ_HTTP_PORT="0",
                   SKMQ_REDIS_URL=cluster.url, SKMQ_KEY_PREFIX=PREFIX,
                   SKMQ_DATA_DIR=str(workdir / "data"), SKMQ_REPLICA_ACKS="1",
                   SKMQ_LOG_LEVEL="info", SKMQ_LOG_FORMAT="json")  # fmt: skip
        with log_path.open("ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "skmq.cli", "serve"], env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=out)  # fmt: skip
        await measure(args, cluster, port, log_path)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        cluster.stop()


async def measure(args: argparse.Namespace, cluster: LocalCluster, port: int, log: Path) -> None:
    redis = connect_redis(cluster.url)
    assert isinstance(redis, RedisCluster)
    store = OwnedStore(redis, PREFIX)
    await redis.initialize()
    dead_port = cluster.master_ports[0]
    side: dict[str, str] = {}
    per_master: Counter[int] = Counter()
    i = 0
    while len(side) < 6:
        app = f"app{i}"
        node = redis.get_node_from_key(store.base(app) + "msgs")
        if per_master[node.port] < 2:
            per_master[node.port] += 1
            side[app] = "dead" if node.port == dead_port else "healthy"
        i += 1
    async with asyncio.timeout(30):  # the broker up
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
    phase = "before"
    received: dict[str, list[tuple[float, str]]] = {app: [] for app in side}
    consumers = []
    for app in side:

        async def handle(msg: Message, app: str = app) -> None:
            received[app].append((time.monotonic(), msg.msgid))

        consumer = Consumer(app, f"r-{app}", handle, broker_port=port)
        await consumer.start()
        consumers.append(consumer)
    counts: Counter[str] = Counter()
    acked: dict[str, list[str]] = {app: [] for app in side}
    marks: dict[str, float] = {}
    errors: dict[str, list[str]] = {app: [] for app in side}
    done = asyncio.Event()
    pause = len(side) / args.rate
    # (our client sends an unknown outcome again by itself: here each answer is counted)
    retries = "unknown_retries" in inspect.signature(Producer).parameters
    no_retry = {"unknown_retries": 0} if retries else {}

    async def produce(app: str) -> None:
        n = 0
        async with Producer("127.0.0.1", port, **no_retry) as producer:  # type: ignore[arg-type]
            while not done.is_set():
                n += 1
                msgid = f"{app}-{n}"
                at = phase
                try:
                    async with asyncio.timeout(10):
                        resp = await producer.send(app, b"x", msgid=msgid)
                    k = kind(resp.status, resp.content)
                except (TimeoutError, ConnectionError):
                    k = "no answer"
                counts[f"{at:6} {side[app]:7} {k}"] += 1
                if k != "ack":
                    errors[app].append(msgid)
                else:
                    acked[app].append(msgid)
                await asyncio.sleep(pause)

    tasks = [asyncio.create_task(produce(app)) for app in side]
    await asyncio.sleep(2)
    marks["down"] = time.monotonic()
    cluster.kill(dead_port)
    phase = "down"
    await asyncio.sleep(args.down)
    await asyncio.to_thread(cluster.launch, dead_port)
    offset = log.stat().st_size
    marks["back"] = time.monotonic()
    phase = "back"
    await asyncio.sleep(5)
    done.set()
    await asyncio.gather(*tasks)
    marks["end"] = time.monotonic()
    await asyncio.sleep(5)  # (the last pushes)
    for consumer in consumers:
        await consumer.stop()
    for app, got in received.items():
        times = [t for t, _ in got]
        for name, start, end in (("down", marks["down"], marks["back"]),
                                 ("back", marks["back"], marks["end"])):  # fmt: skip
            inside = [start, *(t for t in times if start <= t <= end), end]
            gap = max(b - a for a, b in itertools.pairwise(inside))
            key = f"pause  {name:6} {side[app]:7} longest, ms"
            counts[key] = max(counts[key], round(gap * 1000))
        counts[f"lost   {side[app]:7} (acked, not delivered)"] += len(
            set(acked[app]) - {m for _, m in got}
        )
    for app, msgids in errors.items():
        for chunk in range(0, len(msgids), 500):
            part = msgids[chunk : chunk + 500]
            found = await store.stored_of(app, part, int(time.time() * 1000))
            for at in found:
                counts[f"error  {side[app]:7} {'stored' if at is not None else 'absent'}"] += 1
    lines = log.read_bytes().decode("utf-8", "replace").splitlines()
    with log.open("rb") as f:
        f.seek(offset)
        after = f.read().decode("utf-8", "replace").splitlines()
    for name, part in (("whole run", lines), ("after restart", after)):
        for word in STORM:
            counts[f"log {name}: {word}"] = sum(word in line for line in part)
        counts[f"log {name}: warning/error lines"] = sum(
            '"level": "warning"' in line or '"level": "error"' in line for line in part
        )
    for key in sorted(counts):
        print(f"{key:50} {counts[key]}")
    with contextlib.suppress(Exception):
        await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--down", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=400.0)
    parser.add_argument("--full-coverage", choices=("yes", "no"), default="no")
    parser.add_argument("--keep", type=Path, help="a directory to keep the logs in")
    args = parser.parse_args()
    if args.keep:
        args.keep.mkdir(parents=True)
        asyncio.run(run(args, args.keep))
        return
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    main()
