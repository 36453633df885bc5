"""receive with a wait: returns as soon as a message is there for the group, or the wait
is over. Between receives a poll sleeps on its wake-up (skmq/pull/wakeups.py) or until
the group's next delay or lease runs out: no polling of Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from redis.exceptions import RedisError

from skmq.aio import spawn
from skmq.clock import now_ms
from skmq.pull.groups import Groups, NoSuchGroup, Pulled, Received, parse_receipt
from skmq.pull.wakeups import Wakeups

log = structlog.get_logger("skmq.pull")

# How long past its wait a receive goes on reading a log longer than one call reads
# (entries delayed, or waiting for their key, read once each and set aside): a message
# ready behind them is not answered as "nothing" unless the log is longer still.
SCAN_GRACE = 1.0


class TooManyWaiting(RuntimeError):
    pass


class LongPoll:
    def __init__(
        self,
        groups: Groups,
        wakeups: Wakeups,
        max_waiting: int,
        settled: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.groups = groups
        self.wakeups = wakeups
        self.max_waiting = max_waiting
        # Until a loop woken from a stall has read its sockets (skmq/stall.py): a receive
        # ends the leases that ran out, and acks sent during the stall come first.
        self.settled = settled
        self._releases: set[asyncio.Task[None]] = set()

    async def receive(
        self,
        app: str,
        group: str,
        max_messages: int,
        wait: float,
        visibility_ms: int,
        on_ended: Callable[[Received], None],
        gone: asyncio.Event | None = None,
    ) -> list[Pulled]:
        """The messages received. What each receive ended meanwhile (messages whose TTL
        ran out, leases that ran out) goes to `on_ended`, for the delivery log. Once `gone`
        is set (the consumer's connection ended), it waits no longer and receives nothing
        more."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        if wait > 0 and self.wakeups.count >= self.max_waiting:
            raise TooManyWaiting(f"{self.max_waiting} receives wait already (PULL_MAX_WAITING)")
        channel = self.groups.log_key(app)
        with self.wakeups.listen(channel, group) as waiting:
            woken = waiting.event
            while True:
                woken.clear()
                got = await self._receive(app, group, max_messages, visibility_ms, on_ended)
                if got.expired or got.ran_out:
                    on_ended(got)
                left = deadline - loop.time()
                # (a due time to come, or log left unread: whoever waits next must learn
                # it, if this one goes)
                waiting.hand_on = bool(got.messages) or got.next_due is not None or got.more
                if got.messages or (gone is not None and gone.is_set()):
                    return got.messages
                if got.more and left > -SCAN_GRACE:
                    continue  # (the log holds more than one call reads: read on)
                if left <= 0:
                    return []
                if got.next_due is not None and self.wakeups.is_first(channel, group, waiting):
                    left = min(left, max(0.001, (got.next_due - now_ms()) / 1000))
                waits = [asyncio.ensure_future(e.wait()) for e in (woken, gone) if e is not None]
                try:
                    await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
                if gone is not None and gone.is_set():
                    return []

    async def _receive(
        self,
        app: str,
        group: str,
        max_messages: int,
        lease_ms: int,
        on_ended: Callable[[Received], None],
    ) -> Received:
        """One receive. Cancelled meanwhile (its HTTP client hung up), it still runs to
        its end: what it ended goes to `on_ended` all the same (the script took those
        entries and leases out of the group: nothing else would log them), and what it
        leased to nobody is let go at once: it comes back after the retry backoff rather
        than the whole lease."""
        if self.settled is not None:
            await self.settled()
        call = asyncio.ensure_future(
            self.groups.receive(app, group, now_ms(), max_messages, lease_ms)
        )
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(lambda done: self._let_go(app, group, done, on_ended))
            raise

    def _let_go(
        self,
        app: str,
        group: str,
        call: asyncio.Future[Received],
        on_ended: Callable[[Received], None],
    ) -> None:
        if call.cancelled() or call.exception() is not None:
            return
        got = call.result()
        if got.expired or got.ran_out:
            on_ended(got)
        receipts = [parse_receipt(p.receipt) for p in got.messages]
        leases = [(*r, 1) for r in receipts if r is not None]
        if leases:
            spawn(self._end_leases(app, group, leases), self._releases)

    async def _end_leases(
        self, app: str, group: str, leases: list[tuple[str, int, str, int]]
    ) -> None:
        try:
            await self.groups.extend(app, group, leases, now_ms())
        except NoSuchGroup:  # deleted meanwhile: its leases went with it
            pass
        except (RedisError, OSError) as exc:  # (their leases run out by themselves)
            log.warning("leases of a gone poll not ended", app=app, error=repr(exc))
