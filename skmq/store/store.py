"""Store: what SKMQ keeps in Redis beside the delivery engine's own keys: recipients, the
apps directory, brokers, tallies, the delivery secret, and the calls of the Lua scripts
those and the consumer groups use (`scripts.py`), one app per call. The delivery
engine's calls (store, claim, finish, ...) are `OwnedStore`'s (skmq/queue/owned_store.py),
the store class every broker and operator command makes.

Scripts are redis-py `Script`s (EVALSHA, loaded again after a NOSCRIPT). Each script
touches one app's keys, which share a hash tag, so on a Redis Cluster it runs on one node.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError

from skmq.jsonbody import content_json
from skmq.store import scripts
from skmq.store.client import (
    CLUSTER_SCHEME,
    ENC,
    RedisClient,
    connect_cluster,
    hiredis_packing,
)
from skmq.store.client import text as _s
from skmq.store.directory import AppDirectory
from skmq.store.multiplex import multiplexed
from skmq.store.shards import WriteFailed, master_of

log = structlog.get_logger("skmq.store")

SEP = "\x1f"


def split_delivery(delivery_id: str) -> tuple[str, str | None]:
    """`msgid` -> (msgid, None); `msgid \\x1f rid` (a topic copy) -> (msgid, rid)."""
    msgid, sep, rid = delivery_id.partition(SEP)
    return (msgid, rid) if sep else (msgid, None)


def escape_tag(app: str) -> str:
    """Keep `{`, `}` and `:` out of the hash tag, so that no app id can break the layout."""
    return app.replace("%", "%25").replace("{", "%7B").replace("}", "%7D").replace(":", "%3A")


class _SentinelBlockingPool(SentinelConnectionPool, BlockingConnectionPool):  # type: ignore[misc]
    """The Sentinel-managed pool (master discovery) that waits for a free connection."""


# What a store answers for an app: each message stored (True) or a duplicate (False),
# or why none of them is acknowledged.
AppStored = list[bool] | WriteFailed


def connect_redis(url: str, pool_size: int = 64, wait: float = 5.0) -> RedisClient:
    """A client for REDIS_URL: `redis://`, `rediss://`, `unix://`,
    `redis+sentinel://[:password@]host1:26379,host2:26379/<service>[/<db>]`, which asks
    the Sentinels for the current master (and again after a failover), or
    `redis+cluster://[:password@]host1:port1,host2:port2,...` (skmq/store/client.py).

    At most `pool_size` connections; a call finding them all busy waits up to `wait`
    seconds for one (a burst queues up instead of failing with "Too many connections")."""
    options: dict[str, Any] = {
        "encoding_errors": ENC,
        "decode_responses": False,
        "max_connections": pool_size,
        "timeout": wait,
        "socket_connect_timeout": 2.0,
        "socket_timeout": 10.0,
    }
    if url.startswith(f"{CLUSTER_SCHEME}://"):
        return connect_cluster(url, options)
    if not url.startswith("redis+sentinel://"):
        pool = BlockingConnectionPool.from_url(url, **options)
        pool.connection_class = hiredis_packing(pool.connection_class)
        return aioredis.Redis.from_pool(pool)
    parsed = urlsplit(url)
    hosts = []
    for part in parsed.netloc.rpartition("@")[2].split(","):
        host, _, port = part.rpartition(":")
        hosts.append((host or part, int(port) if host else 26379))
    path = [p for p in parsed.path.split("/") if p]
    if not path:
        raise ValueError("redis+sentinel:// URL needs the service name: .../<service>[/<db>]")
    sentinel = Sentinel(hosts, socket_connect_timeout=2.0)
    master: aioredis.Redis = sentinel.master_for(
        path[0],
        connection_pool_class=_SentinelBlockingPool,
        db=int(path[1]) if len(path) > 1 else 0,
        password=unquote(parsed.password) if parsed.password else None,
        **options,
    )
    pool = master.connection_pool
    pool.connection_class = hiredis_packing(pool.connection_class)
    return master


@dataclass(slots=True)
class NewMessage:
    msgid: str
    kind: str  # "queue" | "topic"
    content: bytes
    deliver_at: int = 0  # unix ms; 0: now
    expires_at: int = 0  # unix ms; 0: never (TTL)
    key: str = ""  # ordering key: one at a time, in stored order, per app and key
    trace: str = ""  # W3C traceparent the producer gave, carried to the push and the log


@dataclass(slots=True)
class AliveRecipient:
    """What a claim needs to know of an alive recipient."""

    rid: str
    free: int  # free window slots
    takes_length: bool  # declared the `length` capability


@dataclass(slots=True)
class Claimed:
    delivery_id: str
    msgid: str
    kind: str
    content: bytes
    attempt: int
    recipient: str
    stored_at: int = 0  # unix ms the message was first stored
    trace: str = ""  # the producer's W3C traceparent, if any


# What a claim returns: the deliveries, when the next delayed one falls due (unix ms),
# how long the app's DELIVERY_RATE bucket needs before the next push (s).
ClaimResult = tuple[list[Claimed], int | None, float]


@dataclass(slots=True)
class ClaimArgs:
    """A claim carried by a store (`OwnedStore.store(claims=...)`)."""

    app: str
    args: list[Any]  # OwnedStore.claim_args
    done: Callable[[ClaimResult | BaseException], None]


def hand_over(claim: ClaimArgs, result: ClaimResult | BaseException) -> None:
    """A carried claim's result to its dispatcher. Its trouble (a reply that does not
    parse, a push that raises) is its own: logged, never the store's, which succeeded."""
    try:
        claim.done(result)
    except Exception:
        log.exception("pushing a carried claim failed", app=claim.app)


