"""An operator's look at an app's waiting messages (peek) and their purge,
done by the app's owner, which alone holds them. From any process (the CLI, another
broker's gateway) the request is appended to the app's inbox as a question
(lua/ask.lua, as a forwarded answer is: skmq/queue/forward.py), and the owner publishes
its reply on a channel the asker subscribed to for it alone.

A purge is the table's PURGE of each waiting copy (skmq/lifecycle.py), journaled
and flushed before the owner replies: a new owner does not bring it back. A topic message
still waiting for a first recipient is shown but not purged (it has no delivery yet).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from skmq.lifecycle import WAITING, State
from skmq.queue.deliveries import Delivery
from skmq.queue.entries import entry_order
from skmq.queue.journal import AppKeys, script_source
from skmq.queue.owner import AppOwner
from skmq.store.store import PREVIEW_BYTES

OP = "op"  # a question's JSON field naming an operator's request (a forwarded answer has none)
ASK_TIMEOUT = 5.0  # s: how long an asker waits for the owner's reply


class NoOwner(RedisError):  # type: ignore[misc]
    """No broker owns the app now (its waiting messages are in no one's memory), or its
    owner did not reply in time. (A RedisError: the store's trouble, to the CLI and HTTP.)"""


class OperatorFault(Exception):
    """The owner met a fault doing an operator's request (its reply names it)."""


FAULT = "fault"  # the key of a reply that is a fault, not a result


@dataclass(frozen=True, slots=True)
class Request:
    op: Literal["peek", "purge", "move"]
    limit: int | None
    before_ms: int | None = None  # purge: only what was stored at or before (unix ms)
    dry_run: bool = False
    reply: str = ""  # the asker's channel
    source: str = ""  # move: the app whose dead letters `ids` move into the owner's
    ids: tuple[str, ...] = ()

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()


def request_of(raw: bytes) -> Request | None:
    """The operator's request a question holds, or None (a forwarded answer)."""
    body = json.loads(raw)
    if not isinstance(body, dict) or OP not in body:
        return None
    return Request(**{**body, "ids": tuple(body.get("ids", ()))})


def oldest_pending(owner: AppOwner) -> int | None:
    """When the oldest message pending (due, waiting for a recipient) was stored (unix
    ms), or None. (Nothing pending held but a backlog in the log: the time of the log's
    cursor, no later than the backlog's first message.)"""
    for d in _waiting(owner):
        if d.state is State.PENDING:
            return d.stored_at
    return int(owner.log_cursor.split(b"-", 1)[0]) or None if owner.backlog else None


def _waiting(owner: AppOwner) -> Iterator[Delivery]:
    """Waiting deliveries (not in flight; a topic message's copies each), in the order
    they were read: the order they were stored but for what a takeover merged from the
    inbox."""
    return (d for d in owner.queue.deliveries.values() if d.state in WAITING)


async def answer_request(owner: AppOwner, request: Request, now: int) -> list[Any]:
    """At the owner: a peek or a purge done; its reply. (A move reads and takes another
    app's dead letters: the store's, OwnedStore.move_into.)"""
    if request.op == "peek":
        return await _peek(owner, request.limit, now)
    return await _purge(owner, request, now)


async def _peek(owner: AppOwner, limit: int | None, now: int) -> list[Any]:
    """[msgid, stored ms, attempts, key, size, preview, due ms (0: now, -1: its key's
    turn)] a waiting message, oldest first."""
    await owner.refill(now, limit)  # (what the log holds is read back to be shown)
    shown = list(itertools.islice(_waiting(owner), limit))
    await owner.contents(shown)
    seen = [
        _seen(d.msgid, d.stored_at, d.attempt, d.key, d.content or b"", _due(d))
        for d in sorted(shown, key=lambda d: entry_order(d.entry))
    ]
    room = None if limit is None else limit - len(seen)
    for e, _ in itertools.islice(owner.unfanned, room):  # (a topic message, no copy yet)
        stored = int(e.entry.split(b"-", 1)[0])
        seen.append(_seen(e.msgid, stored, 0, e.meta.key, e.content, e.meta.deliver_at))
    return seen


def _due(d: Delivery) -> int:
    if d.state is State.WAITING_KEY:
        return -1
    return 0 if d.state is State.PENDING else d.due


def _seen(
    msgid: bytes, stored: int, attempts: int, key: str, content: bytes, due: int
) -> list[Any]:
    preview = content[:PREVIEW_BYTES].decode("latin-1")
    return [msgid.decode("latin-1"), stored, attempts, key, len(content), preview, due]


async def _purge(owner: AppOwner, request: Request, now: int) -> list[Any]:
    """[msgid, kind, recipient ('': a queue message)] a delivery purged (on a dry run:
    that would be); flushed before the reply."""
    before, limit = request.before_ms, request.limit
    chosen: list[Delivery] = []
    while True:  # (a purge goes through the log's backlog a read at a time)
        room = None if limit is None else limit - len(chosen)
        await owner.refill(now, room if request.dry_run else 0)
        old_enough = (d for d in _waiting(owner) if before is None or d.stored_at <= before)
        more = list(itertools.islice(old_enough, room))
        chosen += more
        if request.dry_run or not more:
            break
        for d in more:
            owner.queue.purge(d.msgid, d.copy, now)
        owner.queue.drop_moved()
        await owner.flush(now)
        if not owner.backlog or len(chosen) == limit:
            break
    return [[d.msgid.decode("latin-1"), "topic" if d.topic else "queue", d.copy] for d in chosen]


async def ask_owner(
    redis: aioredis.Redis, prefix: str, app: str, request: Request, timeout: float = ASK_TIMEOUT
) -> list[Any]:
    """The owner's reply to `request`; NoOwner where no broker owns the app or its owner
    did not reply within `timeout` seconds."""
    keys = AppKeys.of(prefix, app)
    if not await redis.exists(keys.owner):
        raise NoOwner(f"no broker owns app {app!r} now: start one, then ask again")
    channel = f"{prefix}:replies:op:{uuid.uuid4().hex}"
    pubsub = redis.pubsub()
    try:
        async with asyncio.timeout(timeout):
            await pubsub.subscribe(channel)
            question = dataclasses.replace(request, reply=channel)
            ask = redis.register_script(script_source("ask"))
            await ask([keys.inbox], [keys.wakeup, question.encode()])
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is not None and message["type"] == "message":
                    reply: list[Any] | dict[str, str] = json.loads(message["data"])
                    if isinstance(reply, dict):
                        raise OperatorFault(f"the owner of app {app!r} failed: {reply[FAULT]}")
                    return reply
    except TimeoutError:
        raise NoOwner(f"the owner of app {app!r} did not reply within {timeout} s") from None
    finally:
        await pubsub.aclose()
