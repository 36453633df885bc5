"""Redis's share of a message's life, script by script: the time Redis spends in the
store, claim and finish scripts (INFO commandstats, the server's own clock) per call
and per message, and the Redis commands each runs per message, with one message a call
(as at low load, where each message makes its own calls) and with batches (as at
saturation). Embedded Redis, AOF on, as the broker runs it.

Usage: python -m bench.script_bench [--messages N] [--batches 1,64]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop

from skmq.embedded import EmbeddedRedis
from skmq.store import AliveRecipient, NewMessage, Store, connect_redis

APP = "bench"
BODY = b"x" * 100


async def redis_time(store: Store, phase: Callable[[], Awaitable[Any]]) -> tuple[int, float, int]:
    """EVALSHA calls, µs Redis spent in them, and the commands they ran, during `phase`."""
    await store.redis.config_resetstat()
    await phase()
    stats: dict[str, Any] = await store.redis.info("commandstats")
    evalsha = stats.get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    inner = sum(
        int(s["calls"])
        for name, s in stats.items()
        if name not in ("cmdstat_evalsha", "cmdstat_config", "cmdstat_info")
    )
    return int(evalsha["calls"]), float(evalsha["usec"]), inner


async def life(store: Store, messages: int, batch: int, round_: int) -> list[tuple[str, ...]]:
    """Store, claim and finish `messages` messages, `batch` a call; a row a script."""
    now = int(time.time() * 1000)
    ids = [f"r{round_}-{i}" for i in range(messages)]
    chunks = [ids[i : i + batch] for i in range(0, messages, batch)]
    claimed: list[str] = []

    async def store_all() -> None:
        for chunk in chunks:
            await store.store({APP: [NewMessage(m, "queue", BODY) for m in chunk]}, now)

    async def claim_all() -> None:
        for chunk in chunks:
            alive = [AliveRecipient("r1", len(chunk), True)]
            got, _, _ = await store.claim(APP, now, len(chunk), alive, ["r1"] * len(chunk))
            claimed.extend(c.delivery_id for c in got)

    async def finish_all() -> None:
        for i in range(0, len(claimed), batch):
            await store.finish(APP, [(d, 0) for d in claimed[i : i + batch]], now)

    rows: list[tuple[str, ...]] = []
    for name, phase in (("store", store_all), ("claim", claim_all), ("finish", finish_all)):
        calls, usec, inner = await redis_time(store, phase)
        rows.append(
            (
                name,
                str(batch),
                f"{usec / max(calls, 1):.1f}",
                f"{usec / messages:.1f}",
                f"{inner / messages:.1f}",
            )
        )
    assert len(claimed) == messages, f"claimed {len(claimed)} of {messages}"
    return rows


async def main(messages: int, batches: list[int]) -> None:
    with EmbeddedRedis(Path(tempfile.mkdtemp(prefix="skmq-scripts-"))) as server:
        store = Store(connect_redis(server.url), "bench:")
        await store.load_scripts()
        await life(store, messages // 10, 1, 0)  # warm-up
        head = ("script", "messages a call", "Redis µs a call", "Redis µs a message",
                "commands a message")  # fmt: skip
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("-" * (len(h) + 2) for h in head) + "|")
        for round_, batch in enumerate(batches, 1):
            for row in await life(store, messages, batch, round_):
                print("| " + " | ".join(row) + " |")
        await store.redis.aclose()


def cli() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--messages", type=int, default=2000)
    p.add_argument("--batches", default="1,64", help="messages a call, comma-separated")
    a = p.parse_args()
    uvloop.run(main(a.messages, [int(b) for b in a.batches.split(",")]))


if __name__ == "__main__":
    cli()
