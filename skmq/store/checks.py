"""What the broker checks of a Redis before trusting it with messages."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
import structlog
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from skmq.embedded import LISTPACK_ENTRIES, LISTPACK_SETTINGS
from skmq.errors import Misconfigured
from skmq.store.client import RedisClient

log = structlog.get_logger("skmq.store")

EVICTING = ("allkeys-", "volatile-")
LISTPACK_WARN_ABOVE = 128  # Redis's default for sorted sets


async def _config_by_node(
    redis: RedisClient, name: str, unreadable: str | None
) -> dict[str, str] | None:
    """The setting `name` of the Redis, by node ("host:port"; one Redis: ""); a node
    without such a setting is left out; None if CONFIG is not allowed (then warning that
    `unreadable`, if given). On a cluster: every node known, masters and replicas."""
    try:
        if isinstance(redis, RedisCluster):
            reply = await redis.config_get(name, target_nodes=RedisCluster.ALL_NODES)
        else:
            reply = await redis.config_get(name)
    except ResponseError as exc:
        if unreadable:
            log.warning(f"cannot read {name} (CONFIG not allowed): {unreadable}", error=str(exc))
        return None
    # A cluster answers {node: {name: value}} (one node: {name: value}).
    nested = reply and all(isinstance(v, dict) for v in reply.values())
    values = {}
    for node, node_reply in reply.items() if nested else [("", reply)]:
        raw = next(iter(node_reply.values()), None)
        if raw is not None:
            values[str(node)] = raw.decode() if isinstance(raw, bytes) else str(raw)
    return values


async def _config_values(redis: RedisClient, name: str, unreadable: str | None) -> list[str] | None:
    """The setting `name` of the Redis (on a cluster: of each node); [] if it has no such
    setting, None if CONFIG is not allowed (then warning that `unreadable`, if given)."""
    by_node = await _config_by_node(redis, name, unreadable)
    return None if by_node is None else list(by_node.values())


def _evicting(policies: list[str]) -> str | None:
    """The first of the nodes' maxmemory-policies that may evict keys, if any."""
    return next((p for p in policies if p.startswith(EVICTING)), None)


def _eviction_refusal(policy: str) -> str:
    return (
        f"Redis maxmemory-policy is {policy}: it would evict stored messages; "
        "set maxmemory-policy noeviction"
    )


async def check_eviction_policy(redis: RedisClient) -> None:
    """Refuse a Redis that may evict keys: it would silently lose acknowledged messages."""
    policies = await _config_values(
        redis, "maxmemory-policy", "make sure this Redis never evicts keys"
    )
    policy = _evicting(policies or [])
    if policy is not None:
        raise Misconfigured(_eviction_refusal(policy))


class EvictionWatch:
    """The eviction policy, read again every REDIS_CHECK_INTERVAL while the broker runs:
    an operator may set an evicting one on a running Redis. Meanwhile `refusal` is what
    producers hear instead of `ack` (skmq/workers/enqueue.py): nothing is acknowledged
    that Redis might evict. None while the policy keeps keys (not watched where CONFIG is
    not allowed)."""

    def __init__(self, redis: RedisClient, interval: float, timeout: float) -> None:
        self.redis = redis
        self.interval = interval
        self.timeout = timeout
        self.refusal: str | None = None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                async with asyncio.timeout(self.timeout):
                    policies = await _config_values(self.redis, "maxmemory-policy", None)
            except (RedisError, OSError, TimeoutError):
                continue  # unreachable: stores fail by themselves meanwhile
            if policies is None:
                return  # CONFIG not allowed: the broker said so when it started
            policy = _evicting(policies)
            refusal = None if policy is None else _eviction_refusal(policy)
            if refusal != self.refusal:
                if refusal:
                    log.error("Redis may evict keys now: storing nothing until it may not",
                              policy=policy)  # fmt: skip
                else:
                    log.warning("Redis evicts no keys again: storing messages")
            self.refusal = refusal


