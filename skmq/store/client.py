"""The Redis client types the store works with, and the Redis Cluster connection.

`redis+cluster://[:password@]host1:port1,host2:port2,...` names some nodes of a cluster
(seed nodes, in the style of `redis+sentinel://`): redis-py's RedisCluster asks them for
the slot map, then routes each command by its keys and follows MOVED/ASK redirections and
failovers (it asks for the slot map again)."""

from __future__ import annotations

import functools
from contextvars import ContextVar
from typing import Any, TypeAlias
from urllib.parse import unquote, urlsplit

import hiredis
import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import DataError, RedisClusterException, RedisError

log = structlog.get_logger("skmq.store")

RedisClient: TypeAlias = aioredis.Redis | RedisCluster

CLUSTER_SCHEME = "redis+cluster"
ENC = "surrogateescape"  # keys and members are bytes; any byte an app id holds survives


def text(value: bytes | str) -> str:
    return value.decode("utf-8", ENC) if isinstance(value, bytes) else value


def hiredis_pack(args: tuple[Any, ...]) -> bytes:
    """One command in RESP, packed by hiredis (C). A str that UTF-8 cannot encode (an
    app id of raw bytes) is encoded as the pool's `encoding_errors` would, with ENC."""
    try:
        packed: bytes = hiredis.pack_command(args)
    except UnicodeEncodeError:
        encoded = tuple(a.encode("utf-8", ENC) if isinstance(a, str) else a for a in args)
        packed = hiredis.pack_command(encoded)  # type: ignore[arg-type]
    return packed


class _HiredisPacking(AbstractConnection):  # type: ignore[misc]
    """Commands packed by hiredis (C) instead of redis-py's asyncio connection, which
    encodes and joins every argument in Python: about 10% of the broker's CPU in issue
    19's profile (redis-py's sync client packs with hiredis already)."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if isinstance(args[0], str):  # "CONFIG GET" and the like: words sent apart
            args = (*args[0].encode().split(), *args[1:])
        elif b" " in args[0]:
            args = (*args[0].split(), *args[1:])
        try:
            return [hiredis_pack(args)]
        except TypeError as exc:  # as redis-py's Encoder says it
            raise DataError(str(exc)) from exc


@functools.cache
def hiredis_packing(connection_class: type[AbstractConnection]) -> type[AbstractConnection]:
    """`connection_class` (plain, TLS, unix socket, Sentinel-managed) packing with hiredis."""
    return type(connection_class.__name__, (_HiredisPacking, connection_class), {})


def subscriber(redis: RedisClient, turn: int) -> tuple[Any, str]:
    """A pub/sub connection, and the node it is on (`host:port`; "" for one Redis). On a
    Cluster a PUBLISH reaches every node, so any master hears them all: the masters are
    taken in turn, `turn` counting the subscriptions made, so that one down does not
    silence every later subscription (redis-py would pick the node of the pattern's slot
    each time, perhaps a master left down)."""
    if isinstance(redis, RedisCluster):
        masters = redis.get_primaries()
        if masters:
            node = masters[turn % len(masters)]
            return redis.pubsub(node=node), str(node.name)
    return redis.pubsub(), ""


def url_hosts(url: str, default_port: int) -> list[tuple[str, int]]:
    """The `host:port` list of a `redis+sentinel://` or `redis+cluster://` URL."""
    hosts = []
    for part in urlsplit(url).netloc.rpartition("@")[2].split(","):
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or "]" in port or not (port.isascii() and port.isdigit()):
            host, port = part, ""
        hosts.append((host.strip("[]") or "localhost", int(port) if port else default_port))
    return hosts


class ClusterUnavailable(RedisError):  # type: ignore[misc]
    """A cluster error raised by the client itself (a slot no node covers during a
    failover, no node reachable), as a RedisError: what every caller of the store
    handles as "store unavailable"."""


# A command that times out or loses its node makes redis-py's RedisCluster close every
# node's connections, those other commands are running on too: one of those then fails
# inside redis-py writing to a connection gone under it, as an AttributeError (its writer
# None) or a RuntimeError (uvloop: the transport closed). Seen by an outside check with
# a master stalled (SIGSTOP) 10 s under load: tracebacks, and the dispatchers restarted.
_TORN = (AttributeError, RuntimeError)


def _unavailable(exc: Exception) -> ClusterUnavailable:
    if isinstance(exc, RedisClusterException):
        return ClusterUnavailable(str(exc))
    return ClusterUnavailable(f"connection closed under the command: {exc!r}")


# Set while a command (or a pipeline) of the client runs: a `Cluster.aclose` then is
# redis-py's retry, not the client's owner closing it.
_RUNNING: ContextVar[bool] = ContextVar("skmq_cluster_running", default=False)


class _Pipeline(ClusterPipeline):  # type: ignore[misc]
    async def execute(self, *args: Any, **kwargs: Any) -> list[Any]:
        running = _RUNNING.set(True)
        try:
            return await super().execute(*args, **kwargs)  # type: ignore[no-any-return]
        except (RedisClusterException, *_TORN) as exc:
            raise _unavailable(exc) from exc
        finally:
            _RUNNING.reset(running)


class Cluster(RedisCluster):  # type: ignore[misc]
    """RedisCluster whose client-side cluster errors, and those of a connection closed
    under a command, are RedisErrors too; whose retries do not close every connection."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        running = _RUNNING.set(True)
        try:
            return await super().execute_command(*args, **kwargs)
        except (RedisClusterException, *_TORN) as exc:
            raise _unavailable(exc) from exc
        finally:
            _RUNNING.reset(running)

    async def initialize(self, *args: Any, **kwargs: Any) -> Cluster:
        try:
            await super().initialize(*args, **kwargs)
        except (RedisClusterException, *_TORN) as exc:
            raise _unavailable(exc) from exc
        return self

    async def aclose(self) -> None:
        """Close every connection; but called by redis-py's retry of a command (a node
        lost or timed out, CLUSTERDOWN, a pipeline's connection error: to start again from
        a new slot map), only ask for the slot map again. redis-py closed every
        connection of every node there, under the commands other callers were running on
        them (issue 42: for about 1.5 s after a master came back, "Connection closed by
        server", `'NoneType' object has no attribute 'writelines'`, "handler is closed").
        A refresh marks each connection to be made again once its command is done
        (redis-py's `NodesManager.set_nodes`): they are replaced one by one."""
        if not _RUNNING.get():
            await super().aclose()
            return
        try:
            await self.nodes_manager.initialize()
        except (RedisClusterException, RedisError, OSError) as exc:  # the retry goes on
            log.warning("cluster slot map not refreshed", error=str(exc) or repr(exc))

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        if shard_hint:
            raise ValueError("shard_hint is not supported in cluster mode")
        return _Pipeline(self, transaction)


def connect_cluster(url: str, options: dict[str, Any]) -> RedisCluster:
    """A RedisCluster client for a `redis+cluster://` URL; `options` as for one Redis
    (`max_connections` then counts per node; a node with none free fails at once)."""
    parsed = urlsplit(url)
    nodes = [ClusterNode(host, port) for host, port in url_hosts(url, 6379)]
    if not nodes:
        raise ValueError("redis+cluster:// URL needs at least one host:port")
    options = {k: v for k, v in options.items() if k != "timeout"}
    return Cluster(
        startup_nodes=nodes,
        password=unquote(parsed.password) if parsed.password else None,
        **options,
    )
