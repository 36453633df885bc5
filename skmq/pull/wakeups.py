"""Wake-ups of long polls, whichever broker stored a message or made one due: store.lua
and pull_nack.lua publish on the app's group-log channel (`<prefix>:{app}:glog`); one
pattern subscription a broker wakes the polls waiting on it. Idle polls send nothing to
Redis; a poll also wakes by itself when the group's next delay or lease runs out."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Iterator

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

log = structlog.get_logger("skmq.pull.wakeups")


class Wakeups:
    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self.redis = redis
        self.pattern = f"{prefix}:*:glog"
        self._waiting: defaultdict[str, set[asyncio.Event]] = defaultdict(set)
        self.count = 0  # polls waiting now

    @contextlib.contextmanager
    def listen(self, channel: str) -> Iterator[asyncio.Event]:
        """An event set whenever `channel` is told (registered before the first receive,
        so no wake-up falls between that receive and the wait)."""
        event = asyncio.Event()
        self._waiting[channel].add(event)
        self.count += 1
        try:
            yield event
        finally:
            self.count -= 1
            waiting = self._waiting[channel]
            waiting.discard(event)
            if not waiting:
                del self._waiting[channel]

    def _wake(self, channel: str | None) -> None:
        for name, events in self._waiting.items():
            if channel is None or name == channel:
                for event in events:
                    event.set()

    async def run(self) -> None:
        """Listen for wake-ups (a supervised task). A lost connection is retried with a
        growing pause; each new subscription wakes every poll once, for what it missed."""
        pause = 0.05
        while True:
            try:
                await self._listen()
            except (RedisError, OSError) as exc:
                log.warning(
                    "pull wake-ups lost, subscribing again", error=repr(exc), retry_in=pause
                )
                await asyncio.sleep(pause)
                pause = min(pause * 2, 2.0)

    async def _listen(self) -> None:
        pubsub = self.redis.pubsub()
        try:
            await pubsub.psubscribe(self.pattern)
            self._wake(None)
            while True:
                # a bounded read of the subscription socket (no command is sent)
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is not None and message["type"] == "pmessage":
                    channel = message["channel"]
                    self._wake(channel.decode() if isinstance(channel, bytes) else channel)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
