"""An app's new messages wait while the broker's CPU is full and its deliveries fall
behind.

A broker with no CPU to spare splits its loop between storing what producers send and
pushing what is stored. Storing is the cheaper of the two, so left alone it wins: under
a load beyond the broker's CPU the line of messages stored and not pushed yet grows by
thousands a second, and every message waits behind it (4 to 7 s at the median in
bench/'s e2e run, for the same throughput). So while the process used at least
STORE_HOLD_CPU of a core over the last look, and an app this broker owns has more than
STORE_HOLD_BACKLOG messages due (waiting behind their key included) while its
recipients took more at the dispatcher's last look, or one of its consumer groups had
that many left to read at a receive in the last ACTIVE (skmq/pull/groups.py), the app's
new messages wait before they are stored, up to MAX_HOLD at a time
(skmq/workers/enqueue.py); their producers' frames wait unanswered, and a connection
with its share of unanswered frames is read no more (backpressure down to TCP). Other
apps' messages are stored meanwhile.

An app with no recipient, a delivery rate (DELIVERY_RATE) holding the dispatcher back,
recipients whose windows stay full, or a CPU with room never hold a store: then the
line is what a broker is for. A batch held waits until the line is shorter by its
messages than when it began (the app's stores go no faster than its deliveries), or
down to a quarter of STORE_HOLD_BACKLOG, or the dispatcher found the recipients'
windows full (looked at every POLL). Slow recipients whose windows free now and then,
while the CPU is full, hold their app's producers to their pace (there is no telling
them from a broker that answers late), as a RabbitMQ queue's credit flow does; other
apps go on.

bench/'s e2e run (4 producers, 4 recipients, 100,000 messages; 4 runs each way,
alternating, on a loaded 2-core machine): p50 0.34-0.41 s against 3.0-4.5 s with the
hold off, p99 0.57-0.63 s against 4.8-5.9 s, and the same throughput (medians 12,150
and 11,730 msg/s). The default, 768, is under half of BACKLOG_HELD
(skmq/queue/owner.py): at 1,536 the held line reached it, new stores went to the log to
be read back later, and the throughput fell by 15-20%. The ordered run (1,000 keys; 3
runs each way): p50 0.41-0.51 s against 3.5-5.9 s, the same throughput (medians 9,870
and 9,190 msg/s). bench.pull_drain's e2e (4 consumers of one group, a producer at full
speed; 2 runs each way): p50 over TCP 0.28-0.54 s against 1.9-2.1 s, over HTTP 1.07-1.13
s against 1.85-1.97 s, msg/s 10,800-12,800 against 9,600-11,200.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable

LOOK = 0.1  # s: how often the process's CPU is read
POLL = 0.005  # s: how often a held store looks again
MAX_HOLD = 0.5  # s: a store is held this long at most, whatever the signal says
# s: after a hold that ran out MAX_HOLD with the line no shorter, none starts for this
# long (a line that does not move, a recipient whose pushes fail, is not helped by it)
PAUSE = 2.0


class StoreHold:
    """`holding(apps)`: the apps whose new messages should wait now; `wait(app, n)`:
    until it need not (MAX_HOLD at most). Each of `lines` tells an app's line if it is
    longer than a limit, else 0: its messages due and not pushed, if this broker owns it
    and its recipients took more at the dispatcher's last look (Dispatchers.behind);
    what its consumer groups had not read at their last receives, while they receive
    (ReceivePace.behind).

    A hold helps only while the deliveries go on: after one that ran out MAX_HOLD with
    the line no shorter than at its start, none starts for PAUSE, so that a line that
    does not move costs its producers a fifth of their time at most. (A shorter window
    of progress, 50 or 200 ms, misjudged bench/'s e2e run: under full load a claim's
    flush may take that long, and the line does not move meanwhile.)"""

    def __init__(self, lines: list[Callable[[str, int], int]], backlog: int, cpu: float) -> None:
        self.lines = lines
        self.backlog = backlog  # 0: never hold
        self.cpu = cpu  # of one core, 0..1
        self.busy = False  # the process used at least `cpu` over the last look
        self.held: Counter[str] = Counter()  # stores held, by app (skmq_stores_held_total)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._at = (0.0, 0.0)  # (loop time, process CPU s) at the last look
        self._holding: set[str] = set()  # apps held now: until their line is a quarter
        self._paused: dict[str, float] = {}  # (loop time) until which an app is not held

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
        self._paused = {app: t for app, t in self._paused.items() if t > now}
        self._timer = self._loop.call_later(LOOK, self._look)

    def _line(self, app: str) -> int:
        """The app's line if it is held now, else 0."""
        assert self._loop is not None
        if self._paused.get(app, float("-inf")) > self._loop.time():
            return 0
        held = app in self._holding
        limit = self.backlog // 4 if held else self.backlog
        line = max(behind(app, limit) for behind in self.lines)
        if held and not line:
            self._holding.discard(app)
        return line

    def holding(self, apps: Iterable[str]) -> set[str]:
        """Those of `apps` whose new messages should wait now."""
        if not self.busy or self._loop is None:
            return set()
        return {app for app in apps if self._line(app)}

    async def wait(self, app: str, messages: int) -> None:
        """Until the app is not held, with `messages` to store: its line is down to a
        quarter of the limit, or shorter by those messages than when the wait began (its
        stores go no faster than its deliveries), or MAX_HOLD ran out."""
        if not self.busy or self._loop is None:
            return
        first = line = self._line(app)
        if not line:
            return
        self._holding.add(app)
        self.held[app] += 1
        loop = asyncio.get_running_loop()
        give_up = loop.time() + MAX_HOLD
        while line and loop.time() < give_up:
            await asyncio.sleep(POLL)
            line = self._line(app) if self.busy else 0
            if line <= first - messages:
                return
        if line:  # (ran out MAX_HOLD)
            self._holding.discard(app)
            if line >= first:
                self._paused[app] = loop.time() + PAUSE
