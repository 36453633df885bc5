"""Small asyncio helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
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


async def cancel_and_wait(tasks: Iterable[asyncio.Task[None]], timeout: float = 2.0) -> None:
    """Cancel tasks and wait for them, bounded: on Python 3.11 a cancel() that coincides
    with an expiring asyncio.timeout() can be swallowed, so a wait must never be open-ended
    (the loops also check a stop flag of their own)."""
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        _, still = await asyncio.wait(pending, timeout=timeout)
        for task in still:
            log.warning("task did not stop in time", task=task.get_name())
