"""A store an earlier SKMQ wrote, converted to the owner engine's layout when a broker of
this version starts on it.

Earlier versions ran each transition as a Lua script on keys every broker shared: an
app's messages in a `msgs` hash (skmq/store/messages.py), their delivery state in a
`state` hash, and the deliveries in `ready` (a list), `delayed`, `inflight`, `dead` and
`kq` (ordering keys). The owner engine keeps what survives a broker in the app's inbox
and log streams and its dead letters (skmq/queue/dead.py). So, for each app:

- a message waiting (pending, delayed, waiting for a retry or behind its ordering key)
  or in flight becomes an entry of the app's inbox, in stored order, as if stored
  through a broker that does not own the app: its next owner reads it, delivers it
  again (one in flight: at least once) with its delay, TTL, ordering key and
  traceparent; its attempts start again;
- a topic message fanned out: each copy not yet acked becomes an entry for its
  recipient alone; the acked copies are over;
- a dead letter keeps its attempts, last error, history and the time it died.

Each message moves in one script with its removal from `msgs` (lua/migrate.lua), so a
migration cut short (a crash, a stop) goes on where it stopped, and brokers that start
together move each message once. The recipients, consumer groups, the apps directory
and the dedupe sets are the same keys in both layouts (a packed msgid of a dedupe set
is written as text, as the owner engine holds msgids). Once every app is moved, the
store is marked as the owner engine's (skmq/store/engine_mark.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

from skmq.errors import Misconfigured
from skmq.queue.dead import head
from skmq.queue.entries import Meta, encode_header
from skmq.queue.journal import AppKeys, script_source
from skmq.store.client import ENC, RedisClient
from skmq.store.directory import AppDirectory
from skmq.store.engine_mark import LEGACY, mark_key, written_by
from skmq.store.messages import read
from skmq.store.msgids import SEP, TAG, unpack

log = structlog.get_logger("skmq.queue.migrate")

# The old layout's keys of an app, under its hash tag (lib.lua of earlier versions)
OLD_KEYS = ("msgs", "state", "ready", "delayed", "inflight", "kq")
CHUNK = 500  # messages a script call
ALIVE_MS = 10_000  # a broker that said it was alive since then is running


@dataclass(slots=True)
class Moved:
    """One message's part of a migrate.lua call."""

    held: bytes  # its msgid as `msgs` holds it
    order: tuple[int, int]  # stored ms, then its place in its ordering key
    live: list[Any] = field(default_factory=list)  # (stored, msgid, content, header)*
    dead: list[Any] = field(default_factory=list)  # (old id, delivery id, died, value)*


@dataclass(frozen=True, slots=True)
class OldApp:
    """One app's keys in the old layout, as read."""

    msgs: dict[bytes, bytes]
    state: dict[bytes, bytes]
    waiting: set[bytes]  # delivery ids in ready, delayed or in flight
    due: dict[bytes, float]  # delayed: when each falls due
    dead: dict[bytes, float]  # when each died

    def attr(self, held: bytes, name: str, copy: bytes = b"") -> bytes:
        """A state attribute of a message (of its topic copy for `copy`): b"" if unset."""
        f = held + SEP + name.encode() + (SEP + copy if copy else b"")
        return self.state.get(f, b"")


def _message(old: OldApp, held: bytes, value: bytes, now: int) -> Moved:
    kind, stored, content = read(value, now)
    msgid = unpack(held).encode("utf-8", ENC)
    place = old.attr(held, "k")  # <key> \x1f <16-digit sequence> \x1f <msgid>
    key, _, rest = place.partition(SEP)
    moved = Moved(held, (stored, int(rest[:16] or 0)))
    topic = kind == "topic"
    copies = old.attr(held, "c").split(SEP) if topic and old.attr(held, "c") else [b""]
    for copy in copies:
        did = held + SEP + copy if copy else held
        text_id = msgid + SEP + copy if copy else msgid
        meta = Meta(topic, 0, 0, key.decode(), old.attr(held, "tp").decode(), copy.decode())
        if did in old.dead:
            history = old.attr(held, "h", copy).decode()
            value_head = head(
                meta,
                stored,
                int(old.attr(held, "n", copy) or 0),
                old.attr(held, "e", copy).decode(),
                history.split("\n") if history else [],
                copy.decode() or old.attr(held, "r").decode(),
            )
            moved.dead += (did, text_id, int(old.dead[did]), value_head + content)
        elif did in old.waiting or not copy:  # (one behind its key waits in kq alone)
            due = int(old.due.get(did) or old.attr(held, "d") or 0)
            expires = int(old.attr(held, "x") or 0)
            live = Meta(topic, due if due > now else 0, expires, meta.key, meta.trace, meta.only)
            moved.live += (stored, msgid, content, encode_header(live))
        # (else: a topic copy acked)
    return moved


