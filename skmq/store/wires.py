"""The owners' connections: one Wire to a single Redis, or on a Redis
Cluster one Wire to each master, chosen by the slot of a key (every key of an app's
queue shares the app's hash tag, so an app's writes all go to its master).

An owner binds its app to the Wire it was gained on (`of` at the acquire): its fenced
flushes go on that one connection to the master that holds the app, never to another
node. When that connection closes, or the slot map names another master (a failover),
the Wire no longer `serves` the app: the ownership round drops it and takes it again
through its master now, its state rebuilt from what that master holds (issue 42: one
master's trouble is only its own apps'). A broker keeps another Wires for its leases,
and Siblings for REPLICA_ACKS's WAITs, which hold their connection until the replicas
answer.

The slot map is the broker's redis-py cluster client's (its public `get_node_from_key`),
refreshed in the background after trouble (skmq/store/shards.py's SlotMap).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from urllib.parse import quote, urlsplit

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import RedisError

from skmq.store.client import RedisClient
from skmq.store.shards import SlotMap, WriteFailed, master_of
from skmq.store.wire import ReplyError, Wire, WireClosed, WireNotSent

# Error replies Redis gives before it runs a command: it did not run (a redirection, a
# cluster or a node not able to take writes now...)
REFUSALS = frozenset(("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "NOSCRIPT",
                      "READONLY", "OOM", "NOREPLICAS", "BUSY", "MISCONF", "LOADING"))  # fmt: skip
SINGLE = ""  # the address a single Redis's Wire is kept under
# What a call on a Wire may raise when its node is in trouble (Fenced is a RedisError)
TROUBLE = (RedisError, OSError, ReplyError, WireClosed, TimeoutError)


def refused_here(exc: BaseException) -> bool:
    """Whether `exc`, raised by a call on a Wire, says its command did not run."""
    if isinstance(exc, WireNotSent):
        return True
    return isinstance(exc, ReplyError) and exc.code in REFUSALS


class Wires:
    def __init__(
        self,
        url: str,
        timeout: float,
        cluster: RedisCluster | None = None,
        master: Callable[[], Awaitable[str]] | None = None,
    ) -> None:
        self.url = url
        self.timeout = timeout
        self.cluster = cluster
        # Through Sentinel: the URL of the master now, asked at each connection (the
        # one Redis's address changes with a failover; a demoted one's Wire closes).
        self.master = master
        self.slots = SlotMap(cluster) if cluster is not None else None
        self._open: dict[str, Wire] = {}
        self._connecting: dict[str, asyncio.Future[Wire]] = {}

    @classmethod
    def beside(cls, url: str, redis: RedisClient, timeout: float) -> Wires:
        """Wires to the Redis of `url`, whose redis-py client `redis` is (a Cluster's
        slot map, the master a Sentinel names)."""
        cluster = redis if isinstance(redis, RedisCluster) else None
        pool = None if cluster is not None else redis.connection_pool
        master = sentinel_master(pool) if isinstance(pool, SentinelConnectionPool) else None
        return cls(url, timeout, cluster, master)

    @classmethod
    def over(cls, wire: Wire, url: str = "", timeout: float = 2.0) -> Wires:
        """Wires over one Redis, its connection `wire` made (tools, tests)."""
        scheme = "unix" if wire.address.startswith("/") else "redis"
        wires = cls(url or f"{scheme}://{wire.address}", timeout)
        wires._open[SINGLE] = wire
        return wires

    def address_of(self, key: str) -> str:
        """The master holding `key` (`host:port`; SINGLE on one Redis). Raises WriteFailed
        (not run) when no master covers its slot."""
        if self.cluster is None:
            return SINGLE
        return str(master_of(self.cluster, key).name)

    def serves(self, wire: Wire, key: str) -> bool:
        """Whether `wire` is open and still the connection to the master of `key`."""
        if wire.closed:
            return False
        try:
            return self._open.get(self.address_of(key)) is wire
        except WriteFailed:  # (no master for the slot now)
            return False

    async def of(self, key: str) -> Wire:
        """The open Wire to the master of `key`, connected (again) if needed: one
        connection at a time to each address."""
        address = self.address_of(key)
        return await _shared(self._open, self._connecting, address, self._connect)

    async def any(self) -> Wire:
        """An open Wire to some node (a PUBLISH reaches every node of a cluster)."""
        for wire in self._open.values():
            if not wire.closed:
                return wire
        return await self.of("")

    async def _connect(self, address: str) -> Wire:
        try:
            wire = await Wire.connect(await self._url_of(address), self.timeout)
        except (OSError, TimeoutError, RedisError, ReplyError) as exc:
            self.refresh()
            raise WriteFailed(f"could not reach {address or self.url}: {exc!r}", False) from exc
        return wire

    async def _url_of(self, address: str) -> str:
        if address == SINGLE and self.master is not None:  # (asked again each time)
            async with asyncio.timeout(self.timeout):
                return await self.master()
        if address == SINGLE:
            return self.url
        userinfo, at, _ = urlsplit(self.url).netloc.rpartition("@")
        return f"redis://{userinfo}{at}{address}"

    def refresh(self) -> None:
        """Ask the cluster for its slot map again (in the background; none on one Redis)."""
        if self.slots is not None:
            self.slots.refresh()

    def close(self) -> None:
        for wire in self._open.values():
            wire.close()
        self._open.clear()


class Siblings:
    """A second connection to the very server each of some Wires is connected to, by the
    URL it was connected with: not to the master of a key now, which after a failover is
    another server (REPLICA_ACKS's WAIT must ask the server that stored)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._open: dict[str, Wire] = {}
        self._connecting: dict[str, asyncio.Future[Wire]] = {}

    async def of(self, wire: Wire) -> Wire:
        """The open sibling of `wire`, connected (again) if needed, one at a time."""
        return await _shared(self._open, self._connecting, wire.url, self._connect)

    async def _connect(self, url: str) -> Wire:
        return await Wire.connect(url, self.timeout)

    def close(self) -> None:
        for wire in self._open.values():
            wire.close()
        self._open.clear()


async def _shared(
    opened: dict[str, Wire],
    connecting: dict[str, asyncio.Future[Wire]],
    key: str,
    connect: Callable[[str], Awaitable[Wire]],
) -> Wire:
    """The open Wire under `key`, else one `connect(key)` makes: one connection at a time
    a key, its callers meanwhile waiting for the same, and kept once made even if they
    all stopped waiting."""
    wire = opened.get(key)
    if wire is not None and not wire.closed:
        return wire
    pending = connecting.get(key)
    if pending is None:
        pending = connecting[key] = asyncio.ensure_future(connect(key))

        def made(done: asyncio.Future[Wire]) -> None:
            connecting.pop(key, None)
            if not done.cancelled() and done.exception() is None:
                opened[key] = done.result()

        pending.add_done_callback(made)
    return await asyncio.shield(pending)


def sentinel_master(pool: SentinelConnectionPool) -> Callable[[], Awaitable[str]]:
    """The URL of the master the Sentinels name now, for a client of a
    `redis+sentinel://` REDIS_URL (its pool's credentials and db)."""

    async def url() -> str:
        host, port = await pool.get_master_address()
        options = pool.connection_kwargs
        user, password = options.get("username"), options.get("password")
        auth = f"{quote(str(user or ''), safe='')}:{quote(str(password), safe='')}@"
        return f"redis://{auth if password else ''}{host}:{port}/{int(options.get('db') or 0)}"

    return url
