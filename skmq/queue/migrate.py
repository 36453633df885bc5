"""A store an earlier SKMQ wrote, converted to the owner engine's layout when a broker of
this version starts on it.

Earlier versions ran each transition as a Lua script on keys every broker shared: an
app's messages in a `msgs` hash (skmq/store/messages.py), their delivery state in a
`state` hash, and the deliveries in `ready` (a list), `delayed`, `inflight`, `dead` and
`kq` (ordering keys). The owner engine keeps what survives a broker in the app's inbox
and log streams and its dead letters (skmq/queue/dead.py). So, for each app:

- a message waiting (pending, delayed, waiting for a retry or behind its ordering key)
  or in flight becomes an entry of the app's inbox, in the order it would have gone
  (each ordering key's in its order), as if stored
  through a broker that does not own the app: its next owner reads it, delivers it
  again (one in flight: at least once) with its delay, TTL, ordering key and
  traceparent; its attempts start again;
- a topic message fanned out: each copy not yet acked becomes an entry for its
  recipient alone; the acked copies are over;
- a dead letter keeps its attempts, last error, history and the time it died.

An app moves a page of messages at a time (the broker's memory is bounded whatever
the backlog), each message in one script with its removal from `msgs` (lua/migrate.lua), so a
migration cut short (a crash, a stop) goes on where it stopped, and brokers that start
together move each message once. The recipients, consumer groups, the apps directory
and the dedupe sets are the same keys in both layouts (a packed msgid of a dedupe set
is written as text, as the owner engine holds msgids). Once every app is moved, the
store is marked as the owner engine's (skmq/store/engine_mark.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

from skmq.errors import Misconfigured
from skmq.queue.dead import head
from skmq.queue.entries import Meta, encode_header
from skmq.queue.journal import AppKeys, script_source
from skmq.store.client import ENC, RedisClient, text
from skmq.store.engine_mark import OWNER, UNSHARDED, is_legacy, mark_key
from skmq.store.messages import read
from skmq.store.msgids import SEP, TAG, split_held, unpack
from skmq.store.store import Store

log = structlog.get_logger("skmq.queue.migrate")

# The old layout's keys of an app, under its hash tag (lib.lua of earlier versions)
OLD_KEYS = ("msgs", "state", "ready", "delayed", "inflight", "kq")
CHUNK = 500  # messages a script call
PROGRESS = 100_000  # messages moved between two lines of progress
ALIVE_MS = 10_000  # a broker that said it was alive since then is running


@dataclass(slots=True)
class Moved:
    """One message's part of a migrate.lua call."""

    held: bytes  # its msgid as `msgs` holds it
    live: list[Any] = field(default_factory=list)  # (stored, msgid, content, header)*
    dead: list[Any] = field(default_factory=list)  # (old id, delivery id, died, value)*

    def args(self) -> list[Any]:
        return [self.held, len(self.live) // 4, len(self.dead) // 4, *self.live, *self.dead]


# A message's state attributes a migration reads (lib.lua of earlier versions): its
# ordering key's place, traceparent, topic copies, expiry, due time behind its key,
# attempts, last error, history and last recipient; a copy's own n, e, h.
ATTRS = (b"k", b"tp", b"c", b"x", b"d", b"n", b"e", b"h", b"r")
COPY_ATTRS = (b"n", b"e", b"h")


def _fields(held: bytes, attrs: Iterable[bytes], copy: bytes = b"") -> list[bytes]:
    return [held + SEP + a + (SEP + copy if copy else b"") for a in attrs]


@dataclass(frozen=True, slots=True)
class Delivery:
    """What a dead letter's or an inbox entry's writing needs of one delivery."""

    old_id: bytes
    copy: bytes
    due: float | None  # in `delayed`: when it falls due
    died: float | None  # in `dead`: when it died
    waiting: bool  # in ready, delayed or in flight
    attempts: int
    error: str
    history: str


async def _page(
    redis: RedisClient, base: str, helds: list[bytes], ready_copies: set[bytes], now: int
) -> list[Moved]:
    """The messages of `helds` still in `msgs`, as migrate.lua moves them (a round trip
    for the messages and their state, another for their topic copies')."""
    pipe = redis.pipeline(transaction=False)
    pipe.hmget(base + "msgs", helds)
    pipe.hmget(base + "state", [f for h in helds for f in _fields(h, ATTRS)])
    pipe.zmscore(base + "delayed", helds)
    pipe.zmscore(base + "dead", helds)
    values, attrs, due, died = await pipe.execute()
    found = []
    for i, (held, value) in enumerate(zip(helds, values, strict=True)):
        if value is not None:
            a = dict(zip(ATTRS, attrs[i * len(ATTRS) : (i + 1) * len(ATTRS)], strict=True))
            found.append((held, value, a, due[i], died[i]))
    copies = [(held, copy) for held, _, a, _, _ in found if a[b"c"] for copy in a[b"c"].split(SEP)]
    copy_ids = [held + SEP + copy for held, copy in copies]
    of_copy: dict[tuple[bytes, bytes], Delivery] = {}
    if copies:
        pipe = redis.pipeline(transaction=False)
        pipe.zmscore(base + "delayed", copy_ids)
        pipe.zmscore(base + "inflight", copy_ids)
        pipe.zmscore(base + "dead", copy_ids)
        pipe.hmget(base + "state", [f for h, c in copies for f in _fields(h, COPY_ATTRS, c)])
        c_due, c_flying, c_died, c_attrs = await pipe.execute()
        for j, ((held, copy), cid) in enumerate(zip(copies, copy_ids, strict=True)):
            n, e, h = c_attrs[3 * j : 3 * j + 3]
            waiting = cid in ready_copies or c_due[j] is not None or c_flying[j] is not None
            of_copy[held, copy] = Delivery(
                cid, copy, c_due[j], c_died[j], waiting, int(n or 0), text(e or b""), text(h or b"")
            )
    out = []
    for held, value, a, m_due, m_died in found:
        if a[b"c"]:
            deliveries = [of_copy[held, c] for c in a[b"c"].split(SEP)]
        else:  # (a queue message, or a topic one not fanned out: waiting unless dead)
            n, e, h = int(a[b"n"] or 0), text(a[b"e"] or b""), text(a[b"h"] or b"")
            deliveries = [Delivery(held, b"", m_due, m_died, m_died is None, n, e, h)]
        out.append(_message(held, value, a, deliveries, now))
    return out


def _message(
    held: bytes, value: bytes, a: dict[bytes, bytes | None], deliveries: list[Delivery], now: int
) -> Moved:
    kind, stored, content = read(value, now)
    msgid = unpack(held).encode("utf-8", ENC)
    key = text((a[b"k"] or b"").partition(SEP)[0])
    trace = text(a[b"tp"] or b"")
    topic = kind == "topic"
    moved = Moved(held)
    for d in deliveries:
        meta = Meta(topic, 0, 0, key, trace, text(d.copy))
        if d.died is not None:
            last = meta.only or text(a[b"r"] or b"")
            history = d.history.split("\n") if d.history else []
            value_head = head(meta, stored, d.attempts, d.error, history, last)
            delivery_id = msgid + SEP + d.copy if d.copy else msgid
            moved.dead += (d.old_id, delivery_id, int(d.died), value_head + content)
        elif d.waiting:
            due = int(d.due or a[b"d"] or 0)
            expires = int(a[b"x"] or 0)
            live = Meta(topic, due if due > now else 0, expires, key, trace, meta.only)
            moved.live += (stored, msgid, content, encode_header(live))
        # (else: a topic copy acked)
    return moved


async def _ids(redis: RedisClient, base: str) -> AsyncIterator[list[bytes]]:
    """Pages of msgids to move, in the order their messages are delivered again: those
    ready (in their order), in flight, delayed, then those behind their ordering key (in
    its order, after the key's first message, which is in one of those), the dead, and
    last any message in none of these (none should be)."""
    for name in ("ready", "inflight", "delayed", "kq", "dead"):
        key, start = base + name, 0
        while True:
            if name == "ready":
                page = await redis.lrange(key, start, start + CHUNK - 1)
            else:
                page = await redis.zrange(key, start, start + CHUNK - 1)
            if not page:
                break
            start += len(page)
            if name == "kq":  # (<key> \x1f <16-digit sequence> \x1f <msgid>)
                page = [m[m.index(SEP) + 18 :] for m in page]
            yield [split_held(i)[0] for i in page]
    cursor = 0
    while True:
        cursor, page = await redis.hscan(base + "msgs", cursor, count=CHUNK)
        if page:
            yield list(page)
        if not cursor:
            break


async def _ready_copies(redis: RedisClient, base: str) -> set[bytes]:
    """The topic copies in `ready` (the queue messages there need no such lookup)."""
    copies: set[bytes] = set()
    start = 0
    while page := await redis.lrange(base + "ready", start, start + 10 * CHUNK - 1):
        copies.update(i for i in page if split_held(i)[1])
        start += len(page)
    return copies


async def migrate_app(redis: RedisClient, prefix: str, app: str, now: int) -> int:
    """One app's messages moved, a page at a time; how many (0: none left to move)."""
    keys = AppKeys.of(prefix, app)
    script = redis.register_script(script_source("migrate"))
    touched = [keys.base + "msgs", keys.inbox, keys.dead, keys.dead_order, keys.dead_copies]
    ready_copies = await _ready_copies(redis, keys.base)
    count = 0
    async for helds in _ids(redis, keys.base):
        if moved := await _page(redis, keys.base, list(dict.fromkeys(helds)), ready_copies, now):
            args = [a for m in moved for a in m.args()]
            before, count = count, count + int(await script(touched, [keys.wakeup, *args]))
            if count // PROGRESS > before // PROGRESS:
                log.info("converting an app", app=app, messages=count)
    return count


async def _dedupe_as_text(redis: RedisClient, keys: AppKeys, now: int, dedupe_ms: int) -> None:
    """The packed msgids of the app's dedupe sets written as text."""
    for key in keys.dedupe(now, dedupe_ms):
        if packed := [m for m in await redis.smembers(key) if m[:1] == TAG]:
            await redis.sadd(key, *(unpack(m) for m in packed))
            await redis.srem(key, *packed)


async def migrate_store(store: Store, now: int) -> None:
    """Every app of the store moved, then the store marked as the owner engine's."""
    redis, prefix = store.redis, store.prefix
    unsharded = store.global_key(UNSHARDED)
    if listed := await redis.smembers(unsharded):  # (a store older still: one apps set)
        await store.add_apps(text(app) for app in listed)
        await redis.delete(unsharded)
    apps = await store.apps()
    log.info("converting a store of an earlier version", apps=len(apps))
    for app in apps:
        keys = AppKeys.of(prefix, app)
        count = await migrate_app(redis, prefix, app, now)
        await _dedupe_as_text(redis, keys, now, store.dedupe_ms)
        if not await redis.hlen(keys.base + "msgs"):  # (every message moved: by us or another)
            await redis.delete(*(keys.base + name for name in OLD_KEYS))
        log.info("app converted", app=app, messages=count)
    await redis.delete(store.global_key("msgids"))  # (the old layout's format: msgids.py)
    await redis.set(mark_key(prefix), OWNER)
    log.info("store converted", apps=len(apps))


async def convert_legacy(store: Store, now: int) -> None:
    """A store an earlier version wrote converted (`migrate_store`); any other as it is.
    Refused (Misconfigured) while a broker of that version still serves it (one that
    said it was alive within ALIVE_MS: every broker says so each second), whose writes
    to the old layout would be stranded there."""
    prefix = store.prefix
    if not await is_legacy(store.redis, prefix):
        return
    alive = sorted(
        f"{info.get('host')}:{info.get('port')}"
        for info in (await store.brokers()).values()
        if now - int(info.get("last_seen") or 0) < ALIVE_MS
    )
    if alive:
        raise Misconfigured(
            f"the store (KEY_PREFIX {prefix!r}) is served by brokers of an earlier SKMQ "
            f"({', '.join(alive)}): stop them, then start this one, which converts it"
        )
    await migrate_store(store, now)
