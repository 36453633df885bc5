"""One connection to one Redis that carries the scripts of every caller, pipelined (the
store's: recipients and consumer groups, skmq/store/store.py).

redis-py's asyncio pipeline costs about 38 µs of the
broker's CPU a round trip on top of the socket work (a Pipeline object, a pooled
connection lent and taken back, a timer and a retry wrapper per reply): about half of
a round trip's CPU (`python -m bench.roundtrip_bench`). Here a round trip
is the packed commands (hiredis, C) written at once, a future, and the replies parsed
by hiredis as they arrive: callers share the connection, each one's replies come in
the order it was sent (Redis answers a connection in order), so no caller waits for
another's turn to write. Scripts block Redis while they run, so one connection is as
fast as many.

Only for `redis://` and `unix://` URLs (no TLS, no Sentinel, no cluster: those keep
redis-py's pipeline). Each call is bounded by the pool's `socket_timeout`: a call that
times out closes the connection (the replies still due on it would be out of step) and
fails every call waiting on it, as a dropped connection does; the next call connects
again. One timer a connection keeps that bound (not a timer a call): it fires at the
earliest deadline of the calls waiting when it was set. Nothing is sent twice: a caller
that sees an error decides (a producer is answered `error` and sends again,
deduplicated by msgid).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast

import hiredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelManagedConnection
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    ExecAbortError,
    MasterDownError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from skmq.store.client import RedisClient, hiredis_pack

Command = tuple[Any, ...]


@dataclass(slots=True)
class _Call:
    future: asyncio.Future[list[Any]]
    expected: int
    timeout: float | None
    deadline: float
    replies: list[Any] = field(default_factory=list)


# An error reply's first word: the class redis-py's own parser gives it (redis.exceptions),
# for what the store's callers tell apart (a script to load again, a replica, a full Redis).
_ERRORS: dict[str, type[RedisError]] = {
    "NOSCRIPT": NoScriptError,
    "READONLY": ReadOnlyError,
    "OOM": OutOfMemoryError,
    "LOADING": BusyLoadingError,
    "MASTERDOWN": MasterDownError,
    "NOPERM": NoPermissionError,
    "NOAUTH": AuthenticationError,
    "WRONGPASS": AuthenticationError,
    "EXECABORT": ExecAbortError,
    "TRYAGAIN": TryAgainError,
    "CLUSTERDOWN": ClusterDownError,
}


def _reply(value: Any) -> Any:
    """A reply as redis-py would return it: an error as its exception class, with the
    message after its code."""
    if not isinstance(value, hiredis.ReplyError):
        return value
    message = str(value)
    code, _, rest = message.partition(" ")
    if code in _ERRORS:
        return _ERRORS[code](rest)
    return ResponseError(rest if code == "ERR" else message)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = hiredis.Reader()
        self.waiting: deque[_Call] = deque()
        self.lost: Exception | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.due = float("inf")  # when the timer fires

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed(data)
            while (reply := self.parser.gets()) is not False:
                call = self.waiting[0]
                call.replies.append(_reply(reply))
                if len(call.replies) == call.expected:
                    self.waiting.popleft()
                    if not call.future.done():  # (a caller cancelled meanwhile)
                        call.future.set_result(call.replies)
        except (hiredis.ProtocolError, IndexError) as exc:  # garbage, or a reply unasked for
            self.close(RedisConnectionError(f"Redis protocol out of step: {exc!r}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.close(RedisConnectionError(f"Connection closed by Redis: {exc!r}"))

    def close(self, error: Exception) -> None:
        """Fail every call waiting here with `error`; the connection is not used again."""
        if self.lost is None:
            self.lost = error
        if self.transport is not None:
            # abort, not close: close keeps what waits to be written until Redis reads it,
            # and a stalled Redis may never (the memory of every batch sent meanwhile)
            self.transport.abort()
        if self.timer is not None:
            self.timer.cancel()
        while self.waiting:
            call = self.waiting.popleft()
            if not call.future.done():
                call.future.set_exception(error)

    def send(self, commands: list[Command], timeout: float | None) -> asyncio.Future[list[Any]]:
        """The replies of `commands`, written now, or RedisTimeoutError (closing the
        connection) if they are not all in `timeout` seconds from now."""
        assert self.transport is not None
        if self.lost is not None:
            raise self.lost
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.transport.write(b"".join(hiredis_pack(c) for c in commands))
        deadline = float("inf") if timeout is None else loop.time() + timeout
        self.waiting.append(_Call(future, len(commands), timeout, deadline))
        if deadline < self.due:
            self._arm(deadline)
        return future

    def _arm(self, due: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_at(due, self._expire)
        self.due = due

    def _expire(self) -> None:
        """A call waiting past its deadline closes the connection; else wait for the next."""
        self.timer, self.due = None, float("inf")
        if not self.waiting:
            return
        first = min(self.waiting, key=lambda c: c.deadline)
        if first.deadline <= asyncio.get_running_loop().time():
            self.close(RedisTimeoutError(f"Timeout reading from Redis after {first.timeout} s"))
        elif first.deadline != float("inf"):
            self._arm(first.deadline)


class MultiplexedConnection:
    """Pipelines of any number of callers on one lazily (re)connected connection.

    `options` are a redis-py pool's `connection_kwargs` for a plain TCP or unix socket
    connection: host and port or path, username, password, db, socket_timeout,
    socket_connect_timeout."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.timeout: float | None = options.get("socket_timeout")
        self.connect_timeout: float | None = options.get("socket_connect_timeout") or self.timeout
        self._protocol: _Protocol | None = None
        self._connecting = asyncio.Lock()

    async def pipeline(self, commands: list[Command]) -> list[Any]:
        """The replies of `commands`, sent in one write; an error reply is returned in its
        place as redis-py's exception, never raised. A lost or stalled connection raises
        redis-py's ConnectionError or TimeoutError."""
        protocol = self._protocol
        if protocol is None or protocol.lost is not None:
            protocol = await self._connect()
        return await protocol.send(commands, self.timeout)

    async def _connect(self) -> _Protocol:
        async with self._connecting:
            protocol = self._protocol
            if protocol is not None and protocol.lost is None:
                return protocol
            loop = asyncio.get_running_loop()
            o = self.options
            try:
                async with asyncio.timeout(self.connect_timeout):
                    if o.get("path"):
                        _, protocol = await loop.create_unix_connection(_Protocol, o["path"])
                    else:
                        host, port = o.get("host", "localhost"), o.get("port", 6379)
                        _, protocol = await loop.create_connection(_Protocol, host, port)
            except (OSError, TimeoutError) as exc:
                raise RedisConnectionError(f"Error connecting to Redis: {exc!r}") from exc
            self._protocol = protocol
            await self._handshake(protocol)
            return protocol

    async def _handshake(self, protocol: _Protocol) -> None:
        o = self.options
        commands: list[Command] = []
        if o.get("password"):
            who = (o["username"],) if o.get("username") else ()
            commands.append(("AUTH", *who, o["password"]))
        if o.get("db"):
            commands.append(("SELECT", o["db"]))
        if not commands:
            return
        replies = await protocol.send(commands, self.connect_timeout)
        error = next((r for r in replies if isinstance(r, Exception)), None)
        if error is not None:
            protocol.close(RedisConnectionError(str(error)))
            raise error

    def close(self) -> None:
        if self._protocol is not None:
            self._protocol.close(RedisConnectionError("Connection closed by the store"))


def multiplexed(redis: RedisClient) -> MultiplexedConnection | None:
    """A multiplexed connection to the Redis of `redis`, if it is one server reached by
    plain TCP or a unix socket (not TLS, Sentinel or a cluster)."""
    if isinstance(redis, RedisCluster):
        return None
    pool = redis.connection_pool
    kind = pool.connection_class
    if issubclass(kind, (SSLConnection, SentinelManagedConnection)) or not issubclass(
        kind, (Connection, UnixDomainSocketConnection)
    ):
        return None
    return MultiplexedConnection(dict(pool.connection_kwargs))
