"""CPU and wall time of one store round trip, one caller at a time (as at low load,
where every message makes its own): a pipeline of two EVALSHA calls, as a store with a
carried claim sends, through redis-py's asyncio pipeline (the pool the store used
before) and through the store's multiplexed connection (skmq/store/multiplex.py), by
the embedded server's unix socket and by TCP.

Usage: python -m bench.roundtrip_bench [--calls N]
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
from skmq.store import connect_redis
from skmq.store.multiplex import multiplexed

SCRIPT = "return {KEYS[1], ARGV[1]}"


async def measure(calls: int, run: Callable[[], Awaitable[Any]]) -> tuple[float, float]:
    """CPU and wall µs per call, after a warm-up."""
    for _ in range(calls // 10):
        await run()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        await run()
    return (time.process_time() - cpu) / calls * 1e6, (time.perf_counter() - wall) / calls * 1e6


async def compare(url: str, calls: int) -> list[tuple[str, float, float]]:
    redis = connect_redis(url)
    lane = multiplexed(redis)
    assert lane is not None
    sha = await redis.script_load(SCRIPT)
    commands = [("EVALSHA", sha, 1, "k", "a"), ("EVALSHA", sha, 1, "k", "b")]

    async def redis_py() -> Any:
        pipe = redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return await pipe.execute()

    try:
        return [
            ("redis-py pipeline", *await measure(calls, redis_py)),
            ("multiplexed", *await measure(calls, lambda: lane.pipeline(commands))),
        ]
    finally:
        lane.close()
        await redis.aclose()


async def main(calls: int) -> None:
    with EmbeddedRedis(Path(tempfile.mkdtemp(prefix="skmq-roundtrip-"))) as server:
        print("| path | connection | CPU µs/round trip | wall µs/round trip |")
        print("|------|------------|-------------------|--------------------|")
        for name, url in (("unix socket", server.url), ("TCP", server.tcp_url)):
            for path, cpu, wall in await compare(url, calls):
                print(f"| {path} | {name} | {cpu:.1f} | {wall:.1f} |")


def cli() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--calls", type=int, default=5000)
    uvloop.run(main(p.parse_args().calls))


if __name__ == "__main__":
    cli()
