"""A pull consumer over the HTTP gateway (docs/HTTP.md), for consumers that cannot listen
on a port:

    async with PullConsumer("http://127.0.0.1:1735", "orders", "billing") as consumer:
        async for msg in consumer:
            async with msg.leased():      # the lease is extended while this block runs
                handle(msg.content)
            await msg.ack()               # or: await msg.nack(delay_ms=5000)

Needs aiohttp (the `server` extra)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp


class PullError(RuntimeError):
    """The gateway refused a call: its status and one-line error."""

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
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError, PullError):
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
        self.group = group
        self.batch = batch
        self.wait = wait
        self.visibility = visibility
        self.create_group = create_group
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._buffer: deque[PulledMessage] = deque()
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> PullConsumer:
        timeout = aiohttp.ClientTimeout(total=self.wait + 30)
        self._session = aiohttp.ClientSession(timeout=timeout, headers=self._headers)
        if self.create_group:
            await self._post(self.base, {"group": self.group})
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, url: str, body: dict[str, Any]) -> Any:
        if self._session is None:
            raise RuntimeError("use `async with PullConsumer(...)`")
        async with self._session.post(url, json=body) as response:
            answer = await response.json(content_type=None)
            if response.status >= 300:
                raise PullError(response.status, str(answer.get("error", answer)))
            return answer

    async def settle(self, verb: str, receipt: str, **extra: Any) -> str:
        url = f"{self.base}/{self.group}/{verb}"
        answer = await self._post(url, {"receipts": [receipt], **extra})
        status: str = answer["results"][0]["status"]
        return status

    async def receive(self) -> list[PulledMessage]:
        """One receive: up to `batch` messages, waiting up to `wait` seconds."""
        body = {"max": self.batch, "wait": self.wait, "visibility": self.visibility}
        answer = await self._post(f"{self.base}/{self.group}/receive", body)
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
