"""The brokers' shared clock (skmq/clock.py) against a real Redis."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from skmq.clock import StoreClock, now_ms


async def redis_ms(redis: aioredis.Redis) -> int:
    seconds, micros = await redis.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def test_now_is_the_stores_clock_even_after_the_machines_clock_steps(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() - 30 * 10**9)  # 30 s behind
    await StoreClock(redis, 60.0).follow()
    assert abs(now_ms() - await redis_ms(redis)) < 1_000
    monkeypatch.setattr(time, "time_ns", lambda: real() + 10 * 10**9)  # then a step ahead
    assert abs(now_ms() - await redis_ms(redis)) < 1_000
