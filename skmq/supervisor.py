"""One supervisor for every long-lived task of a broker (as an OTP supervisor does it).

A task that raises is logged with its name and traceback, counted, and started again
after a backoff (0.1 s doubling to 5 s, back to 0.1 s once it ran a while). A task that
fails more than `max_restarts` times within `window` seconds cannot be helped by
restarting: the supervisor calls `on_fatal` with a one-line reason, and the broker
stops (non-zero exit) rather than run half alive.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger("skmq.supervisor")

FIRST_BACKOFF = 0.1
MAX_BACKOFF = 5.0
# A task that ran this long before failing starts again from the first backoff.
STABLE_AFTER = 30.0


class Supervisor:
    def __init__(
        self,
        on_fatal: Callable[[str], None],
        max_restarts: int = 10,
        window: float = 60.0,
    ) -> None:
        self.on_fatal = on_fatal
        self.max_restarts = max_restarts
        self.window = window
        self.restarts: defaultdict[str, int] = defaultdict(int)
        self._recent: defaultdict[str, deque[float]] = defaultdict(deque)
        self.tasks: set[asyncio.Task[None]] = set()

    def recent_failures(self) -> dict[str, int]:
        """Failures within the window, by task (and its context, e.g. `dispatch/shop`)."""
        cutoff = time.monotonic() - self.window
        return {
            key: n for key, times in self._recent.items() if (n := sum(t >= cutoff for t in times))
        }

    def start(
        self, name: str, run: Callable[[], Awaitable[None]], **context: str
    ) -> asyncio.Task[None]:
        """Run `run()` as the supervised task `name` (a task that returns is done);
        cancelling the returned task stops it for good. `name` is the metric label, so
        one kind of task (a dispatcher) shares it; `context` (its app) goes in the logs."""
        task = asyncio.get_running_loop().create_task(
            self._supervise(name, run, context), name=f"skmq-{name}"
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _supervise(
        self, name: str, run: Callable[[], Awaitable[None]], context: dict[str, str]
    ) -> None:
        backoff = FIRST_BACKOFF
        key = "/".join((name, *context.values()))
        while True:
            started = time.monotonic()
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                now = time.monotonic()
                if now - started >= STABLE_AFTER:
                    backoff = FIRST_BACKOFF
                self.restarts[name] += 1
                recent = self._recent[key]
                recent.append(now)
                while recent and recent[0] < now - self.window:
                    recent.popleft()
                if len(recent) > self.max_restarts:
                    log.error(
                        "task keeps failing, stopping the broker",
                        task=name,
                        failures=len(recent),
                        window_s=self.window,
                        exc_info=True,
                        **context,
                    )
                    self.on_fatal(
                        f"task {name} failed {len(recent)} times in {self.window:g}s "
                        f"(last: {type(exc).__name__}: {exc})"
                    )
                    return
                log.error(
                    "task failed, restarting",
                    task=name,
                    restarts=self.restarts[name],
                    retry_in=backoff,
                    exc_info=True,
                    **context,
                )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)
