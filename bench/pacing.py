"""Pacing of the load processes' producers (bench.skmq_load, and bench.confirmed for
RabbitMQ and NATS): one schedule, kept by sending what is due at each tick.

A producer paced at `rate` msg/s follows a schedule: message n is due at t0 + n / rate.
Each time it wakes up it sends every message due by then, then sleeps until the next
one is due, but at least one tick (1 ms). One sleep a message cannot hold 10,000 msg/s
from one Python process: uvloop's timers count whole milliseconds (a 0.3 ms sleep
returns at once, so the producer would spin on a core the brokers need; a 1.4 ms sleep
lasts 1 ms). Sending what is due keeps the rate whatever the timer does, in bursts of
about rate x tick messages (about 10 at 10,000 msg/s, 2 at 2,000 msg/s).

Messages are stamped when they are actually written, so latency counts from the real
send. How far the sends fell behind the schedule (`lag_max_ms`) and the rate achieved
(`achieved_rate`) are reported beside it: a producer that could not keep up shows there.

This module imports nothing from `skmq`.
"""

from __future__ import annotations

import asyncio
import time

TICK = 0.001  # shortest sleep, s: uvloop's timer resolution


class Pacer:
    """The schedule of `count` messages at `rate` msg/s (0: all due at once)."""

    def __init__(self, rate: float, count: int, tick: float = TICK) -> None:
        self.rate = rate
        self.count = count
        self.tick = tick
        self.t0 = time.monotonic()
        self.t_last = self.t0
        self.sent = 0
        self.writes = 0
        self.lag_max = 0.0
        self.capped = False  # the time cap came before the last message

    def start(self) -> None:
        """Message 0 is due now."""
        self.t0 = self.t_last = time.monotonic()

    def due(self, now: float) -> int:
        """Messages not sent yet that are due by `now` (monotonic seconds)."""
        if self.rate <= 0:
            return self.count - self.sent
        return min(int((now - self.t0) * self.rate) + 1, self.count) - self.sent

    async def wait(self) -> None:
        """Sleep until the next message is due (at least one tick)."""
        if self.rate <= 0:
            await asyncio.sleep(0)
            return
        delay = self.t0 + self.sent / self.rate - time.monotonic()
        await asyncio.sleep(max(delay, self.tick))

    async def next_batch(self, stop_at: float) -> int:
        """Wait until a message is due; how many are due now. 0: all sent, or `stop_at`
        (monotonic seconds) passed first (then `capped`)."""
        while self.sent < self.count:
            now = time.monotonic()
            if now >= stop_at:
                self.capped = True
                return 0
            due = self.due(now)
            if due > 0:
                return due
            await self.wait()
        return 0

    def record(self, n: int) -> None:
        """`n` messages (the next ones of the schedule) were written just now."""
        now = time.monotonic()
        if self.rate > 0:
            lag = now - (self.t0 + self.sent / self.rate)
            if lag > self.lag_max:
                self.lag_max = lag
        self.sent += n
        self.writes += 1
        self.t_last = now

    def summary(self) -> dict[str, float]:
        """Target and achieved rate (msg/s), the worst lag behind the schedule (ms), the
        number of writes (bursts). Achieved: messages sent over the span from message 0's
        due time to the last write, plus one slot (1 / rate), so that a producer exactly on
        schedule achieves the target."""
        span = self.t_last - self.t0 + (1.0 / self.rate if self.rate > 0 else 0.0)
        return {
            "target_rate": self.rate,
            "achieved_rate": self.sent / span if self.sent and span > 0 else 0.0,
            "lag_max_ms": self.lag_max * 1e3,
            "writes": float(self.writes),
        }
