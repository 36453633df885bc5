"""Store: the one owner of SKMQ's Redis keys; typed, batched calls of the Lua scripts
(one `.lua` file a transition, see `scripts.py`), one app per call.

Scripts are redis-py `Script`s (EVALSHA, loaded again after a NOSCRIPT). Several broker
processes can share one Redis (or one Redis Cluster: each script touches one app's keys,
which share a hash tag, so it runs on one node): every transition is one script, so each
delivery is in flight from one broker at most.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError

from skmq.clock import now_ms
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
from skmq.store.messages import header
from skmq.store.messages import read as read_message
from skmq.store.msgids import COMPACT, PACKED, pack_delivery, split_held, unpack
from skmq.store.msgids import SEP as HELD_SEP
from skmq.store.multiplex import multiplexed
from skmq.store.shards import (
    ReplicasMissing,
    SlotMap,
    WriteFailed,
    master_of,
    stale_map,
    write_by_node,
)

log = structlog.get_logger("skmq.store")

SEP = "\x1f"
# A command's arguments and redis-py's options for it (a cluster's `target_nodes`).
Routed = tuple[tuple[Any, ...], dict[str, Any]]


def split_delivery(delivery_id: str) -> tuple[str, str | None]:
    """`msgid` -> (msgid, None); `msgid \\x1f rid` (a topic copy) -> (msgid, rid)."""
    msgid, sep, rid = delivery_id.partition(SEP)
    return (msgid, rid) if sep else (msgid, None)


def state_field(held_id: bytes, attr: str) -> bytes:
    """lib.lua's field(): the `state` field of `attr` of a delivery id as Redis holds it
    (its msgid's own field, or its topic copy's)."""
    msgid, copy = split_held(held_id)
    return msgid + HELD_SEP + attr.encode() + copy


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


_KINDS = {b"q": "queue", b"t": "topic", b"d": "dead", b"x": "expired"}


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
    """A claim to run in a store's round trip (`Store.store(claims=...)`)."""

    app: str
    args: list[Any]  # Store.claim_args
    done: Callable[[ClaimResult | BaseException], None]


