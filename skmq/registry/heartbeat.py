"""Heartbeats: `ping` every HEARTBEAT_INTERVAL on a fresh connection, `pong` within
HEARTBEAT_TIMEOUT or the recipient is lost. One broker a round does it (a Redis lock),
so several brokers on one Redis do not ping each recipient several times over.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog

from skmq.codec import PING, CodecError, Decoder, Frame, encode_frame
from skmq.stall import STALL

log = structlog.get_logger("skmq.heartbeat")


async def ping(
    host: str, port: int, timeout: float, again: bool = True, names: tuple[str, str] | None = None
) -> bool:
    """True when host:port answers `pong` within timeout. `names`: the (app, recipient)
    the ping is for, said in it to a recipient of capability `identity`, which answers
    only a ping of its own registration (not another's that listened on its port).

    A broker woken from a stall (GC, SIGSTOP) meets the timers that ran out meanwhile
    before the sockets they were waiting on. A timeout that fired late by STALL or more
    is therefore not taken as the recipient's silence: a pong that came meanwhile is
    read, and a ping whose connection was being made is sent once more."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    writer: asyncio.StreamWriter | None = None
    received = bytearray()
    try:
        async with asyncio.timeout_at(deadline):
            reader, writer = await asyncio.open_connection(host, port)
            named = names and {"appid": names[0], "recipient": names[1]}
            writer.write(encode_frame("ping", named) if named else PING)
            return await _pong(reader, received)
    except TimeoutError:
        if loop.time() - deadline < STALL:
            return False  # the recipient's silence
        if writer is None:
            return again and await ping(host, port, timeout, again=False, names=names)
        try:
            async with asyncio.timeout(STALL):
                return await _pong(reader, received)
        except (OSError, TimeoutError, CodecError):
            return False
    except (OSError, CodecError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _pong(reader: asyncio.StreamReader, received: bytearray) -> bool:
    """Read one frame's worth (into `received`, kept across a timeout) and tell a pong."""
    while b"\r\n\r\n" not in received and len(received) < 64:
        chunk = await reader.read(64)
        if not chunk:
            break
        received += chunk
    frames = Decoder(max_frame_bytes=len(received) + 1).feed(bytes(received))
    return bool(frames) and isinstance(frames[0], Frame) and frames[0].type == "pong"


# app, recipient id, host, port, whether the ping names them (capability `identity`)
Target = tuple[str, str, str, int, bool]


async def heartbeat_round(
    targets: list[Target],
    timeout: float,
    report: Callable[[str, str, bool], Awaitable[None]],
    concurrency: int,
) -> None:
    """Ping every target, at most `concurrency` at once (HEARTBEAT_CONCURRENCY: each ping
    holds a connection, and recipients that never answer hold theirs for `timeout`)."""
    slots = asyncio.Semaphore(concurrency)

    async def one(t: Target) -> None:
        async with slots:
            alive = await ping(t[2], t[3], timeout, names=(t[0], t[1]) if t[4] else None)
        await report(t[0], t[1], alive)

    await asyncio.gather(*(one(t) for t in targets))
