"""A broker woken from a stall (GC, SIGSTOP) reads what waits in its sockets before it
acts on the timers that ran out meanwhile: a pong that came during the stall keeps its
recipient alive."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from skmq.clock import now_ms
from skmq.registry.heartbeat import ping
from skmq.stall import StallWatch

PONG = b"type=pong\r\n\r\n"


@pytest.fixture
def recipient() -> Iterator[tuple[int, threading.Event]]:
    """A recipient that answers one ping with `pong` once told to (from its own thread,
    while the broker's loop may be stalled); its port and the telling event."""
    server = socket.create_server(("127.0.0.1", 0))
    go = threading.Event()

    def serve() -> None:
        conn, _ = server.accept()
        with conn, contextlib.suppress(OSError):  # (the broker may have hung up)
            conn.recv(64)
            go.wait(10)
            conn.sendall(PONG)
            conn.recv(64)  # (until the broker hangs up)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], go
    go.set()
    server.close()
    thread.join(10)


async def test_a_pong_that_came_during_a_stall_is_read(
    recipient: tuple[int, threading.Event],
) -> None:
    port, go = recipient
    loop = asyncio.get_running_loop()

    def stall() -> None:  # the loop stopped past the ping's timeout, the pong arriving
        go.set()
        time.sleep(0.6)

    loop.call_later(0.05, stall)
    assert await ping("127.0.0.1", port, 0.3)


async def test_a_recipient_that_never_answers_is_lost(
    recipient: tuple[int, threading.Event],
) -> None:
    port, _ = recipient
    assert not await ping("127.0.0.1", port, 0.2)


async def test_the_stall_watch_tells_a_stall_and_when_it_began() -> None:
    """A pause past PAUSE is a stall; a busy loop's shorter lag is not."""
    watch = StallWatch()
    watch.start()
    loop = asyncio.get_running_loop()
    try:
        assert not watch.settling()
        before = now_ms()
        stalled = loop.create_future()

        def stall() -> None:  # the loop stopped 0.7 s (past PAUSE)
            time.sleep(0.7)
            stalled.set_result(watch.settling())  # (woken, before the watch looks again)

        loop.call_later(0.01, stall)
        assert await stalled
        began = watch.answered_ms()
        assert abs(began - before) <= 150  # (when the stall began, not now)
        assert now_ms() - began >= 650
        await watch.settled()
        assert not watch.settling()
        assert now_ms() - watch.answered_ms() <= 5
        busy = loop.create_future()

        def lag() -> None:  # a busy loop's lag, not a stall
            time.sleep(0.2)
            busy.set_result(watch.settling())

        loop.call_later(0.01, lag)
        assert not await busy
    finally:
        watch.stop()
