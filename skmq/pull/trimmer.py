"""Keeps the group logs short: every GROUP_LOG_TRIM_INTERVAL one broker (a lock that
expires) drops, app by app, the entries no consumer group needs any more."""

from __future__ import annotations

import asyncio

import structlog
from redis.exceptions import RedisError

from skmq.pull.groups import Groups

log = structlog.get_logger("skmq.pull.trimmer")


class Trimmer:
    def __init__(self, groups: Groups, broker_id: str, interval: float) -> None:
        self.groups = groups
        self.broker_id = broker_id
        self.interval = interval

    async def trim_once(self) -> int:
        store = self.groups.store
        if not await store.take_turn("group-trim", self.broker_id, int(self.interval * 800)):
            return 0
        dropped = 0
        for app in await self.groups.with_log(await store.apps()):
            dropped += await self.groups.trim(app)
        return dropped

    async def run(self) -> None:
        """A supervised task: a Redis failure waits for the next round."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.trim_once()
            except (RedisError, OSError) as exc:
                log.warning("group log trim failed, next round retries", error=repr(exc))
