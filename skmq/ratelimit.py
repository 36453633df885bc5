"""A token bucket: frames (or pushes) per second, with a burst of one second's worth."""

from __future__ import annotations

import asyncio
import time


class TokenBucket:
    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.capacity = burst if burst is not None else max(1.0, rate)
        self.tokens = self.capacity
        self.stamp = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def take_up_to(self, n: int) -> int:
        self._refill()
        granted = min(n, int(self.tokens))
        self.tokens -= granted
        return granted

    def give_back(self, n: int) -> None:
        self.tokens = min(self.capacity, self.tokens + n)

    def wait_time(self) -> float:
        self._refill()
        return max(0.0, (1.0 - self.tokens) / self.rate)

    async def acquire(self, n: int) -> None:
        """Take n tokens, sleeping as long as the rate says (backpressure, never a drop)."""
        self._refill()
        self.tokens -= n
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)
