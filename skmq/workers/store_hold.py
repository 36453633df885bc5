"""New stores wait while the broker's CPU is full and its deliveries fall behind.

A broker with no CPU to spare splits its loop between storing what producers send and
pushing what is stored. Storing is the cheaper of the two, so left alone it wins: under
a load beyond the broker's CPU the line of messages stored and not pushed yet grows by
thousands a second, and every message waits behind it (4 to 7 s at the median in
bench/'s e2e run, for the same throughput). So while the process used at least
STORE_HOLD_CPU of a core over the last look, and an app this broker owns has more than
STORE_HOLD_BACKLOG messages due while its recipients have free window slots, new
producer frames wait before they are stored (in the handle stage, as for
MAX_STORE_PENDING_BYTES: backpressure down to TCP), up to MAX_HOLD at a time.

Slow recipients (their windows full), a delivery rate (DELIVERY_RATE), an app with no
recipient, or a CPU with room never hold a store: then the line is what a broker is for.
A hold ends as soon as the line is down to a quarter of STORE_HOLD_BACKLOG, or the
recipients' windows are full (looked at every POLL).

bench/'s e2e run (4 producers, 4 recipients, 100,000 messages; 6 runs each way,
alternating, on a loaded 2-core machine): p50 0.48-0.67 s against 4.2-5.6 s with the
hold off, p99 0.8-1.5 s against 4.5-6.7 s, and the same throughput (medians 11,650 and
10,840 msg/s). The default, 768, is under half of BACKLOG_HELD (skmq/queue/owner.py):
at 1,536 the held line reached it, new stores went to the log to be read back later,
and the throughput fell by 15-20%.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

LOOK = 0.1  # s: how often the process's CPU is read
POLL = 0.005  # s: how often a held store looks again
# s: after a hold that ran out MAX_HOLD with the line no shorter, none starts for this
# long (a line that does not move, a recipient whose pushes fail, is not helped by it)
PAUSE = 2.0
MAX_HOLD = 0.5  # s: a store is held this long at most, whatever the signal says


class StoreHold:
    """`holding()`: new stores should wait now; `wait()`: until they need not (MAX_HOLD
    at most). `behind(limit)`: the messages due and not pushed of the apps this broker
    owns whose line is longer than `limit` while their recipients have room (0: none).

    A hold helps only while the deliveries go on: after one that ran out MAX_HOLD with
    the line no shorter than at its start, none starts for PAUSE, so that a line that
    does not move costs producers a fifth of their time at most. (A shorter window of
    progress, 50 or 200 ms, misjudged bench/'s e2e run: under full load a claim's flush
    may take that long, and the line does not move meanwhile.)"""

    def __init__(self, behind: Callable[[int], int], backlog: int, cpu: float) -> None:
        self.behind = behind
        self.backlog = backlog  # 0: never hold
        self.cpu = cpu  # of one core, 0..1
        self.busy = False  # the process used at least `cpu` over the last look
        self.held = 0  # batches held (skmq_stores_held_total)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._at = (0.0, 0.0)  # (loop time, process CPU s) at the last look
        self._behind = (float("-inf"), 0)  # (loop time) `behind` asked last, its answer
        self._paused_until = float("-inf")  # (loop time) after a hold that did not help

    def start(self) -> None:
        if not self.backlog:
            return
        self._loop = asyncio.get_running_loop()
        self._at = (self._loop.time(), time.process_time())
        self._timer = self._loop.call_later(LOOK, self._look)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.busy = False

    def _look(self) -> None:
        assert self._loop is not None
        now, cpu = self._loop.time(), time.process_time()
        then, cpu_then = self._at
        self.busy = now > then and (cpu - cpu_then) / (now - then) >= self.cpu
        self._at = (now, cpu)
        self._timer = self._loop.call_later(LOOK, self._look)

    def _line(self) -> int:
        """The line behind now, 0 if none (`behind` asked once in POLL at most: it looks
        at every app this broker owns). Once holding, until it is down to a quarter."""
        if not self.busy or self._loop is None:
            return 0
        now = self._loop.time()
        asked, line = self._behind
        if now < self._paused_until:
            return 0
        if now - asked >= POLL:
            line = self.behind(self.backlog // 4 if line else self.backlog)
            self._behind = (now, line)
        return line

    def holding(self) -> bool:
        """Whether new stores should wait now."""
        return self._line() > 0

    async def wait(self) -> None:
        first = line = self._line()
        if not line:
            return
        self.held += 1
        loop = asyncio.get_running_loop()
        give_up = loop.time() + MAX_HOLD
        while line and loop.time() < give_up:
            await asyncio.sleep(POLL)
            line = self._line()
        if line >= first:
            self._paused_until = loop.time() + PAUSE