@dataclass(slots=True)
class Finished:
    ok: bool
    attempt: int
    stored_ts: int
    recipient: str
    released: bool = False  # it let the next message of its ordering key go


@dataclass(slots=True)
class Failed:
    code: int  # 0 stale (not in flight), 1 retry scheduled, 2 dead, 3|4 expired
    attempt: int
    due: int
    recipient: str

    STALE = 0
    RETRY = 1
    DEAD = 2
    EXPIRED = 3  # its TTL ran out: dead-lettered, reason `expired`
    EXPIRED_DROPPED = 4  # its TTL ran out: dropped (EXPIRED=drop)


@dataclass(slots=True)
class Extended:
    code: int  # 0 not in flight (or another attempt), 1 extended, 2 limit reached
    extensions: int  # of this attempt, so far
    deadline: int  # the lease's end (unix ms)

    STALE = 0
    EXTENDED = 1
    LIMIT = 2


@dataclass(slots=True)
class Reaped:
    delivery_id: str
    result: Failed


@dataclass(slots=True)
class Tally:
    """What an app's `tally` hash counts: messages stored while it had no recipient and no
    consumer group, and registrations that took an id alive elsewhere over (the last
    one: {ts, id, from, to}, or None)."""

    unroutable: int
    takeovers: int
    last_takeover: dict[str, Any] | None


@dataclass(slots=True)
class AppCounts:
    pending: int
    delayed: int
    in_flight: int
    dead: int


@dataclass(slots=True)
class Waiting:
    """A message waiting (pending, delayed, waiting for a retry or behind its ordering
    key), as an operator's peek shows it (a topic copy: its message's msgid)."""

    msgid: str
    stored_ms: int
    attempts: int
    key: str | None  # its ordering key
    size: int  # of its content, bytes
    preview: bytes  # the first PREVIEW_BYTES of its content
    due_ms: int  # when it falls due (unix ms); 0: due now, -1: never


@dataclass(slots=True)
class Purged:
    """A message (or one recipient's copy of a topic message) an operator purged."""

    msgid: str
    kind: str  # queue | topic
    recipient: str | None  # a topic copy's


# How much of a waiting message's content a peek shows.
PREVIEW_BYTES = 64


@dataclass(slots=True)
class DeadLetter:
    appid: str
    delivery_id: str
    msgid: str
    kind: str
    recipient: str | None
    content: bytes
    attempts: int
    last_error: str
    history: list[str]
    died_at: int
    stored_at: int

    def as_json(self) -> dict[str, Any]:
        """Every field but the delivery id, in order; the content as text, or base64
        where it is not UTF-8 (`encoding`)."""
        out = asdict(self)
        del out["delivery_id"]
        out["content"], encoding = content_json(self.content)
        return {**out, "encoding": encoding}


@dataclass(frozen=True)
class Retries:
    """How failed attempts are retried (RETRY_TIMES, RETRY_BACKOFF, RETRY_JITTER): at most
    `times` attempts in all; after attempt n, a wait of `backoff[n - 1]` seconds (the last
    repeats), spread by up to +-`jitter` of itself."""

    times: int = 5
    backoff: Sequence[float] = (1.0,)
    jitter: float = 0.0

    def backoff_args(self) -> list[int]:
        """The waits as the scripts read them (lib.lua's backoff_args): count, then ms."""
        return [len(self.backoff), *(int(b * 1000) for b in self.backoff)]


