"""What the broker checks of a Redis before trusting it with messages."""

from __future__ import annotations

import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from skmq.errors import Misconfigured
from skmq.store.client import RedisClient

log = structlog.get_logger("skmq.store")

EVICTING = ("allkeys-", "volatile-")


async def check_eviction_policy(redis: RedisClient) -> None:
    """Refuse a Redis that may evict keys: it would silently lose acknowledged messages
    (on a cluster: any of its nodes)."""
    try:
        if isinstance(redis, RedisCluster):
            reply = await redis.config_get("maxmemory-policy", target_nodes=RedisCluster.ALL_NODES)
        else:
            reply = await redis.config_get("maxmemory-policy")
    except ResponseError as exc:
        log.warning("cannot read maxmemory-policy (CONFIG not allowed): make sure this Redis "
                    "never evicts keys", error=str(exc))  # fmt: skip
        return
    # A cluster answers {node: {name: value}} (one node: {name: value}).
    nested = reply and all(isinstance(v, dict) for v in reply.values())
    for node_reply in reply.values() if nested else [reply]:
        raw = next(iter(node_reply.values()), b"")
        policy = raw.decode() if isinstance(raw, bytes) else str(raw)
        if policy.startswith(EVICTING):
            raise Misconfigured(
                f"Redis maxmemory-policy is {policy}: it would evict stored messages; "
                "set maxmemory-policy noeviction"
            )


async def tcp_port(redis: aioredis.Redis) -> int:
    """The TCP port the server listens on (0: none, or CONFIG not allowed). A broker that
    reaches its Redis by a unix socket must still know it: that server runs on this
    machine, and a push to 127.0.0.1 on that port would be read as Redis commands."""
    try:
        reply = await redis.config_get("port")
    except ResponseError as exc:
        log.warning("cannot read the port of the Redis on the unix socket (CONFIG not "
                    "allowed): make sure RECIPIENT_NETWORKS keeps recipients off it",
                    error=str(exc))  # fmt: skip
        return 0
    raw = next(iter(reply.values()), b"0")
    return int(raw)