def _without_aof(nodes: list[str]) -> str:
    """`Redis runs with appendonly no`, naming the nodes of a cluster that do."""
    return "Redis runs with appendonly no" + (f" (nodes {', '.join(nodes)})" if any(nodes) else "")


async def check_persistence(redis: RedisClient, allow_volatile: bool) -> str | None:
    """Refuse a Redis without AOF (on a cluster: any node of it, master or replica): it
    keeps acknowledged messages in memory only, and a restart loses them. With
    ALLOW_VOLATILE_REDIS, a warning instead, and what /healthz and /metrics then say
    (None: the Redis persists every write, or CONFIG is not allowed)."""
    by_node = await _config_by_node(redis, "appendonly", "make sure this Redis runs with AOF")
    if by_node is not None and isinstance(redis, RedisCluster):
        by_node.update(await _unlisted_nodes(redis, set(by_node), "appendonly"))
    volatile = sorted(node for node, value in (by_node or {}).items() if value != "yes")
    if not volatile:
        return None
    if not allow_volatile:
        raise Misconfigured(
            f"{_without_aof(volatile)}: every message acked since its last snapshot is lost "
            "when it restarts; set appendonly yes (redis.conf, or CONFIG SET appendonly yes), "
            "or SKMQ_ALLOW_VOLATILE_REDIS=true to accept the loss"
        )
    volatile_store = (
        f"{_without_aof(volatile)}: a restart of it loses the messages acked since its last "
        "snapshot (ALLOW_VOLATILE_REDIS)"
    )
    log.warning(volatile_store)
    return volatile_store


ASK_NODE = 2.0  # seconds a node outside the client's slot map has to answer the check


async def _unlisted_nodes(redis: RedisCluster, checked: set[str], name: str) -> dict[str, str]:
    """The setting `name` of the cluster's nodes that the client does not reach yet (a
    replica is left out of CLUSTER SLOTS until it has synced something), each asked on a
    connection of its own with the client's credentials; one that does not answer is
    named in a warning, for the operator to check."""
    try:
        nodes = await redis.cluster_nodes()
    except RedisError:
        return {}
    unlisted = sorted(
        node for node, about in nodes.items()
        if node not in checked and not {"fail", "noaddr", "handshake"} & set(
            str(about.get("flags", "")).split(",")
        )
    )  # fmt: skip
    kwargs = redis.get_connection_kwargs()
    credentials = {k: kwargs[k] for k in ("username", "password", "ssl") if k in kwargs}

    async def ask(node: str) -> str | None:
        """The node's setting; None if it has none or does not answer within ASK_NODE."""
        host, _, port = node.rpartition(":")
        client = aioredis.Redis(host=host, port=int(port), **credentials)
        try:
            async with asyncio.timeout(ASK_NODE):
                value = next(iter((await client.config_get(name)).values()), None)
        except (RedisError, OSError, TimeoutError):
            unanswered.append(node)
            return None
        finally:
            await client.aclose()
        return None if value is None else value.decode() if isinstance(value, bytes) else value

    unanswered: list[str] = []
    values = await asyncio.gather(*(ask(node) for node in unlisted))
    found = {node: v for node, v in zip(unlisted, values, strict=True) if v is not None}
    if unanswered:
        log.warning(
            f"cannot check {name} of these cluster nodes: make sure they run with {name} yes",
            nodes=", ".join(unanswered),
        )
    return found


async def persistence(redis: RedisClient) -> dict[str, str | None]:
    """appendonly and appendfsync of the Redis, for `skmq status` (a cluster whose nodes
    differ: each value found, comma-separated; None: CONFIG is not allowed)."""
    found: dict[str, str | None] = {}
    for name in ("appendonly", "appendfsync"):
        values = await _config_values(redis, name, None)
        found[name] = None if values is None else ",".join(sorted(set(values)))
    return found


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
