"""The Redis client types the store works with, and the Redis Cluster connection.

`redis+cluster://[:password@]host1:port1,host2:port2,...` names some nodes of a cluster
(seed nodes, in the style of `redis+sentinel://`): redis-py's RedisCluster asks them for
the slot map, then routes each command by its keys and follows MOVED/ASK redirections and
failovers (it asks for the slot map again)."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.exceptions import RedisClusterException, RedisError

RedisClient = aioredis.Redis | RedisCluster

CLUSTER_SCHEME = "redis+cluster"
ENC = "surrogateescape"  # keys and members are bytes; any byte an app id holds survives


def text(value: bytes | str) -> str:
    return value.decode("utf-8", ENC) if isinstance(value, bytes) else value


def url_hosts(url: str, default_port: int) -> list[tuple[str, int]]:
    """The `host:port` list of a `redis+sentinel://` or `redis+cluster://` URL."""
    hosts = []
    for part in urlsplit(url).netloc.rpartition("@")[2].split(","):
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or "]" in port or not port.isdigit():
            host, port = part, ""
        hosts.append((host.strip("[]") or "localhost", int(port) if port else default_port))
    return hosts


class ClusterUnavailable(RedisError):  # type: ignore[misc]
    """A cluster error raised by the client itself (a slot no node covers during a
    failover, no node reachable), as a RedisError: what every caller of the store
    handles as "store unavailable"."""


class _Pipeline(ClusterPipeline):  # type: ignore[misc]
    async def execute(self, *args: Any, **kwargs: Any) -> list[Any]:
        try:
            return await super().execute(*args, **kwargs)  # type: ignore[no-any-return]
        except RedisClusterException as exc:
            raise ClusterUnavailable(str(exc)) from exc


class Cluster(RedisCluster):  # type: ignore[misc]
    """RedisCluster whose client-side cluster errors are RedisErrors too."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except RedisClusterException as exc:
            raise ClusterUnavailable(str(exc)) from exc

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
