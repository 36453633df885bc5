"""A store's writes on a Redis Cluster: one pipeline a master, each on one connection
of that master, sent once (issue 42).

redis-py's cluster pipeline sends each node its commands, but when it cannot write to
one node (a connection refused, lost) it closes every connection of the client (the
calls running on them fail: an error storm), and sends again whatever has no truthy answer,
routed anew: a `WAIT` (no key) then goes to the client's default node, not to the
master that ran the scripts, and answers for that node's replicas (an `ack` for a
message whose master has none); the scripts of the healthy masters, which ran, are
answered `error` with the batch. Here:

- each master gets its own pipeline on one of its own connections (redis-py's public
  per-node API: `ClusterNode.acquire_connection`, the connection's `send_packed_command`
  and `read_response`), with `WAIT` last on that same connection: it counts the
  replicas of the master that ran the scripts, whatever happens elsewhere (and a write
  that changes nothing before it makes it count them for everything the master holds:
  `write_by_node`);
- nothing is sent twice (a script sent again after a lost answer would answer
  "duplicate" for what it stored);
- a master's trouble is that master's calls' alone: each call ends with its reply or
  with a `WriteFailed` that says whether it may have run (`maybe_ran`: the connection
  was lost, or timed out, after the write) or certainly did not (no connection, a
  refusal such as MOVED or CLUSTERDOWN);
- a broken connection is closed alone, not every connection of the client;
- a failure that may come from a stale slot map (a master unreachable or lost, MOVED,
  CLUSTERDOWN) has the client ask the cluster for it again (`SlotMap`), in the
  background: the next stores go to the new master once a replica took over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)

log = structlog.get_logger("skmq.store")

Command = tuple[Any, ...]
# How long after one slot map refresh another may start (the wait redis-py's own cluster
# pipeline makes before trying again): while a master is down and not yet replaced, every
# store to it fails, and each would ask for the slot map (and have every connection of
# the client made again, redis-py's way after a refresh).
REFRESH_GAP = 0.25

# Error replies Redis gives before running a command (a script): it did not run.
# (MOVED and MASTERDOWN are subclasses of ASK and CLUSTERDOWN.)
_REFUSED = (AskError, ClusterDownError, TryAgainError, NoScriptError, ReadOnlyError,
            OutOfMemoryError)  # fmt: skip
_REFUSED_CODES = ("NOREPLICAS", "BUSY", "MISCONF", "LOADING")


class WriteFailed(RedisError):  # type: ignore[misc]
    """A write not acknowledged: `maybe_ran` if it may have run all the same (its answer
    was lost after it was sent), False if it certainly did not."""

    def __init__(self, reason: str, maybe_ran: bool) -> None:
        super().__init__(reason)
        self.maybe_ran = maybe_ran


class ReplicasMissing(WriteFailed):
    """Fewer replicas than REPLICA_ACKS acknowledged a write within REPLICA_ACK_TIMEOUT:
    it ran on its master (`reply`: its reply there), not confirmed."""

    def __init__(self, reason: str, reply: Any = None) -> None:
        super().__init__(reason, maybe_ran=True)
        self.reply = reply


def refused(reply: Any) -> bool:
    """Whether an error reply says the command did not run (a cluster redirection or
    refusal, no script, a read-only or out-of-memory node...). Any other error of a
    script may come after some of its writes."""
    if isinstance(reply, _REFUSED):
        return True
    return isinstance(reply, ResponseError) and str(reply).startswith(_REFUSED_CODES)


def lost(node: ClusterNode, exc: BaseException, sent: bool) -> WriteFailed:
    """A node's round trip that failed with `exc`, before (`sent` False) or after its
    write."""
    what = "no answer from" if sent else "could not reach"
    return WriteFailed(f"{what} {node.name}: {exc!r}", maybe_ran=sent)


async def node_round_trip(node: ClusterNode, commands: Sequence[Command]) -> list[Any]:
    """The replies of `commands`, written at once on ONE connection of `node` and read in
    order, each error reply in its place. Sent once, never redirected or retried.
    Raises WriteFailed: `maybe_ran` False if nothing was written (no free connection,
    no connection), True if the connection failed or timed out (socket_timeout) or the
    call was cancelled after the write. Only that connection is closed then (the
    replies still due on it would be out of step)."""
    try:
        connection = node.acquire_connection()
    except RedisError as exc:  # MaxConnectionsError: every connection of the node busy
        raise lost(node, exc, sent=False) from exc
    sent = finished = False
    try:
        await node.disconnect_if_needed(connection)  # (marked by a slot map refresh)
        await connection.connect()  # (no-op when connected)
        sent = True  # from here on, some of the write may have gone
        await connection.send_packed_command(connection.pack_commands(commands))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await connection.read_response())
            except ResponseError as exc:  # an error reply: the connection is in step
                replies.append(exc)
        finished = True
        return replies
    except (RedisError, OSError) as exc:  # (TimeoutError is an OSError)
        raise lost(node, exc, sent) from exc
    finally:
        if not finished:
            await connection.disconnect(nowait=True)
        node.release(connection)


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


async def by_node(
    cluster: RedisCluster,
    commands: Sequence[tuple[str, Command]],
    last: Callable[[str], Sequence[Command]] = lambda key: (),
    deadline: float | None = None,
) -> list[tuple[Any, list[Any]]]:
    """Each (key, command) sent to the master of its key (`master_of`), one pipeline a
    master (`node_round_trip`) followed by the commands `last(the key of its first
    command)` (a `WAIT`), the masters at once. Returns for each command its reply (an
    error reply or a WriteFailed in its place) and the replies of `last` in its master's
    round trip (none if it failed). `deadline` (the loop's time) bounds every round trip:
    one still running then fails as lost after its write."""
    out: list[tuple[Any, list[Any]]] = [(None, [])] * len(commands)
    nodes: dict[str, tuple[ClusterNode, list[int]]] = {}
    for i, (key, _) in enumerate(commands):
        try:
            node = master_of(cluster, key)
        except WriteFailed as exc:
            out[i] = (exc, [])
            continue
        nodes.setdefault(node.name, (node, []))[1].append(i)

    async def one(node: ClusterNode, indexes: list[int]) -> None:
        then = last(commands[indexes[0]][0])
        trip = node_round_trip(node, [*(commands[i][1] for i in indexes), *then])
        try:
            async with asyncio.timeout_at(deadline):
                got = await trip
        except (WriteFailed, TimeoutError) as exc:
            failed = exc if isinstance(exc, WriteFailed) else lost(node, exc, sent=True)
            for i in indexes:
                out[i] = (failed, [])
            return
        tail = got[len(indexes) :]
        for i, reply in zip(indexes, got, strict=False):
            out[i] = (reply, tail)

    await asyncio.gather(*(one(node, indexes) for node, indexes in nodes.values()))
    return out


async def write_by_node(
    cluster: RedisCluster,
    commands: Sequence[tuple[str, Command]],
    sources: Sequence[str],
    replicas: int = 0,
    wait_ms: int = 0,
    deadline: float | None = None,
    touch: Callable[[str], Command] | None = None,
) -> list[Any]:
    """Writes (script calls, each with one of its keys) by master (`by_node`): each one's
    reply, or a WriteFailed. A master without the scripts (a restart) loads `sources` and
    runs again only the calls it refused.

    With `replicas`, each master's round trip ends with `touch(a key of its calls)` then
    `WAIT replicas wait_ms` on its connection, and a call that ran on a master with fewer
    replicas acknowledging fails with ReplicasMissing (it ran: `maybe_ran`). WAIT counts
    the replicas that have the connection's last write: `touch`, a write that changes
    nothing and is replicated all the same, makes that the master's latest, so that a
    call that wrote nothing (a duplicate, whose first store went on another connection,
    perhaps not replicated yet) is confirmed too."""

    def last(key: str) -> list[Command]:
        if not replicas:
            return []
        return [*((touch(key),) if touch is not None else ()), ("WAIT", replicas, wait_ms)]

    out = await by_node(cluster, commands, last, deadline)
    again = [i for i, (reply, _) in enumerate(out) if isinstance(reply, NoScriptError)]
    if again:
        redo: list[tuple[str, Command]] = []
        for i in again:
            key = commands[i][0]
            redo += [(key, ("SCRIPT", "LOAD", source)) for source in sources]
            redo.append(commands[i])
        redone = (await by_node(cluster, redo, last, deadline))[len(sources) :: len(sources) + 1]
        for i, (reply, tail) in zip(again, redone, strict=True):
            # (the WAIT of the first round trip covered the calls that ran then)
            out[i] = (reply, tail)
    results: list[Any] = []
    for reply, tail in out:
        if isinstance(reply, ResponseError):
            reply = WriteFailed(str(reply), maybe_ran=not refused(reply))
        elif replicas and not isinstance(reply, WriteFailed):
            acked = tail[-1] if tail and isinstance(tail[-1], int) else 0
            if acked < replicas:
                reply = ReplicasMissing(f"{acked} of {replicas} replicas acknowledged", reply)
        results.append(reply)
    return results


def stale_map(reply: Any) -> bool:
    """Whether a write's failure may come from a stale slot map (its master unreachable
    or gone, a redirection, a slot not served)."""
    if isinstance(reply, WriteFailed):
        return not isinstance(reply, ReplicasMissing)
    return isinstance(reply, (AskError, ClusterDownError, TryAgainError))


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
