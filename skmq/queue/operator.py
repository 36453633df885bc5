"""ENGINE=owner: an operator's look at an app's waiting messages (peek) and their purge,
done by the app's owner, which alone holds them. From any process (the CLI, another
broker's gateway) the request is appended to the app's inbox as a question
(lua/ask.lua, as a forwarded answer is: skmq/queue/forward.py), and the owner publishes
its reply on a channel the asker subscribed to for it alone.

A purge is the table's PURGE of each waiting copy (skmq/queue/lifecycle.py), journaled
and flushed before the owner replies: a new owner does not bring it back. A topic message
still waiting for a first recipient is shown but not purged (it has no delivery yet).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal

import redis.asyncio as aioredis

from skmq.queue.deliveries import Delivery
from skmq.queue.entries import Entry, entry_order
from skmq.queue.journal import AppKeys, script_source
from skmq.queue.lifecycle import WAITING
from skmq.queue.owner import AppOwner

OP = "op"  # a question's JSON field naming an operator's request (a forwarded answer has none)


class NoOwner(Exception):
    """No broker owns the app now: its waiting messages are in no one's memory."""


@dataclass(frozen=True, slots=True)
class Request:
    op: Literal["peek", "purge"]
    limit: int | None
    older_than_ms: int | None = None  # purge: only messages stored before now minus this
    dry_run: bool = False
    reply: str = ""  # the asker's channel

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()


@dataclass(frozen=True, slots=True)
class Seen:
    """One waiting message as the owner has it (what `peek` shows)."""

    msgid: str
    stored_ms: int
    attempts: int
    key: str
    content: str  # latin-1: the bytes as they are
    due_ms: int


def request_of(raw: bytes) -> Request | None:
    """The operator's request a question holds, or None (a forwarded answer)."""
    body = json.loads(raw)
    if not isinstance(body, dict) or OP not in body:
        return None
    return Request(**body)


def oldest_waiting(owner: AppOwner) -> int | None:
    """When the oldest message still waiting was stored (unix ms), or None."""
    for d in _waiting(owner):
        return d.stored_at
    return None


def _waiting(owner: AppOwner) -> Iterator[Delivery]:
    """Waiting deliveries (not in flight), one a message, in the order they were read:
    the order they were stored but for what a takeover merged from the inbox."""
    seen: set[bytes] = set()
    for d in owner.queue.deliveries.values():
        if d.state in WAITING and d.msgid not in seen:
            seen.add(d.msgid)
            yield d


async def answer_request(owner: AppOwner, request: Request, now: int) -> list[Any]:
    """At the owner: the request done; its reply."""
    if request.op == "peek":
        return await _peek(owner, request.limit)
    return await _purge(owner, request, now)


async def _peek(owner: AppOwner, limit: int | None) -> list[Any]:
    shown = list(itertools.islice(_waiting(owner), limit))
    await owner.contents(shown)
    seen = [
        Seen(
            d.msgid.decode("latin-1"),
            d.stored_at,
            d.attempt,
            d.key,
            (d.content or b"").decode("latin-1"),
            d.due,
        )
        for d in sorted(shown, key=lambda d: entry_order(d.entry))
    ]
    room = None if limit is None else limit - len(seen)
    seen += [_unfanned(e) for e, _ in itertools.islice(owner.unfanned, room)]
    return [asdict(s) for s in seen]


def _unfanned(e: Entry) -> Seen:
    stored = int(e.entry.split(b"-", 1)[0])
    due = max(stored, e.meta.deliver_at)
    return Seen(e.msgid.decode("latin-1"), stored, 0, e.meta.key, e.content.decode("latin-1"), due)


async def _purge(owner: AppOwner, request: Request, now: int) -> list[Any]:
    cutoff = None if request.older_than_ms is None else now - request.older_than_ms
    chosen = [d.msgid for d in _waiting(owner) if cutoff is None or d.stored_at <= cutoff][
        : request.limit
    ]
    if request.dry_run or not chosen:
        return [m.decode("latin-1") for m in chosen]
    picked = set(chosen)
    for d in list(owner.queue.deliveries.values()):
        if d.msgid in picked and d.state in WAITING:
            owner.queue.purge(d.msgid, d.copy, now)
    await owner.flush(now)
    return [m.decode("latin-1") for m in chosen]


async def ask_owner(
    redis: aioredis.Redis, prefix: str, app: str, request: Request, timeout: float
) -> list[Any]:
    """The owner's reply to `request`; NoOwner where no broker owns the app, TimeoutError
    where its owner did not reply within `timeout` seconds."""
    keys = AppKeys.of(prefix, app)
    if not await redis.exists(keys.owner):
        raise NoOwner(f"no broker owns app {app!r} now: start one, then ask again")
    channel = f"{prefix}:replies:op:{uuid.uuid4().hex}"
    pubsub = redis.pubsub()
    try:
        async with asyncio.timeout(timeout):
            await pubsub.subscribe(channel)
            question = Request(
                request.op, request.limit, request.older_than_ms, request.dry_run, channel
            )
            ask = redis.register_script(script_source("ask"))
            await ask([keys.inbox], [keys.wakeup, question.encode()])
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is not None and message["type"] == "message":
                    reply: list[Any] = json.loads(message["data"])
                    return reply
    finally:
        await pubsub.aclose()
