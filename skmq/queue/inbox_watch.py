"""A store through a broker that does not own the app appends to the app's
inbox and publishes on `<prefix>:{app}:inbox` (lua/append.lua); one pattern subscription
a broker hears them, and the owner reads its inbox at its next claim. A new subscription
tells every owned app once, for what it may have missed. The same connection hears the
owners' verdicts on answers this broker forwarded (skmq/queue/forward.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import structlog
from redis.exceptions import RedisError

from skmq.aio import listen_again
from skmq.store.client import RedisClient, subscriber

log = structlog.get_logger("skmq.queue.inbox_watch")


def unescape_tag(tag: str) -> str:
    """The app id of a hash tag (skmq.store.store.escape_tag reversed)."""
    return tag.replace("%3A", ":").replace("%7D", "}").replace("%7B", "{").replace("%25", "%")


def glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


class InboxWatch:
    def __init__(
        self,
        redis: RedisClient,
        prefix: str,
        told: Callable[[str], None],
        missed: Callable[[], None],
        replies: tuple[str, Callable[[bytes], None]],
    ) -> None:
        self.redis = redis
        self.turns = 0  # subscriptions made (skmq/store/client.py: subscriber)
        self.node = ""  # the node of the last one
        self.head = f"{prefix}:{{"
        self.pattern = f"{glob_escape(prefix)}:{{*}}:inbox"
        self.told = told  # an app's inbox has news
        self.missed = missed  # a new subscription: what was published before it is lost
        self.replies = replies  # this broker's reply channel (skmq/queue/forward.py)

    def app_of(self, channel: str) -> str | None:
        if not (channel.startswith(self.head) and channel.endswith("}:inbox")):
            return None
        return unescape_tag(channel[len(self.head) : -len("}:inbox")])

    async def run(self) -> None:
        """Listen (a supervised task)."""
        await listen_again(self._listen, (RedisError, OSError), "inbox wake-ups", log)

    async def _listen(self) -> None:
        pubsub, self.node = subscriber(self.redis, self.turns)
        self.turns += 1
        try:
            await pubsub.psubscribe(self.pattern)
            await pubsub.subscribe(self.replies[0])
            self.missed()
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is not None and message["type"] == "message":
                    self.replies[1](message["data"])
                elif message is not None and message["type"] == "pmessage":
                    channel = message["channel"]
                    name = channel.decode() if isinstance(channel, bytes) else channel
                    app = self.app_of(name)
                    if app is not None:
                        self.told(app)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
