"""Writes on a Redis Cluster (issue 42): what a write not acknowledged tells
(`WriteFailed`, `ReplicasMissing`), the master that holds a key, and the client's slot
map refreshed in the background after trouble (`SlotMap`), so that the next writes go
to the new master once a replica took over. The owners' connections (skmq/store/wires.py)
write each app's records on its master's own connection.
"""

from __future__ import annotations

import asyncio

import structlog
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError

log = structlog.get_logger("skmq.store")

# How long after one slot map refresh another may start (the wait redis-py's own cluster
# pipeline makes before trying again): while a master is down and not yet replaced, every
# store to it fails, and each would ask for the slot map (and have every connection of
# the client made again, redis-py's way after a refresh).
REFRESH_GAP = 0.25


class WriteFailed(RedisError):  # type: ignore[misc]
    """A write not acknowledged: `maybe_ran` if it may have run all the same (its answer
    was lost after it was sent), False if it certainly did not."""

    def __init__(self, reason: str, maybe_ran: bool) -> None:
        super().__init__(reason)
        self.maybe_ran = maybe_ran


class ReplicasMissing(WriteFailed):
    """Fewer replicas than REPLICA_ACKS acknowledged a write within REPLICA_ACK_TIMEOUT:
    it ran on its master, not confirmed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason, maybe_ran=True)


def master_of(cluster: RedisCluster, key: str) -> ClusterNode:
    """The master that holds `key` in the client's slot map; WriteFailed (it did not
    run) when no node covers the slot."""
    try:
        node = cluster.get_node_from_key(key)
    except (RedisClusterException, RedisError) as exc:
        raise WriteFailed(f"no master for {key!r}: {exc}", maybe_ran=False) from exc
    if node is None:
        raise WriteFailed(f"no master for {key!r}", maybe_ran=False)
    return node


class SlotMap:
    """Refreshes a cluster client's slot map in the background, one refresh at a time and
    at most one every REFRESH_GAP seconds (redis-py's public `nodes_manager.initialize`,
    which does not close the client's connections: it marks them to be made again when
    next used)."""

    def __init__(self, cluster: RedisCluster) -> None:
        self.cluster = cluster
        self.task: asyncio.Task[None] | None = None
        self.last = float("-inf")

    def refresh(self) -> None:
        loop = asyncio.get_running_loop()
        if (self.task is None or self.task.done()) and loop.time() - self.last >= REFRESH_GAP:
            self.last = loop.time()
            self.task = loop.create_task(self._refresh())

    async def _refresh(self) -> None:
        try:
            await self.cluster.nodes_manager.initialize()
        except (RedisClusterException, RedisError, OSError) as exc:
            log.warning("cluster slot map not refreshed", error=str(exc) or repr(exc))
