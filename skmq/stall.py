"""Stalls of the event loop (a long GC pause, SIGSTOP, a starved machine), and what must
wait out one.

A loop that wakes from a stall runs the timers that ran out meanwhile before it reads
its sockets (libuv and asyncio alike: timers first, then I/O). So a timer's verdict of
silence (a lease run out, a pong not come) may be wrong: the answer waits unread in a
socket. What acts on such silence asks StallWatch first, and lets a woken loop read its
sockets and apply what it read for SETTLE before it decides.
"""

from __future__ import annotations

import asyncio

from skmq.clock import now_ms

STALL = 0.05  # s: a timer this late may have ended a wait whose answer is unread
# s: a pause of the loop this long is a stall the watch settles from (a busy loop lags
# less: settling then would hold up long polls and reaping for nothing)
PAUSE = 0.5
SETTLE = 0.2  # s: after a stall, what waited in the sockets is read and applied by then
TICK = 0.1  # s: how often the watch looks
MAX_WAIT = 1.0  # s: a loop that stalls again and again still acts, this late at most


class StallWatch:
    """A timer every TICK that notes when it ran PAUSE or more late. `settling()` is true
    while the loop is in the turn that woke it from a stall (the watch's own timer not yet
    run) and for SETTLE after."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0
        self._ticked = 0.0  # (loop time) the watch's last look
        self._woke = float("-inf")
        self._stalled_from = 0.0  # (loop time) the last look before the last stall
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ticked = self._loop.time()
        self._due = self._ticked + TICK
        self._timer = self._loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        if self._woken(now):
            self._woke, self._stalled_from = now, self._ticked
        self._ticked = now
        self._due = now + TICK
        self._timer = self._loop.call_at(self._due, self._tick)

    def _woken(self, now: float) -> bool:
        """In the turn that woke the loop from a stall: the watch's own look not yet run."""
        return now - self._due >= PAUSE

    def settling(self) -> bool:
        if self._loop is None:
            return False
        now = self._loop.time()
        return self._woken(now) or now - self._woke < SETTLE

    async def settled(self) -> None:
        """Until the loop is not settling from a stall (MAX_WAIT at most)."""
        if not self.settling():
            return
        loop = asyncio.get_running_loop()
        give_up = loop.time() + MAX_WAIT
        while self.settling() and loop.time() < give_up:
            await asyncio.sleep(STALL)

    def answered_ms(self) -> int:
        """The time (store ms, as now_ms()) to judge an answer read now by: now; while the
        loop settles from a stall, when the stall began. The answer may have come at any
        moment of the stall: its sender must not lose a lease to the broker's pause. (A
        lease that someone ended meanwhile, another broker, is ended all the same: what
        judges an answer checks its attempt too.)"""
        now = now_ms()
        if self._loop is None or not self.settling():
            return now
        at = self._loop.time()
        began = self._ticked if self._woken(at) else self._stalled_from
        return now - int((at - began) * 1000)