async def _read(redis: RedisClient, base: str) -> OldApp:
    pipe = redis.pipeline(transaction=False)
    pipe.hgetall(base + "msgs")
    pipe.hgetall(base + "state")
    pipe.lrange(base + "ready", 0, -1)
    pipe.zrange(base + "delayed", 0, -1, withscores=True)
    pipe.zrange(base + "inflight", 0, -1)
    pipe.zrange(base + "dead", 0, -1, withscores=True)
    msgs, state, ready, delayed, inflight, dead = await pipe.execute()
    due = dict(delayed)
    return OldApp(msgs, state, {*ready, *due, *inflight}, due, dict(dead))


def _chunks(moved: list[Moved]) -> Iterable[list[Any]]:
    """Each chunk's ARGV after the channel."""
    for i in range(0, len(moved), CHUNK):
        args: list[Any] = []
        for m in moved[i : i + CHUNK]:
            args += (m.held, len(m.live) // 4, len(m.dead) // 4, *m.live, *m.dead)
        yield args


async def migrate_app(redis: RedisClient, prefix: str, app: str, now: int) -> int:
    """One app's messages moved; how many (0: none left in the old layout)."""
    keys = AppKeys.of(prefix, app)
    old = await _read(redis, keys.base)
    if not old.msgs:
        return 0
    moved = sorted(
        (_message(old, held, value, now) for held, value in old.msgs.items()),
        key=lambda m: m.order,
    )
    script = redis.register_script(script_source("migrate"))
    touched = [keys.base + "msgs", keys.inbox, keys.dead, keys.dead_order, keys.dead_copies]
    count = 0
    for args in _chunks(moved):
        count += int(await script(touched, [keys.wakeup, *args]))
    return count


async def _dedupe_as_text(redis: RedisClient, keys: AppKeys, now: int, dedupe_ms: int) -> None:
    """The packed msgids of the app's dedupe sets written as text."""
    for key in keys.dedupe(now, dedupe_ms):
        if packed := [m for m in await redis.smembers(key) if m[:1] == TAG]:
            await redis.sadd(key, *(unpack(m) for m in packed))
            await redis.srem(key, *packed)


async def migrate_store(redis: RedisClient, prefix: str, now: int, dedupe_ms: int) -> None:
    """Every app of the store moved, then the store marked as the owner engine's."""
    apps = await AppDirectory(redis, prefix).members()
    log.info("converting a store of an earlier version", apps=len(apps))
    for app in apps:
        keys = AppKeys.of(prefix, app)
        base = keys.base
        count = await migrate_app(redis, prefix, app, now)
        await _dedupe_as_text(redis, keys, now, dedupe_ms)
        if not await redis.hlen(base + "msgs"):  # (every message moved: by us or another)
            await redis.delete(*(base + name for name in OLD_KEYS))
        log.info("app converted", app=app, messages=count)
    await redis.set(mark_key(prefix), "owner")
    log.info("store converted", apps=len(apps))


async def convert_legacy(redis: RedisClient, prefix: str, now: int, dedupe_ms: int) -> None:
    """A store an earlier version wrote converted (`migrate_store`); any other as it is.
    Refused (Misconfigured) while a broker of that version still serves it (one that
    said it was alive within ALIVE_MS: every broker says so each second), whose writes
    to the old layout would be stranded there."""
    if await written_by(redis, prefix) != LEGACY:
        return
    seen = await redis.hgetall(f"{prefix}:brokers")
    alive = sorted(
        f"{info.get('host')}:{info.get('port')}"
        for info in (json.loads(v) for v in seen.values())
        if now - int(info.get("last_seen") or 0) < ALIVE_MS
    )
    if alive:
        raise Misconfigured(
            f"the store (KEY_PREFIX {prefix!r}) is served by brokers of an earlier SKMQ "
            f"({', '.join(alive)}): stop them, then start this one, which converts it"
        )
    await migrate_store(redis, prefix, now, dedupe_ms)
