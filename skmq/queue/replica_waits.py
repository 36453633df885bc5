"""REPLICA_ACKS's WAITs, shared: one at a time a server, each for every store before it.

A WAIT holds its connection until enough replicas answer, up to REPLICA_ACK_TIMEOUT, so
the stores waiting on one server would each wait behind the others' WAITs: with its
replicas gone, the k-th store of a burst waited k timeouts.  Here the stores that ask
while a server's WAIT runs join the next one, which covers them all (WAIT counts the
replicas holding the connection's last write, made after every store it covers was
answered): a store waits at most two WAITs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from skmq.store.wire import Wire
from skmq.store.wires import TROUBLE, Siblings

__all__ = ["ReplicaWaits"]


@dataclass
class _Round:
    """One WAIT on a server, for the marks of the stores that joined it before it began:
    each mark's count of replicas (0 where its touch wrote nothing)."""

    marks: set[str] = field(default_factory=set)
    counts: asyncio.Future[dict[str, int]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class ReplicaWaits:
    """The replicas that hold what was stored on a server (REPLICA_ACKS), asked on a
    second connection to that very server (`siblings`, by its URL: after a failover
    the master of an app's keys is another server, whose replicas may lack the write)."""

    def __init__(self, siblings: Siblings, replicas: int, timeout_ms: int) -> None:
        self.siblings = siblings
        self.replicas = replicas
        self.timeout_ms = timeout_ms
        self._joining: dict[str, _Round] = {}  # by server: the round that starts next
        self._last: dict[str, _Round] = {}  # by server: the round the next one follows
        self._rounds: set[asyncio.Task[None]] = set()

    async def acked(self, stored_on: Wire, marks: Sequence[str]) -> dict[str, int]:
        """How many replicas hold each of `marks` touched after the stores were answered
        (`SET mark 1 XX`: a write that changes nothing, and confirms nothing for a mark
        gone meanwhile); the caller bounds the wait, the round goes on for the others."""
        url = stored_on.url
        joined = self._joining.get(url)
        if joined is None:
            joined = self._joining[url] = _Round()
            task = asyncio.ensure_future(self._run(stored_on, joined, self._last.get(url)))
            self._last[url] = joined
            self._rounds.add(task)
            task.add_done_callback(self._rounds.discard)
        joined.marks.update(marks)
        counts = await asyncio.shield(joined.counts)
        return {mark: counts.get(mark, 0) for mark in marks}

    async def _run(self, stored_on: Wire, this: _Round, before: _Round | None) -> None:
        url = stored_on.url
        counts: dict[str, int] = {}
        try:
            if before is not None:
                await asyncio.wait([before.counts])
            if self._joining.get(url) is this:  # closed: later stores join the next round
                del self._joining[url]
            marks = sorted(this.marks)
            touches = [("SET", mark, 1, "XX") for mark in marks]
            # twice the WAIT's own timeout, and the connection's (a server gone still)
            async with asyncio.timeout(2 * self.timeout_ms / 1000 + self.siblings.timeout):
                wire = await self.siblings.of(stored_on)
                *touched, acked = await wire.call_many(
                    [*touches, ("WAIT", self.replicas, self.timeout_ms)]
                )
            replicas = 0 if isinstance(acked, Exception) else int(acked)
            counts = {
                mark: replicas if reply is not None and not isinstance(reply, Exception) else 0
                for mark, reply in zip(marks, touched, strict=True)
            }
        except TROUBLE:  # (the server that stored gone, or a replica now): none confirmed
            pass
        finally:
            if self._joining.get(url) is this:
                del self._joining[url]
            if self._last.get(url) is this:
                del self._last[url]
            if not this.counts.done():
                this.counts.set_result(counts)

    def close(self) -> None:
        """Every round ends, none confirmed (a round not begun yet too)."""
        for waiting in [*self._joining.values(), *self._last.values()]:
            if not waiting.counts.done():
                waiting.counts.set_result({})
        for task in self._rounds:
            task.cancel()
        self.siblings.close()
