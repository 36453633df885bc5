"""Issue 42: what REPLICA_ACKS=1 stores answer while a master dies and stays down.

    python bench/failover_acks.py [--seconds 12] [--loops 8] [--replica-ack-timeout 1]

A local 3 masters + 3 replicas cluster (cluster-node-timeout 2 s); a Store with
REPLICA_ACKS=1 and `--loops` store loops, each storing batches of one message for each of
6 apps (2 a master), STORE_TIMEOUT 5 s. After 1 s the master of 2 apps is killed (kill -9)
and left down: its replica takes over and has no replica. Every answer is counted by the
app's master (`dead`: the killed one's apps, `healthy`: the others), and at the end each
message answered `error` is looked up (stored or not). Run it with PYTHONPATH naming the
tree to measure (the store's API before issue 42: one answer a batch).

Counts: `ack` on `dead` apps after the kill (should be 0: no replica confirms them);
`error` on `healthy` apps after the kill (trouble elsewhere refusing them); errors
answered "not stored" that are stored (should be 0), errors answered "unknown" (or,
before, any error) that are stored; `why`: the reasons of the errors (after issue 42).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from skmq.embedded_cluster import LocalCluster
from skmq.store import NewMessage, Store, connect_redis

PREFIX = "fo"
STORE_TIMEOUT = 5.0


def apps_by_master(store: Store, ports: list[int]) -> dict[int, list[str]]:
    client: Any = store.redis
    found: dict[int, list[str]] = {p: [] for p in ports}
    i = 0
    while any(len(a) < 2 for a in found.values()):
        app = f"app{i}"
        port = client.get_node_from_key(store.base(app) + "msgs").port
        if len(found[port]) < 2:
            found[port].append(app)
        i += 1
    return found


async def run(seconds: float, loops: int, ack_timeout: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(Path(tmp), masters=3, replicas=1).start()
        try:
            await measure(cluster, seconds, loops, ack_timeout)
        finally:
            cluster.stop()


async def measure(cluster: LocalCluster, seconds: float, loops: int, ack_timeout: float) -> None:
    redis = connect_redis(cluster.url)
    store = Store(redis, PREFIX, replica_acks=1, replica_ack_timeout=ack_timeout)
    await store.load_scripts()
    apps = apps_by_master(store, cluster.master_ports)
    dead_port = cluster.master_ports[0]
    side = {
        app: ("dead" if port == dead_port else "healthy") for port, a in apps.items() for app in a
    }
    per_app = "deadline" in inspect.signature(store.store).parameters
    counts: Counter[str] = Counter()
    errors: dict[str, list[tuple[str, str]]] = {app: [] for app in side}  # (msgid, kind)
    killed_at: float | None = None
    stop = time.monotonic() + seconds
    loop = asyncio.get_running_loop()

    async def one_loop(n: int) -> None:
        i = 0
        while time.monotonic() < stop:
            i += 1
            batch = {app: [NewMessage(f"{n}-{i}", "queue", b"x")] for app in side}
            phase = "after" if killed_at is not None else "before"
            answers: dict[str, str] = {}
            try:
                if per_app:
                    res = await store.store(
                        batch, int(time.time() * 1000), deadline=loop.time() + 5
                    )
                else:
                    async with asyncio.timeout(5):
                        res = await store.store(batch, int(time.time() * 1000))
                for app in side:
                    r = res[app]
                    if isinstance(r, list):
                        answers[app] = "ack"
                    else:
                        answers[app] = "unknown" if getattr(r, "maybe_ran", True) else "not_stored"
                        counts[f"why {side[app]}: {str(r)[:60]}"] += 1
            except Exception:
                answers = dict.fromkeys(side, "unknown")
            for app, answer in answers.items():
                counts[f"{phase} {side[app]} {answer}"] += 1
                if answer != "ack" and phase == "after":
                    errors[app].append((f"{n}-{i}", answer))
            await asyncio.sleep(0.005)

    async def kill() -> None:
        nonlocal killed_at
        await asyncio.sleep(1)
        await asyncio.to_thread(cluster.kill, dead_port)
        killed_at = time.monotonic()

    await asyncio.gather(kill(), *(one_loop(n) for n in range(loops)))
    # the messages answered `error`: stored or not (looked up once the slot is served)
    for _ in range(100):
        try:
            for app, errs in errors.items():
                found = await store.stored_of(app, [m for m, _ in errs], int(time.time() * 1000))
                for (_, kind), at in zip(errs, found, strict=True):
                    counts[
                        f"error {kind} {side[app]} {'stored' if at is not None else 'absent'}"
                    ] += 1
            break
        except Exception:
            await asyncio.sleep(0.2)
    for key in sorted(counts):
        print(f"{key:40} {counts[key]}")
    await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--loops", type=int, default=8)
    parser.add_argument("--replica-ack-timeout", type=float, default=1.0)
    a = parser.parse_args()
    asyncio.run(run(a.seconds, a.loops, a.replica_ack_timeout))


if __name__ == "__main__":
    main()
