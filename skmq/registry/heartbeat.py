"""Heartbeats: `ping` every HEARTBEAT_INTERVAL on a fresh connection, `pong` within
HEARTBEAT_TIMEOUT or the recipient is lost. One broker a round does it (a Redis lock),
so several brokers on one Redis do not ping each recipient several times over.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import structlog

from skmq.codec import PING, CodecError, Decoder, Frame

log = structlog.get_logger("skmq.heartbeat")


async def ping(host: str, port: int, timeout: float) -> bool:
    """True when host:port answers `pong` within timeout."""
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(PING)
            data = b""
            while b"\r\n\r\n" not in data and len(data) < 64:
                chunk = await reader.read(64)
                if not chunk:
                    break
                data += chunk
            frames = Decoder(max_frame_bytes=len(data) + 1).feed(data)
            return bool(frames) and isinstance(frames[0], Frame) and frames[0].type == "pong"
    except (OSError, TimeoutError, CodecError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


Target = tuple[str, str, str, int]  # app, recipient id, host, port


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
            alive = await ping(t[2], t[3], timeout)
        await report(t[0], t[1], alive)

    await asyncio.gather(*(one(t) for t in targets))
