"""Small asyncio helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("skmq")

T = TypeVar("T")


def spawn(coro: Coroutine[Any, Any, T], tasks: set[asyncio.Task[Any]]) -> asyncio.Task[T]:
    """Run coro as a task held in `tasks` until it ends (the loop keeps only weak ones)."""
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any]], timeout: float = 2.0, tries: int = 1
) -> None:
    """Cancel tasks and wait for them, bounded: on Python 3.11 a cancel() that coincides
    with an expiring asyncio.timeout() can be swallowed, so a wait must never be open-ended
    (the loops also check a stop flag of their own). `tries`: how many times a task
    still running is cancelled, `timeout` apart (a second cancel would cut short a task
    cleaning up after its first: only where nothing is to clean up)."""
    pending = {t for t in tasks if not t.done()}
    for _ in range(tries):
        if not pending:
            return
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=timeout)
    for task in pending:
        log.warning("task did not stop in time", task=task.get_name())


# unless_set: how often, and how long each time, it asks its coroutine to stop.
STOP_TRIES = 4
STOP_TRY_S = 0.5


async def unless_set(event: asyncio.Event, coro: Coroutine[Any, Any, None]) -> bool:
    """Run coro until it ends or `event` is set, whichever comes first: True if it ended
    (its exception raised), False if the event came first (coro cancelled, or left
    running if it would not stop).

    A coroutine can lose a cancel: redis-py's connect turns one into a ConnectionError,
    which a retry loop takes for a failure (broker.wait_for_redis, fixed there: under
    load, a stop while REDIS_WAIT pinged a silent Redis was lost one time in three). So
    one still running is cancelled again, every STOP_TRY_S, STOP_TRIES times at most."""
    task = asyncio.ensure_future(coro)
    set_ = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((task, set_), return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait([set_])
        await cancel_and_wait([task], STOP_TRY_S, STOP_TRIES)
    if not task.done() or task.cancelled():
        return False
    task.result()
    return True


async def listen_again(
    listen: Callable[[], Awaitable[None]],
    lost: tuple[type[BaseException], ...],
    what: str,
    logger: Any = log,
) -> None:
    """Run `listen` (a subscription's loop: a supervised task's body) again each time its
    connection is lost (one of `lost`), after a pause growing from 50 ms to 2 s, said on
    `logger`."""
    pause = 0.05
    while True:
        try:
            await listen()
        except lost as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # A stop that reached redis-py's connect comes out of it as a
                # ConnectionError: a stop all the same, not a loss (a broker kept
                # subscribing again after its SIGTERM, and never exited).
                raise asyncio.CancelledError from exc
            logger.warning(f"{what} lost, subscribing again", error=repr(exc), retry_in=pause)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2.0)