class Store:
    def __init__(
        self,
        redis: RedisClient,
        prefix: str = "skmq",
        *,
        retries: Retries = Retries(),
        ack_timeout: float = 60.0,
        dedupe_window: float = 3600.0,
        replica_acks: int = 0,
        replica_ack_timeout: float = 1.0,
        expired_drop: bool = False,
        max_lease_extensions: int = 10,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.directory = AppDirectory(redis, prefix)
        self.replica_acks = replica_acks
        self.replica_ack_ms = max(1, int(replica_ack_timeout * 1000))
        self.retries = retries
        self.lease_ms = int(ack_timeout * 1000)
        self.dedupe_ms = max(1, int(dedupe_window * 1000))
        self.expired_drop = expired_drop
        self.max_lease_extensions = max_lease_extensions
        self._scripts: dict[str, AsyncScript] = {
            name: redis.register_script(scripts.source(name)) for name in scripts.KEYS
        }
        self._bases: dict[str, str] = {}
        self._lane = multiplexed(redis)

    def close(self) -> None:
        """Close the store's own connection (the client passed in is the caller's)."""
        if self._lane is not None:
            self._lane.close()

    # -- keys ---------------------------------------------------------------
    def base(self, app: str) -> str:
        base = self._bases.get(app)
        if base is None:
            base = self._bases[app] = f"{self.prefix}:{{{escape_tag(app)}}}:"
        return base

    def by_master(self, batches: dict[str, list[NewMessage]]) -> list[dict[str, list[NewMessage]]]:
        """`batches` split by the master that holds each app's keys (one Redis: as they
        are), to be stored and answered apart."""
        if len(batches) == 1 or not isinstance(self.redis, RedisCluster):
            return [batches]
        parts: dict[str, dict[str, list[NewMessage]]] = {}
        for app, messages in batches.items():
            try:
                name = str(master_of(self.redis, self.base(app)).name)
            except WriteFailed:  # (no master for its slot now: its store says so)
                name = ""
            parts.setdefault(name, {})[app] = messages
        return list(parts.values())

    def global_key(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    async def delivery_secret(self) -> bytes:
        """The key every broker on this store signs delivery tokens with (made once)."""
        key = self.global_key("delivery-secret")
        await self.redis.set(key, secrets.token_hex(32), nx=True)
        secret: bytes = await self.redis.get(key)
        return secret

    # -- scripts ------------------------------------------------------------
    def _keys(self, name: str, app: str, *extra: str) -> list[str]:
        """The keys script `name` declares for `app` (then `extra` keys of the app)."""
        base = self.base(app)
        return [base + key for key in (*scripts.KEYS[name], *extra)]

    async def _call(self, name: str, app: str, args: Sequence[Any], *extra_keys: str) -> Any:
        """Script `name` on `app`'s keys: on the store's own multiplexed connection
        (skmq/store/multiplex.py; a Redis without the script loads it, then the call is
        sent again), or else through redis-py (a cluster routes it by its keys)."""
        keys = self._keys(name, app, *extra_keys)
        script = self._scripts[name]
        if self._lane is None:
            return await script(keys, args)
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        [reply] = await self._lane.pipeline([command])
        if isinstance(reply, NoScriptError):
            await self.redis.script_load(script.script)
            [reply] = await self._lane.pipeline([command])
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def load_scripts(self) -> None:
        """Load every script at start-up: a Redis that refuses scripting fails now."""
        for script in self._scripts.values():
            await self.redis.script_load(script.script)

    async def note_broker(self, broker_id: str, info: dict[str, Any]) -> None:
        """Record that a broker is alive (for `skmq status`)."""
        await self.redis.hset(self.global_key("brokers"), broker_id, json.dumps(info))

    async def brokers(self) -> dict[str, dict[str, Any]]:
        raw = await self.redis.hgetall(self.global_key("brokers"))
        return {_s(k): json.loads(v) for k, v in raw.items()}

    async def take_turn(self, task: str, broker_id: str, ttl_ms: int) -> bool:
        """True for the one broker that does `task` this round (a lock that expires)."""
        key = self.global_key(f"{task}-lock")
        return bool(await self.redis.set(key, broker_id, nx=True, px=ttl_ms))

    async def add_apps(self, apps: Iterable[str]) -> None:
        await self.directory.add(apps)

    async def apps(self) -> list[str]:
        return await self.directory.members()

    async def unlist(self, apps: Sequence[str]) -> list[str]:
        """Take dropped apps out of the directory, then list again those that a store or a
        registration marked meanwhile; returns the apps gone."""
        if not apps:
            return []
        await self.directory.remove(apps)
        pipe = self.redis.pipeline(transaction=False)
        for app in apps:
            pipe.exists(self.base(app) + "listed")
        try:
            marked = await pipe.execute()
        except (RedisError, OSError):
            await self.directory.add(apps)  # not checked: listed again, forgotten later
            raise
        await self.directory.add(app for app, m in zip(apps, marked, strict=True) if m)
        gone = [app for app, m in zip(apps, marked, strict=True) if not m]
        for app in gone:
            self._bases.pop(app, None)
        return gone

    # -- recipients ---------------------------------------------------------
    async def register(
        self, app: str, rid: str, registration: dict[str, Any], now: int, most: int
    ) -> bool | str:
        """False when rid is new and the app has `most` recipients already (refused);
        else True, or the address (host:port) rid was alive at when this registration,
        at another address, took it over (counted in the app's tally: `tallies`)."""
        address = f"{registration.get('host', '')}:{registration.get('port', '')}"
        args = [rid, json.dumps(registration), now, most, address]
        answer = await self._call("register", app, args)
        if not answer:
            return False
        await self.directory.add([app])
        return True if answer == 1 else _s(answer)

    async def unregister(self, app: str, rid: str) -> bool:
        return bool(await self._call("unregister", app, [rid]))

    async def set_state(self, app: str, rid: str, alive: bool, now: int) -> int:
        """Returns the previous state (1 alive, 0 lost) or -1 if rid is not registered."""
        return int(await self._call("set_state", app, [rid, 1 if alive else 0, now]))

    async def recipients(self, apps: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
        """Every registered recipient of each app, with `alive` and `last_heartbeat`."""
        pipe = self.redis.pipeline(transaction=False)
        for app in apps:
            base = self.base(app)
            pipe.hgetall(base + "recipients")
            pipe.hgetall(base + "rstate")
            pipe.hgetall(base + "rbeat")
        res = await pipe.execute()
        out: dict[str, list[dict[str, Any]]] = {}
        for i, app in enumerate(apps):
            regs, states, beats = res[3 * i], res[3 * i + 1], res[3 * i + 2]
            found = []
            for rid_b, raw in regs.items():
                try:
                    rec = json.loads(raw)
                except ValueError:
                    rec = None
                if not isinstance(rec, dict):
                    rec = {"id": _s(rid_b), "unreadable": raw[:200].decode("utf-8", "replace")}
                rec["alive"] = states.get(rid_b, b"1") == b"1"
                rec["last_heartbeat"] = int(beats.get(rid_b, 0))
                found.append(rec)
            out[app] = sorted(found, key=lambda r: str(r.get("id", "")))
        return out

    async def routable(self, apps: Sequence[str], unroutable: Mapping[str, int]) -> set[str]:
        """The apps of `apps` with a recipient registered or a consumer group, in one round
        trip that also adds `unroutable` (messages stored for an app with neither, by app)
        to each app's tally."""
        pipe = self.redis.pipeline(transaction=False)
        for app, n in unroutable.items():
            pipe.hincrby(self.base(app) + "tally", "unroutable", n)
        for app in apps:
            pipe.hlen(self.base(app) + "recipients")
            pipe.hlen(self.base(app) + "groups")
        res = (await pipe.execute())[len(unroutable) :]
        return {app for i, app in enumerate(apps) if int(res[2 * i]) or int(res[2 * i + 1])}

    async def tallies(self, apps: Sequence[str]) -> dict[str, Tally]:
        """Each app's messages stored while unroutable, and its recipients' takeovers."""
        pipe = self.redis.pipeline(transaction=False)
        for app in apps:
            pipe.hmget(self.base(app) + "tally", "unroutable", "takeovers", "takeover")
        out = {}
        for app, (unroutable, takeovers, last) in zip(apps, await pipe.execute(), strict=True):
            try:
                taken = json.loads(last) if last else None
            except ValueError:
                taken = None
            out[app] = Tally(
                int(unroutable or 0),
                int(takeovers or 0),
                taken if isinstance(taken, dict) else None,
            )
        return out
