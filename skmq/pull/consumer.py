"""A pull consumer, for consumers that cannot listen on a port: over the HTTP gateway
(docs/HTTP.md), or over the broker's TCP port with the `pull` frame (docs/PROTOCOL.md):

    async with PullConsumer("http://127.0.0.1:1735", "orders", "billing") as consumer:
        async for msg in consumer:
            async with msg.leased():      # the lease is extended while this block runs
                handle(msg.content)
            await msg.ack()               # or: await msg.nack(delay_ms=5000)

`PullConsumer("tcp://127.0.0.1:1734", ...)` does the same over TCP (one connection; a
long poll holds it, so it serves this consumer only). HTTP needs aiohttp (the `server`
extra); TCP needs nothing more than the client."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from skmq.client import Producer

if TYPE_CHECKING:
    import aiohttp

# Connecting and creating the group, at most (a gateway that accepts and never answers).
START_TIMEOUT = 10.0


class PullError(RuntimeError):
    """The broker refused a call: the HTTP status that fits (over TCP too) and one line."""

    def __init__(self, status: int, error: str) -> None:
        super().__init__(f"{status}: {error}")
        self.status = status
        self.error = error


@dataclass(slots=True, eq=False)
class PulledMessage:
    msgid: str
    content: bytes
    kind: str
    attempt: int
    receipt: str
    consumer: PullConsumer = field(repr=False)

    async def ack(self) -> bool:
        """True when settled; False for a stale receipt (the lease ran out)."""
        return await self.consumer.settle("ack", self.receipt) == "acked"

    async def nack(self, delay_ms: int | None = None) -> str:
        """A failed attempt: `retry` (after delay_ms, or the broker's backoff), `dead`, or
        `stale`."""
        extra = {} if delay_ms is None else {"delay": delay_ms}
        return await self.consumer.settle("nack", self.receipt, **extra)

    async def extend(self, seconds: float) -> bool:
        return await self.consumer.settle("extend", self.receipt, visibility=seconds) == "extended"

    @contextlib.asynccontextmanager
    async def leased(self) -> AsyncIterator[None]:
        """Extend the lease every half visibility while the block runs."""
        every = self.consumer.visibility / 2

        async def keep() -> None:
            while True:
                await asyncio.sleep(every)
                if not await self.extend(self.consumer.visibility):
                    return

        task = asyncio.create_task(keep())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, PullError, *self.consumer.errors):
                await task


class PullConsumer:
    def __init__(
        self,
        gateway: str,
        app: str,
        group: str,
        *,
        token: str | None = None,
        batch: int = 10,
        wait: float = 20.0,
        visibility: float = 30.0,
        create_group: bool = True,
    ) -> None:
        self.base = f"{gateway.rstrip('/')}/v1/apps/{app}/groups"
        self.app = app
        self.group = group
        self.token = token
        where = urlsplit(gateway)
        self._tcp = where.scheme == "tcp"
        self._address = (where.hostname or "127.0.0.1", where.port or 1734)
        self._broker: Producer | None = None
        self.batch = batch
        self.wait = wait
        self.visibility = visibility
        self.create_group = create_group
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._buffer: deque[PulledMessage] = deque()
        self._session: aiohttp.ClientSession | None = None
        # What a call may raise when the broker cannot be reached (HTTP adds aiohttp's).
        self.errors: tuple[type[Exception], ...] = (OSError,)

    async def __aenter__(self) -> PullConsumer:
        """Connect and create the group, within START_TIMEOUT (TimeoutError)."""
        try:
            async with asyncio.timeout(START_TIMEOUT):
                if self._tcp:
                    host, port = self._address
                    # settles and extensions wait behind a long poll on one connection
                    self._broker = Producer(host, port, token=self.token)
                    await self._broker.connect()
                else:
                    import aiohttp

                    timeout = aiohttp.ClientTimeout(total=self.wait + 30)
                    self._session = aiohttp.ClientSession(timeout=timeout, headers=self._headers)
                    self.errors = (OSError, aiohttp.ClientError)
                if self.create_group:
                    await self._call("create", {"group": self.group})
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._broker is not None:
            await self._broker.close()
            self._broker = None

    async def _call(self, op: str, body: dict[str, Any]) -> Any:
        """One operation (create, receive, ack, nack, extend) over HTTP or TCP."""
        if self._broker is not None:
            fields = (("appid", self.app), ("group", self.group), ("op", op))
            resp = await self._broker.request("pull", fields, json.dumps(body).encode())
            if resp.ok:
                return json.loads(resp.content)
            code, _, why = resp.content.partition(" ")
            # a refusal without the gateway's status first
            if not (code.isascii() and code.isdigit()):
                code, why = "503", resp.content
            raise PullError(int(code), why)
        if self._session is None:
            raise RuntimeError("use `async with PullConsumer(...)`")
        url = self.base if op == "create" else f"{self.base}/{self.group}/{op}"
        async with self._session.post(url, json=body) as response:
            answer = await response.json(content_type=None)
            if response.status >= 300:
                raise PullError(response.status, str(answer.get("error", answer)))
            return answer

    async def settle(self, verb: str, receipt: str, **extra: Any) -> str:
        answer = await self._call(verb, {"receipts": [receipt], **extra})
        status: str = answer["results"][0]["status"]
        return status

    async def receive(self) -> list[PulledMessage]:
        """One receive: up to `batch` messages, waiting up to `wait` seconds."""
        body = {"max": self.batch, "wait": self.wait, "visibility": self.visibility}
        answer = await self._call("receive", body)
        out = []
        for m in answer["messages"]:
            text: str = m["content"]
            raw = base64.b64decode(text) if m["encoding"] == "base64" else text.encode()
            out.append(PulledMessage(m["msgid"], raw, m["kind"], m["attempt"], m["receipt"], self))
        return out

    def __aiter__(self) -> PullConsumer:
        return self

    async def __anext__(self) -> PulledMessage:
        while not self._buffer:
            self._buffer.extend(await self.receive())
        return self._buffer.popleft()