def _hand_over(claim: ClaimArgs, reply: Any) -> None:
    """A carried claim's reply to its dispatcher (`hand_over`)."""
    result: ClaimResult | BaseException
    try:
        result = reply if isinstance(reply, Exception) else Store.parse_claim(reply)
    except Exception as exc:  # the dispatcher claims again itself
        result = exc
    hand_over(claim, result)


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
        """Every field but the delivery id, in order; the content as text."""
        out = asdict(self)
        del out["delivery_id"]
        out["content"] = self.content.decode("utf-8", "replace")
        return out


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
        ack_linger: float = 0.0,
        lost_wait: float = 10.0,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.directory = AppDirectory(redis, prefix)
        self.replica_acks = replica_acks
        self.replica_ack_ms = max(1, int(replica_ack_timeout * 1000))
        self.retries = retries
        self.lease_ms = int(ack_timeout * 1000)
        # How long a topic copy of a lost recipient waits before a claim looks at it again.
        self.lost_wait_ms = max(1, int(lost_wait * 1000))
        self.dedupe_ms = max(1, int(dedupe_window * 1000))
        self.expired_drop = expired_drop
        self.max_lease_extensions = max_lease_extensions
        self._scripts: dict[str, AsyncScript] = {
            name: redis.register_script(scripts.source(name)) for name in scripts.KEYS
        }
        self._bases: dict[str, str] = {}
        self._lane = multiplexed(redis)
        self._slots = SlotMap(redis) if isinstance(redis, RedisCluster) else None
        self.ack_linger = ack_linger
        self._format: bytes | None = None  # the store's format, once read

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

    # -- msgids (skmq/store/msgids.py) -------------------------------------
    async def store_format(self) -> bytes:
        """How this store holds msgids and message headers: `text` (both text), `packed`
        (msgids packed, headers text: a store the broker of the version before made) or
        `compact` (both packed: skmq/store/msgids.py, skmq/store/messages.py). Chosen once
        a store, by whichever client meets it first: `compact` if no broker ran on it
        before (none made the delivery secret) and it lists no app; else `text`, since
        text msgids may be in it, in a dedupe set or a group log that outlive their
        app's listing. Held in the global key `<prefix>:msgids`."""
        if self._format is None:
            key = self.global_key("msgids")
            held = await self.redis.get(key)
            if held is None:
                # (one key an EXISTS: in a cluster they live in different slots)
                earlier = [self.global_key(k) for k in ("delivery-secret", "apps")]
                new = not await self.apps() and not any(
                    [await self.redis.exists(k) for k in earlier]
                )
                await self.redis.set(key, COMPACT if new else b"text", nx=True)
                held = await self.redis.get(key)
            self._format = held
        return self._format

    async def packs_msgids(self) -> bool:
        return await self.store_format() in (PACKED, COMPACT)

    async def _holder(self) -> Callable[[str], bytes | str]:
        """How this store holds a msgid or a delivery id."""
        return pack_delivery if await self.packs_msgids() else str

    async def _headers(self, now: int) -> dict[str, bytes]:
        """The headers of a queue and of a topic message stored at `now`, in this store's
        form (skmq/store/messages.py)."""
        compact = await self.store_format() == COMPACT
        return {kind: header(kind, now, compact) for kind in ("queue", "topic")}

    async def _held(self, delivery_ids: Iterable[str]) -> list[bytes | str]:
        """Msgids or delivery ids as this store holds them."""
        return list(map(await self._holder(), delivery_ids))

    async def _held_rows(self, rows: Iterable[Sequence[Any]]) -> list[Any]:
        """Rows (a delivery id, then its arguments) as one flat list of a script's
        arguments, each delivery id as this store holds it."""
        hold = await self._holder()
        return [x for delivery_id, *rest in rows for x in (hold(delivery_id), *rest)]

    # -- scripts ------------------------------------------------------------
    def _keys(self, name: str, app: str, *extra: str) -> list[str]:
        """The keys script `name` declares for `app` (then `extra` keys of the app)."""
        base = self.base(app)
        return [base + key for key in (*scripts.KEYS[name], *extra)]

    async def _call(
        self, name: str, app: str, args: Sequence[Any], *extra_keys: str, linger: float = 0.0
    ) -> Any:
        if self._lane is None:
            return await self._scripts[name](self._keys(name, app, *extra_keys), args)
        [reply] = await self._call_each(name, [(app, args, extra_keys)], linger=linger)
        return reply

    async def _call_each(
        self,
        name: str,
        calls: Sequence[tuple[str, Sequence[Any], tuple[str, ...]]],
        replicas: int = 0,
        riders: Sequence[tuple[str, str, Sequence[Any]]] = (),
        linger: float = 0.0,
    ) -> list[Any]:
        """Script `name` once per (app, args, extra keys), pipelined in one round trip (a
        cluster pipeline sends each node its calls). With `replicas` (one Redis only: a
        cluster's stores go by master, skmq/store/shards.py), WAIT then runs on the
        connection that ran the scripts (how many replicas have the writes, waiting up
        to REPLICA_ACK_TIMEOUT for `replicas`): its answer follows the scripts' in the
        list returned. `riders`, (script, app, args) calls that ride last in the same
        round trip (a carried claim), answer last; an error of theirs is returned in its
        place, never raised. `linger`: how long the round
        trip may wait for another caller's write to ride on (the store's own connection
        only: skmq/store/multiplex.py)."""
        names = {name, *(rider for rider, _, _ in riders)}
        script = self._scripts[name]
        commands: list[Routed] = []
        for app, args, extra in calls:
            keys = self._keys(name, app, *extra)
            commands.append((("EVALSHA", script.sha, len(keys), *keys, *args), {}))
        if replicas:
            assert not isinstance(self.redis, RedisCluster)
            commands.append((("WAIT", replicas, self.replica_ack_ms), {}))
        for rider, app, args in riders:
            keys = self._keys(rider, app)
            commands.append((("EVALSHA", self._scripts[rider].sha, len(keys), *keys, *args), {}))
        results = await self._round_trip(commands, linger)
        # A Redis (or a cluster node) without the scripts: load them, then send again only
        # the calls it refused (and the WAITs), never one that ran (its messages would
        # come back as duplicates, a claim's deliveries stay leased to no one).
        again = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if again:
            for n in names:
                await self.redis.script_load(self._scripts[n].script)
            again = sorted([*again, *(i for i, (a, _) in enumerate(commands) if a[0] == "WAIT")])
            redone = await self._round_trip([commands[i] for i in again])
            for i, r in zip(again, redone, strict=True):
                results[i] = r
        own = results[: len(results) - len(riders)]
        error = next((r for r in own if isinstance(r, Exception)), None)
        if error is not None:
            raise error
        return results

    async def _round_trip(self, commands: list[Routed], linger: float = 0.0) -> list[Any]:
        """The replies of `commands` (each its arguments and redis-py's options), sent in
        one round trip, an error reply in its place: on the store's own multiplexed
        connection (skmq/store/multiplex.py), or else in a redis-py pipeline (a cluster
        pipeline sends each node its calls)."""
        if self._lane is not None:
            return await self._lane.pipeline([args for args, _ in commands], linger)
        pipe = self.redis.pipeline(transaction=False)
        for args, options in commands:
            # (not pipe.evalsha: a cluster pipeline refuses the method, not the command)
            pipe.execute_command(*args, **options)
        results: list[Any] = await pipe.execute(raise_on_error=False)
        return results

    async def load_scripts(self) -> None:
        """Load every script at start-up: a Redis that refuses scripting fails now. The
        msgid format is read (or chosen) now too, before any recipient lists an app."""
        for script in self._scripts.values():
            await self.redis.script_load(script.script)
        await self.store_format()

    def _done(self, bucket: int) -> str:
        return f"done:{bucket}"

    def _bucket(self, now: int) -> int:
        return now // self.dedupe_ms

    def _dedupe_keys(self, now: int) -> tuple[str, str]:
        """The dedupe sets of the current and the previous DEDUPE_WINDOW."""
        bucket = self._bucket(now)
        return self._done(bucket), self._done(bucket - 1)

    # -- producers ----------------------------------------------------------
    @property
    def carries_claims(self) -> bool:
        """Whether a store's round trip can carry claims (`store(claims=...)`): one Redis,
        no REPLICA_ACKS wait (a cluster splits the pipeline by node)."""
        return not self.replica_acks and not isinstance(self.redis, RedisCluster)

    async def store(
        self,
        batches: dict[str, list[NewMessage]],
        now: int,
        stored: Callable[[dict[str, list[bool]]], None] | None = None,
        claims: Sequence[ClaimArgs] = (),
        deadline: float | None = None,
    ) -> dict[str, AppStored]:
        """Store the messages of several apps in one round trip; True stored, False duplicate.
        `stored` hears the results of the apps whose scripts ran as soon as they did,
        before anything else is awaited: from then on a dispatcher may push them, so what
        must come first (the delivery log's `stored` lines) goes there.

        On one Redis the batch is acknowledged or raises as a whole (ReplicasMissing when
        fewer than REPLICA_ACKS replicas acknowledged it). On a Redis Cluster each
        master's apps are stored apart (skmq/store/shards.py): an app whose master fails,
        or has fewer than REPLICA_ACKS replicas acknowledging, gets a WriteFailed in
        place of its results, the other apps are acknowledged.

        `claims` (only where `carries_claims`) ride in the same round trip, each run
        after the stores: each hears its result (or the error) with `ClaimArgs.done`,
        after `stored`; a claim that fails never fails the store. `deadline` (the event
        loop's time) bounds the call (TimeoutError; on a cluster, the masters not done by
        then fail their apps, as lost after the write)."""
        try:
            async with asyncio.timeout_at(deadline):
                calls = await self._store_calls(batches, now)
                if isinstance(self.redis, RedisCluster):
                    await self.redis.initialize()  # (a no-op once the slot map is known)
        except BaseException as exc:
            for c in claims:
                c.done(exc)
            raise
        if isinstance(self.redis, RedisCluster):
            return await self._store_by_master(batches, calls, stored, deadline)
        async with asyncio.timeout_at(deadline):
            return await self._store_at_once(batches, calls, stored, claims)

    async def _store_calls(
        self, batches: dict[str, list[NewMessage]], now: int
    ) -> list[tuple[str, Sequence[Any], tuple[str, ...]]]:
        """The store script's calls (app, args, extra keys) of `batches`."""
        done = self._dedupe_keys(now)
        hold = await self._holder()
        headers = await self._headers(now)
        calls: list[tuple[str, Sequence[Any], tuple[str, ...]]] = []
        for app, messages in batches.items():
            args: list[Any] = [now]
            for m in messages:
                h = headers[m.kind]
                args += (hold(m.msgid), h, m.content, m.deliver_at, m.expires_at, m.key, m.trace)
            calls.append((app, args, done))
        return calls

    async def _store_at_once(
        self,
        batches: dict[str, list[NewMessage]],
        calls: list[tuple[str, Sequence[Any], tuple[str, ...]]],
        stored: Callable[[dict[str, list[bool]]], None] | None,
        claims: Sequence[ClaimArgs],
    ) -> dict[str, AppStored]:
        """`store` on one Redis: one round trip, acknowledged or raising as a whole."""
        riders = [("claim", c.app, c.args) for c in claims]
        try:
            replies = await self._call_each("store", calls, self.replica_acks, riders)
        except BaseException as exc:
            for c in claims:
                c.done(exc)
            raise
        own = len(replies) - len(riders)
        results, acked, claimed = replies[: len(calls)], replies[len(calls) : own], replies[own:]
        try:
            outcome = {
                app: [bool(x) for x in res[1:]] for app, res in zip(batches, results, strict=True)
            }
            if stored is not None:
                stored(outcome)
        finally:  # every claim hears its end, whatever happens here
            for c, res in zip(claims, claimed, strict=True):
                _hand_over(c, res)
        # A new `listed` mark, or a duplicate (perhaps the retry of a store whose broker
        # died before listing the app): list the app (skmq/store/directory.py). Even if
        # too few replicas acknowledged: the messages are stored on their masters.
        await self.directory.add(
            app for app, res in zip(batches, results, strict=True) if res[0] or 0 in res[1:]
        )
        if any(int(n) < self.replica_acks for n in acked):
            raise ReplicasMissing(f"{min(acked)} of {self.replica_acks} replicas acknowledged")
        return dict(outcome)

    async def _store_by_master(
        self,
        batches: dict[str, list[NewMessage]],
        calls: list[tuple[str, Sequence[Any], tuple[str, ...]]],
        stored: Callable[[dict[str, list[bool]]], None] | None,
        deadline: float | None,
    ) -> dict[str, AppStored]:
        """`store` on a Redis Cluster: one pipeline a master, each app's answer its own
        (skmq/store/shards.py). An app that is stored and must be listed in the apps
        directory (`_store_at_once`), whose listing fails, is not acknowledged either: it
        may be stored (sent again, the duplicate lists it)."""
        assert isinstance(self.redis, RedisCluster)
        sha = self._scripts["store"].sha
        commands = []
        for app, args, extra in calls:
            keys = self._keys("store", app, *extra)
            # (routed by the app's `listed` mark, which store.lua has just set to 1: a
            # `SET mark 1 XX` before the WAIT changes nothing, see write_by_node)
            commands.append((self.base(app) + "listed", ("EVALSHA", sha, len(keys), *keys, *args)))
        source = [self._scripts["store"].script]
        replies = await write_by_node(
            self.redis, commands, source, self.replica_acks, self.replica_ack_ms, deadline,
            touch=lambda mark: ("SET", mark, 1, "XX"),
        )  # fmt: skip
        answers: dict[str, AppStored] = {}
        ran: dict[str, list[Any]] = {}  # the replies of the calls that ran
        for app, reply in zip(batches, replies, strict=True):
            if isinstance(reply, WriteFailed):
                answers[app] = reply
                if isinstance(reply, ReplicasMissing):
                    ran[app] = reply.reply
            else:
                ran[app] = reply
        outcome = {app: [bool(x) for x in res[1:]] for app, res in ran.items()}
        if stored is not None and outcome:
            stored(outcome)
        shards = self.directory.by_shard(app for app, r in ran.items() if r[0] or 0 in r[1:])
        added = await write_by_node(
            self.redis, [(key, ("SADD", key, *apps)) for key, apps in shards.items()], [],
            deadline=deadline,
        )  # fmt: skip
        if self._slots is not None and any(map(stale_map, [*replies, *added])):
            self._slots.refresh()
        for apps, reply in zip(shards.values(), added, strict=True):
            if isinstance(reply, WriteFailed):
                for app in apps:
                    answers.setdefault(app, WriteFailed(f"stored, not listed: {reply}", True))
        for app, results in outcome.items():
            answers.setdefault(app, results)
        return {app: answers[app] for app in batches}

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

    async def adopt_legacy_apps(self) -> None:
        """List in the directory the apps of a store written before it was sharded (one
        set, `<prefix>:apps`), then drop that set."""
        legacy = self.global_key("apps")
        members = await self.redis.smembers(legacy)
        if members:
            await self.directory.add(_s(m) for m in members)
            await self.redis.delete(legacy)

    async def forget_apps(self, apps: Sequence[str]) -> list[str]:
        """Forget each app that holds no recipient and no message; returns those forgotten
        (skmq/store/directory.py: why this is safe against a store at the same time)."""
        return await self.unlist(await self.drop_empty(apps))

    async def drop_empty(self, apps: Sequence[str]) -> list[str]:
        """Drop the leftovers and `listed` mark of each app holding nothing (one script an
        app); returns those dropped, still to be taken out of the directory (`unlist`)."""
        if not apps:
            return []
        results = await self._call_each("forget", [(app, [], ()) for app in apps])
        return [app for app, res in zip(apps, results, strict=True) if res]

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

    # -- dispatch -----------------------------------------------------------
    async def claim(
        self,
        app: str,
        now: int,
        n: int,
        alive: Sequence[AliveRecipient],
        assignment: Sequence[str],
        rate: float = 0.0,
        lost: Sequence[str] = (),
    ) -> ClaimResult:
        """Take up to n deliveries in flight; queue ones go to `assignment` in order, topic
        copies only to recipients with free slots (the others wait; those of a `lost`
        recipient wait LOST_WAIT, without spending an attempt, and again until it is back).

        Returns them (kind `dead` for one dead-lettered as undeliverable, its content the
        reason; kind `expired` for one whose TTL ran out, its content `dead` or `drop`),
        when the next delayed one falls due (unix ms), and how long the app's
        DELIVERY_RATE bucket needs before the next push (seconds, 0: not limited)."""
        args = self.claim_args(now, n, alive, assignment, rate, lost)
        res = await self._call("claim", app, args)
        return self.parse_claim(res)

    def claim_args(
        self,
        now: int,
        n: int,
        alive: Sequence[AliveRecipient],
        assignment: Sequence[str],
        rate: float = 0.0,
        lost: Sequence[str] = (),
    ) -> list[Any]:
        """The arguments of `claim` (lua/claim.lua); `lost`: the app's recipients that are
        registered and lost, whose topic copies wait for them."""
        drop = 1 if self.expired_drop else 0
        args: list[Any] = [now, self.lease_ms, n, len(alive), rate, drop]
        args += (self.lost_wait_ms, len(lost))
        for r in alive:
            args += (r.rid, r.free, 1 if r.takes_length else 0)
        args += lost
        args += assignment
        return args

    @staticmethod
    def parse_claim(res: list[Any]) -> ClaimResult:
        # (a score Redis holds as inf, the due time of a message stored before delays
        # were bounded, means never: not a time to wait for)
        nxt = float(res[-2])
        out = []
        for i in range(0, len(res) - 2, 7):
            did = unpack(res[i])
            msgid, _ = split_delivery(did)
            kind = _KINDS[res[i + 1]]
            attempt, rid, stored = int(res[i + 3]), _s(res[i + 4]), int(res[i + 5])
            out.append(Claimed(did, msgid, kind, res[i + 2], attempt, rid, stored, _s(res[i + 6])))
        return out, (int(nxt) if 0 <= nxt < math.inf else None), int(res[-1]) / 1000

    async def finish(self, app: str, acks: Sequence[tuple[str, int]], now: int) -> list[Finished]:
        """acks: (delivery id, attempt or 0 for whichever is current). The call may wait
        up to ACK_LINGER to ride on another's write (skmq/store/multiplex.py)."""
        args = [now, 2 * self.dedupe_ms, *await self._held_rows(acks)]
        res = await self._call(
            "finish", app, args, self._done(self._bucket(now)), linger=self.ack_linger
        )
        return [
            Finished(
                bool(res[i]), int(res[i + 1]), int(res[i + 2]), _s(res[i + 3]), bool(res[i + 4])
            )
            for i in range(0, len(res), 5)
        ]

    async def extend(self, app: str, leases: Sequence[tuple[str, int]], now: int) -> list[Extended]:
        """leases: (delivery id, attempt or 0 for the current); each in flight gets a lease
        of ACK_TIMEOUT from now, at most MAX_LEASE_EXTENSIONS times an attempt."""
        args = [now, self.lease_ms, self.max_lease_extensions, *await self._held_rows(leases)]
        res = await self._call("extend", app, args)
        return [
            Extended(int(res[i]), int(res[i + 1]), int(res[i + 2])) for i in range(0, len(res), 3)
        ]

    def _retry_args(self) -> list[Any]:
        drop = 1 if self.expired_drop else 0
        spread = random.random()  # spreads retry waits: no secret
        return [self.retries.times, drop, self.retries.jitter, spread, *self.retries.backoff_args()]

    async def fail(
        self, app: str, failures: Sequence[tuple[str, str, str, str, int]], now: int
    ) -> list[Failed]:
        """failures: (delivery id, outcome, detail, recipient, attempt or 0 for the current)."""
        args = [now, 0, *self._retry_args(), *await self._held_rows(failures)]
        res = await self._call("fail", app, args)
        return [
            Failed(int(res[i]), int(res[i + 1]), int(res[i + 2]), _s(res[i + 3]))
            for i in range(0, len(res), 4)
        ]

    async def reap(
        self, apps: Sequence[str], now: int, limit: int = 500
    ) -> dict[str, list[Reaped]]:
        """Expired leases of several apps, in one round trip (one script call an app)."""
        if not apps:
            return {}
        args = [now, limit, *self._retry_args()]
        results = await self._call_each("reap", [(app, args, ()) for app in apps])
        return {
            app: [
                Reaped(
                    unpack(res[i]),
                    Failed(int(res[i + 1]), int(res[i + 2]), int(res[i + 3]), _s(res[i + 4])),
                )
                for i in range(0, len(res), 5)
            ]
            for app, res in zip(apps, results, strict=True)
        }

    async def in_flight(self, app: str) -> list[str]:
        return [unpack(x) for x in await self.redis.zrange(self.base(app) + "inflight", 0, -1)]

    async def release(self, app: str, deliveries: Sequence[tuple[str, int]]) -> list[bool]:
        """deliveries: (delivery id, attempt, or 0 for whichever: a dead process's) each
        handed back in flight -> pending, no attempt spent."""
        if not deliveries:
            return []
        args = await self._held_rows(deliveries)
        return [bool(x) for x in await self._call("release", app, args)]

    async def in_flight_of(self, app: str, msgid: str) -> list[tuple[str, str, int]]:
        """The deliveries of msgid in flight: (delivery id, recipient, attempt)."""
        res = await self._call("in_flight_of", app, await self._held([msgid]))
        return [(unpack(res[i]), _s(res[i + 1]), int(res[i + 2])) for i in range(0, len(res), 3)]

    async def stored_of(self, app: str, msgids: Sequence[str], now: int) -> list[int | None]:
        """For messages whose store's answer was lost: each one's stored ms, 0 when it was
        stored and has completed since (within DEDUPE_WINDOW), None when not stored."""
        done = self._dedupe_keys(now)
        found = await self._call("stored_of", app, [now, *await self._held(msgids)], *done)
        return [None if f == 0 else max(0, int(f)) for f in found]

    async def acked_of(self, app: str, delivery_ids: Sequence[str], now: int) -> list[bool]:
        """For deliveries whose finish's answer was lost: whether each was acked."""
        done = self._dedupe_keys(now)
        found = await self._call("settled_of", app, await self._held(delivery_ids), *done)
        return [bool(f) for f in found]

    async def find_apps(self, msgids: Sequence[str]) -> dict[str, list[str]]:
        """The apps holding each msgid, for answers that name no appid (the original's
        `ack`): one script call an app, however many msgids."""
        apps = await self.apps()
        found: dict[str, list[str]] = {msgid: [] for msgid in msgids}
        if not apps or not msgids:
            return found
        held = await self._held(msgids)
        replies = await self._call_each("holding", [(app, held, ()) for app in apps])
        for app, holds in zip(apps, replies, strict=True):
            for msgid, h in zip(msgids, holds, strict=True):
                if h:
                    found[msgid].append(app)
        return found

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

    # -- operators ----------------------------------------------------------
    async def counts(self, apps: Sequence[str], now: int) -> dict[str, AppCounts]:
        pipe = self.redis.pipeline(transaction=False)
        for app in apps:
            base = self.base(app)
            pipe.llen(base + "ready")
            pipe.zcount(base + "delayed", "-inf", now)
            pipe.zcount(base + "delayed", f"({now}", "+inf")
            pipe.zcard(base + "inflight")
            pipe.zcard(base + "dead")
        res = await pipe.execute()
        return {
            app: AppCounts(
                pending=int(res[5 * i]) + int(res[5 * i + 1]),
                delayed=int(res[5 * i + 2]),
                in_flight=int(res[5 * i + 3]),
                dead=int(res[5 * i + 4]),
            )
            for i, app in enumerate(apps)
        }

    async def oldest_pending(self, apps: Sequence[str], now: int) -> dict[str, int | None]:
        """When each app's oldest pending message was stored (unix ms; None: none pending),
        read at the heads of its queues (lua/oldest_pending.lua): one round trip."""
        if not apps:
            return {}
        found = await self._call_each("oldest_pending", [(app, [now], ()) for app in apps])
        return {app: int(f) if int(f) >= 0 else None for app, f in zip(apps, found, strict=True)}

    async def peek(self, app: str, limit: int, now: int) -> list[Waiting]:
        """Up to `limit` messages waiting, oldest stored first (lua/lib.lua's `waiting`:
        read at the heads of the queues); nothing changes."""
        res = await self._call("peek", app, [now, limit, PREVIEW_BYTES])
        return [
            Waiting(
                msgid=split_delivery(unpack(res[i]))[0],
                stored_ms=int(res[i + 1]),
                attempts=int(res[i + 2]),
                key=_s(res[i + 3]) or None,
                size=int(res[i + 4]),
                preview=res[i + 5],
                due_ms=int(res[i + 6]),
            )
            for i in range(0, len(res), 7)
        ]

    async def purge_waiting(
        self, app: str, older_than_ms: int | None, limit: int | None, dry_run: bool, now: int
    ) -> list[Purged]:
        """Purge up to `limit` (None: all) messages waiting, oldest first, those stored
        `older_than_ms` ago or more (None: any), in one script (lua/purge_waiting.lua);
        in flight and dead ones stay. Returns those purged (on a dry run: that would be)."""
        cutoff = -1 if older_than_ms is None else now - older_than_ms
        args = [now, limit or 0, cutoff, 1 if dry_run else 0]
        res = await self._call("purge_waiting", app, args)
        out = []
        for i in range(0, len(res), 2):
            msgid, rid = split_delivery(unpack(res[i]))
            out.append(Purged(msgid, _KINDS[res[i + 1]], rid))
        return out

    async def dead_letters(self, app: str, limit: int | None = None) -> list[DeadLetter]:
        base = self.base(app)
        stop = -1 if limit is None else limit - 1
        entries = cast(
            list[tuple[bytes, float]],
            await self.redis.zrange(base + "dead", 0, stop, withscores=True),
        )
        pipe = self.redis.pipeline(transaction=False)
        for member, _ in entries:
            pipe.hget(base + "msgs", split_held(member)[0])
            pipe.hmget(base + "state", *(state_field(member, a) for a in "nehr"))
        res = await pipe.execute()
        out = []
        now = now_ms()
        for i, (member, died) in enumerate(entries):
            kind, stored, content = read_message(res[2 * i] or b"q0000000000000", now)
            n, last_error, history_b, last_rid = res[2 * i + 1]
            did = unpack(member)
            msgid, rid = split_delivery(did)
            history = _s(history_b or b"")
            out.append(
                DeadLetter(
                    appid=app,
                    delivery_id=did,
                    msgid=msgid,
                    kind=kind,
                    recipient=rid if rid is not None else _s(last_rid or b"") or None,
                    content=content,
                    attempts=int(n or 0),
                    last_error=_s(last_error or b""),
                    history=history.split("\n") if history else [],
                    died_at=int(died),
                    stored_at=stored,
                )
            )
        return out

    async def replay(self, app: str, delivery_ids: Sequence[str], now: int) -> list[bool]:
        if not delivery_ids:
            return []
        ids = await self._held(delivery_ids)
        return [bool(x) for x in await self._call("replay", app, [now, *ids])]

    async def move(self, app: str, to_app: str, delivery_ids: Sequence[str], now: int) -> list[int]:
        """Dead letters of `app` become new messages of `to_app` (same msgid, pending),
        purged from `app`, in one script: 1 moved, 0 not dead, -1 a duplicate there."""
        if not delivery_ids:
            return []
        to, bucket = self.base(to_app), self._bucket(now)
        target = (to + "msgs", to + "ready", to + "listed")
        done = (to + self._done(bucket), to + self._done(bucket - 1))
        keys = [*self._keys("move", app), *target, *done]
        headers = await self._headers(now)
        args = [now, to_app, headers["queue"], headers["topic"], *await self._held(delivery_ids)]
        res = [int(x) for x in await self._scripts["move"](keys, args)]
        if 1 in res:
            await self.directory.add([to_app])
        return res

    async def purge(self, app: str, delivery_ids: Sequence[str]) -> list[bool]:
        if not delivery_ids:
            return []
        ids = await self._held(delivery_ids)
        return [bool(x) for x in await self._call("purge", app, ids)]
