"""What the broker checks of a Redis before trusting it with messages."""

from __future__ import annotations

import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from skmq.embedded import LISTPACK_ENTRIES, LISTPACK_SETTINGS
from skmq.errors import Misconfigured
from skmq.store.client import RedisClient

log = structlog.get_logger("skmq.store")

EVICTING = ("allkeys-", "volatile-")
LISTPACK_WARN_ABOVE = 128  # Redis's default for sorted sets


async def _config_values(redis: RedisClient, name: str, unreadable: str) -> list[str] | None:
    """The setting `name` of the Redis (on a cluster: of each node); [] if it has no such
    setting, None if CONFIG is not allowed (then warning that `unreadable`)."""
    try:
        if isinstance(redis, RedisCluster):
            reply = await redis.config_get(name, target_nodes=RedisCluster.ALL_NODES)
        else:
            reply = await redis.config_get(name)
    except ResponseError as exc:
        log.warning(f"cannot read {name} (CONFIG not allowed): {unreadable}", error=str(exc))
        return None
    # A cluster answers {node: {name: value}} (one node: {name: value}).
    nested = reply and all(isinstance(v, dict) for v in reply.values())
    values = []
    for node_reply in reply.values() if nested else [reply]:
        raw = next(iter(node_reply.values()), None)
        if raw is not None:
            values.append(raw.decode() if isinstance(raw, bytes) else str(raw))
    return values


async def check_eviction_policy(redis: RedisClient) -> None:
    """Refuse a Redis that may evict keys: it would silently lose acknowledged messages
    (on a cluster: any of its nodes)."""
    policies = await _config_values(
        redis, "maxmemory-policy", "make sure this Redis never evicts keys"
    )
    for policy in policies or []:
        if policy.startswith(EVICTING):
            raise Misconfigured(
                f"Redis maxmemory-policy is {policy}: it would evict stored messages; "
                "set maxmemory-policy noeviction"
            )


async def check_listpack_sizes(redis: RedisClient) -> None:
    """Warn about a Redis whose listpacks are large enough to slow every delivery
    (LISTPACK_ENTRIES, skmq/embedded.py)."""
    for name in LISTPACK_SETTINGS:
        advice = f"set it to {LISTPACK_ENTRIES} or less for faster deliveries"
        values = await _config_values(redis, name, advice) or []
        largest = max((int(v) for v in values if v.isdigit()), default=0)
        if largest > LISTPACK_WARN_ABOVE:
            log.warning(
                f"Redis {name} is {largest}: each delivery's bookkeeping scans up to that "
                f"many entries while many messages are in flight; set {name} "
                f"{LISTPACK_ENTRIES} (the embedded Redis runs so)"
            )


async def tcp_port(redis: aioredis.Redis) -> int:
    """The TCP port the server listens on (0: none, or CONFIG not allowed). A broker that
    reaches its Redis by a unix socket must still know it: that server runs on this
    machine, and a push to 127.0.0.1 on that port would be read as Redis commands."""
    ports = await _config_values(
        redis, "port", "make sure RECIPIENT_NETWORKS keeps recipients off its TCP port"
    )
    return int(ports[0]) if ports else 0
