"""skmq/aio.py: a stop that reaches a coroutine which loses a cancel (as redis-py's
connect can, redis/redis-py#2028) still stops it, or leaves it behind, in bounded time."""

from __future__ import annotations

import asyncio

import pytest

from skmq.aio import STOP_TRIES, STOP_TRY_S, listen_again, unless_set


async def test_a_coroutine_that_loses_the_first_cancel_is_cancelled_again() -> None:
    stop = asyncio.Event()
    lost: list[int] = []
    running = asyncio.Event()

    async def loses_one_cancel() -> None:
        running.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            lost.append(1)  # swallowed, as a racing library would
        await asyncio.Event().wait()

    waiting = asyncio.ensure_future(unless_set(stop, loses_one_cancel()))
    await running.wait()
    stop.set()
    assert await asyncio.wait_for(waiting, STOP_TRIES * STOP_TRY_S + 5) is False
    assert lost == [1]


async def test_a_coroutine_that_never_stops_is_left_behind_without_an_error() -> None:
    stop = asyncio.Event()
    release = asyncio.Event()
    cancels: list[int] = []
    running = asyncio.Event()

    async def never_stops() -> None:
        running.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                cancels.append(1)

    waiting = asyncio.ensure_future(unless_set(stop, never_stops()))
    await running.wait()
    stop.set()
    try:
        assert await asyncio.wait_for(waiting, STOP_TRIES * STOP_TRY_S + 5) is False
        assert len(cancels) == STOP_TRIES
    finally:
        release.set()


async def test_a_coroutine_that_ends_first_gives_its_result_or_its_error() -> None:
    async def fine() -> None:
        return None

    async def fails() -> None:
        raise ValueError("no")

    assert await unless_set(asyncio.Event(), fine()) is True
    with pytest.raises(ValueError, match="no"):
        await unless_set(asyncio.Event(), fails())


async def test_a_subscription_whose_cancel_comes_out_as_a_lost_connection_ends() -> None:
    """listen_again's loop ends on a cancel its listen turned into a lost connection (as
    redis-py's connect does), instead of subscribing again for ever."""
    listening = asyncio.Event()
    calls: list[int] = []

    async def listen() -> None:
        calls.append(1)
        listening.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ConnectionError("Connection closed by server.") from None

    task = asyncio.ensure_future(listen_again(listen, (ConnectionError,), "test"))
    await listening.wait()
    task.cancel()
    await asyncio.wait({task}, timeout=5)  # (wait_for would hang on a task that goes on)
    assert task.cancelled()
    assert calls == [1]
