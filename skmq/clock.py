"""The clock the brokers of one store share: Redis's.

Due times, lease ends and stored times written into the store, and the `now` every
script compares them with, come from now_ms(). Brokers on different machines must
agree on it: one whose machine clock ran 10 s ahead would hand out a leased message
again 10 s early, and a delayed one at once. So now_ms() is this machine's monotonic
clock plus its offset to the store's clock (Redis TIME), which a broker measures before
it serves and then every CLOCK_INTERVAL (StoreClock.run, a supervised task): a step of
the machine's clock (an operator, NTP) moves nothing. A command that runs no broker
(`skmq status`, `skmq dlq`) keeps its machine's clock as it was at its start.

The offset is module state, not passed in: now_ms() is called from every stage, and a
broker process holds one store.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog
from redis.exceptions import RedisError

log = structlog.get_logger("skmq.clock")

_offset_ns = time.time_ns() - time.monotonic_ns()  # (until a broker measures the store's)
SAMPLES = 3
# An offset that moves this much at once is logged: a machine clock stepped, or Redis's.
STEP_NS = 1_000_000_000


def now_ms() -> int:
    """Unix ms on the store's clock."""
    return (time.monotonic_ns() + _offset_ns) // 1_000_000


async def measure(redis: Any) -> int:
    """The store's clock minus this machine's monotonic one (ns): of SAMPLES TIME calls,
    the one with the shortest round trip (its midpoint is the closest to when Redis read
    its clock)."""
    best: tuple[int, int] | None = None
    for _ in range(SAMPLES):
        before = time.monotonic_ns()
        seconds, micros = await redis.time()
        after = time.monotonic_ns()
        sample = (after - before, int(seconds) * 10**9 + int(micros) * 1000 - (before + after) // 2)
        if best is None or sample < best:
            best = sample
    assert best is not None
    return best[1]


class StoreClock:
    def __init__(self, redis: Any, interval: float) -> None:
        self.redis = redis
        self.interval = interval

    async def follow(self) -> None:
        """Measure the offset now (before the broker serves)."""
        global _offset_ns
        offset = await measure(self.redis)
        if abs(offset - _offset_ns) >= STEP_NS:
            ahead = (time.time_ns() - time.monotonic_ns() - offset) // 1_000_000
            log.warning("machine clock differs from the store's", ahead_ms=ahead)
        _offset_ns = offset

    async def run(self) -> None:
        """Follow the store's clock for good; a failed measure keeps the last offset."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.follow()
            except (RedisError, OSError) as exc:
                log.warning("store clock not read, keeping the last offset", error=repr(exc))
