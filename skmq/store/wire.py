"""A lean Redis connection for the owner's hot path: commands packed by hiredis, replies
parsed by hiredis's Reader, both through their public API, in an asyncio Protocol.

Why not redis-py's connection: it spends a task, a timer and a lock a command, and its
speed-ups reach into private attributes that change between its major versions. Here a
call is one write and one future; several calls made in one loop turn are pipelined on
the one connection, their replies matched in order. A caller that stops waiting (a
timeout, a cancel) does not desynchronise the stream: its reply is read and dropped.

Connection set-up (the URL, AUTH, SELECT, TLS) uses redis-py's public `parse_url`, so
the URLs mean what they mean everywhere else in SKMQ.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Sequence
from typing import Any, cast

import hiredis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url
from redis.exceptions import RedisError

Command = Sequence[bytes | str | int | float]


class ReplyError(RedisError):  # type: ignore[misc]
    """An error reply of Redis (`-ERR ...`, `-NOSCRIPT ...`, `-MOVED ...`, `-OOM ...`),
    as a value or raised. A RedisError, as redis-py's own error replies are: whatever
    handles the store's trouble handles it (a MOVED after a failover, an OOM of a full
    Redis killed the task settling an app's answers, which then went unanswered)."""

    @property
    def code(self) -> str:
        return str(self).split(" ", 1)[0]


class WireClosed(ConnectionError):
    """The connection was closed or lost before its reply came."""


class WireNotSent(WireClosed):
    """The connection was closed before the command was written: it did not run."""


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader(replyError=ReplyError)
        self.waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's: no subclass)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiting = self.waiting
        try:
            while (reply := self.reader.gets()) is not False:
                future = waiting.popleft()
                if not future.done():  # (a caller that stopped waiting: dropped)
                    future.set_result(reply)
                if isinstance(reply, ReplyError) and reply.code == "READONLY":
                    self._demoted()
        except (hiredis.ProtocolError, IndexError) as exc:  # not RESP, or unasked for
            self.lost = WireClosed(f"the server broke the protocol: {exc!r}")
            if self.transport is not None:
                self.transport.abort()

    def _demoted(self) -> None:
        """The server is a replica now (a Sentinel failover demoted it): the connection
        is closed, so that its owners let their apps go and the next connection asks
        for the master again (skmq/store/wires.py)."""
        if self.transport is not None and not self.transport.is_closing():
            self.lost = WireClosed("the server is a read-only replica now")
            self.transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = exc or self.lost or WireClosed("connection closed by the server")
        self.transport = None
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(WireClosed(str(self.lost)))


class Wire:
    """One connection to one Redis server. `await call(...)` returns the reply (an error
    reply is raised as ReplyError); `call_many` sends several commands in one write."""

    def __init__(self, protocol: _Protocol, address: str, url: str = "") -> None:
        self._protocol = protocol
        self.address = address
        self.url = url  # (what `connect` was given: another connection to this server)

    @classmethod
    async def connect(cls, url: str, timeout: float = 2.0) -> Wire:
        """Connect to the server `url` names (redis://, rediss://, unix://)."""
        options = parse_url(url)
        loop = asyncio.get_running_loop()
        connection_class = options.get("connection_class")
        async with asyncio.timeout(timeout):
            if connection_class is UnixDomainSocketConnection:
                path = options["path"]
                _, protocol = await loop.create_unix_connection(_Protocol, path)
                address = path
            else:
                host, port = options.get("host", "localhost"), int(options.get("port", 6379))
                tls = ssl.create_default_context() if connection_class is SSLConnection else None
                _, protocol = await loop.create_connection(
                    _Protocol, host, port, ssl=tls, server_hostname=host if tls else None
                )
                address = f"{host}:{port}"
            wire = cls(protocol, address, url)
            try:
                password = options.get("password")
                if password:
                    username = options.get("username")
                    await wire.call("AUTH", *([username] if username else []), password)
                if options.get("db"):
                    await wire.call("SELECT", int(options["db"]))
            except BaseException:
                wire.close()
                raise
        return wire

    @property
    def closed(self) -> bool:
        transport = self._protocol.transport
        return transport is None or transport.is_closing()

    def _send(self, payload: bytes, n: int) -> list[asyncio.Future[Any]]:
        protocol = self._protocol
        if protocol.transport is None or protocol.transport.is_closing():
            raise WireNotSent(str(protocol.lost or "connection closed"))
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(n)]
        protocol.waiting.extend(futures)
        protocol.transport.write(payload)
        return futures

    async def call(self, *args: bytes | str | int | float) -> Any:
        (future,) = self._send(_pack(args), 1)
        return _raised(await future)

    async def call_many(self, commands: Sequence[Command]) -> list[Any]:
        """Every command's reply, in order; an error reply stays a ReplyError value.
        (gather: when the connection is lost, each reply's failure is read, not only the
        first; else asyncio logs the others as never retrieved.)"""
        payload = b"".join(_pack(c) for c in commands)
        futures = self._send(payload, len(commands))
        return list(await asyncio.gather(*futures))

    def close(self) -> None:
        transport = self._protocol.transport
        if transport is not None:
            self._protocol.lost = self._protocol.lost or WireClosed("connection closed here")
            transport.close()


def _pack(command: Command) -> bytes:
    # (hiredis's stub types its argument as a 1-tuple; any tuple of arguments is meant)
    packed: bytes = hiredis.pack_command(tuple(command))  # type: ignore[arg-type]
    return packed


def _raised(reply: Any) -> Any:
    if isinstance(reply, ReplyError):
        raise reply
    return reply
