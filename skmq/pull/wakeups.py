"""Wake-ups of long polls, whichever broker stored a message or made one due: the
owners' feed of the group log (skmq/queue/lua/feed.lua) and pull_nack.lua publish on
the app's group-log channel (`<prefix>:{app}:glog`); one pattern subscription a broker
wakes the polls waiting on it. Idle polls send nothing to Redis; a poll also wakes by
itself when the group's next delay or lease runs out.

A wake-up goes to the first waiting poll of each group of the app, not to all: every
poll a store woke would run a receive, and all but one would find nothing (2,000 polls
of one group cost 850 receives a message). Only that first poll also sleeps until the
group's next due time (a delay, a retry, a lease's end). It passes the turn on to the
next poll of its group when it leaves having taken messages (there may be more), woken
but not served, cancelled (a receive may have run), or knowing a due time to come."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import structlog
from redis.exceptions import RedisError

from skmq.aio import listen_again
from skmq.store.client import RedisClient, subscriber

log = structlog.get_logger("skmq.pull.wakeups")


@dataclass(eq=False)
class Waiting:
    event: asyncio.Event  # set: woken, receive again
    # It took messages (the next poll of its group may find more), was cancelled (its
    # receive may have run), or knows the group's next due time: its turn goes on.
    hand_on: bool = False


def _first(polls: dict[asyncio.Event, None]) -> None:
    """Wake the first of a group's waiting polls (one already woken keeps the turn)."""
    for event in polls:
        event.set()
        return


class Wakeups:
    def __init__(self, redis: RedisClient, prefix: str) -> None:
        self.redis = redis
        self.turns = 0  # subscriptions made (skmq/store/client.py: subscriber)
        self.node = ""  # the node of the last one
        self.pattern = f"{prefix}:*:glog"
        # channel -> group -> its waiting polls' events, first come first (dicts: ordered)
        self._waiting: defaultdict[str, dict[str, dict[asyncio.Event, None]]] = defaultdict(dict)
        self.count = 0  # polls waiting now

    @contextlib.contextmanager
    def listen(self, channel: str, group: str) -> Iterator[Waiting]:
        """A poll of `group` waiting on `channel` (registered before its first receive, so
        no wake-up falls between that receive and the wait)."""
        polls = self._waiting[channel].setdefault(group, {})
        waiting = Waiting(asyncio.Event())
        polls[waiting.event] = None
        self.count += 1
        try:
            yield waiting
        except BaseException:
            waiting.hand_on = True
            raise
        finally:
            self.count -= 1
            del polls[waiting.event]
            if waiting.event.is_set() or waiting.hand_on:
                _first(polls)
            if not polls:
                del self._waiting[channel][group]
                if not self._waiting[channel]:
                    del self._waiting[channel]

    def is_first(self, channel: str, group: str, waiting: Waiting) -> bool:
        """Whether `waiting` is the first waiting poll of its group."""
        return next(iter(self._waiting[channel][group])) is waiting.event

    def _wake(self, channel: str | None) -> None:
        for name, groups in self._waiting.items():
            if channel is None or name == channel:
                for polls in groups.values():
                    _first(polls)

    async def run(self) -> None:
        """Listen for wake-ups (a supervised task); each new subscription wakes every poll
        once, for what it missed."""
        await listen_again(self._listen, (RedisError, OSError), "pull wake-ups", log)

    async def _listen(self) -> None:
        pubsub, self.node = subscriber(self.redis, self.turns)
        self.turns += 1
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
