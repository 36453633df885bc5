"""A pull consumer, for consumers that cannot listen on a port: over the HTTP gateway
(docs/HTTP.md), or over the broker's TCP port with the `pull` frame (docs/PROTOCOL.md):

    async with PullConsumer("http://127.0.0.1:1735", "orders", "billing") as consumer:
        async for msg in consumer:
            async with msg.leased():      # the lease is extended while this block runs
                handle(msg.content)
            msg.ack()                     # or: msg.nack(delay_ms=5000)

or a batch at a time, settled in one request:

        while True:
            msgs = await consumer.receive()   # up to `batch` (default 100, the broker's cap)
            ...
            consumer.ack_all(msgs)            # or consumer.nack_all(msgs, delay_ms=5000)

Settling is batched either way: the broker takes 1 to 1,000 receipts an ack, nack or
extend, and the acks (nacks with one delay) made in one event-loop turn go in one
request. `msg.ack()`, `msg.nack()` and their `_all` forms send without waiting (as a
NATS JetStream consumer's `msg.ack()` does; a batch's ack then goes with the next
receive): `async for` hands out a received batch without a turn of
the event loop, so a batch handled without awaiting is acked in one request. Each call
returns its message's outcome, to await where it matters (`await msg.ack()`: True, or
False for a stale receipt); an ack awaited before the next message is taken is a
request of its own. Acks sent and not answered yet are awaited when the consumer closes;
messages received and not handed out yet (a loop left early) are nacked then, with no
delay, for the group to hand them out again at once.

`PullConsumer("tcp://127.0.0.1:1734", ...)` does the same over TCP, on two connections
of its own: receives on one (a long poll holds its answers), settles on the other (an
ack is answered while a receive waits). HTTP needs aiohttp (the `server` extra); TCP
needs nothing more than the client."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar
from urllib.parse import urlsplit

from skmq import tracing
from skmq.client import Producer
from skmq.coalesce import Coalescer
from skmq.pull.position import parse_position

if TYPE_CHECKING:
    import aiohttp

T = TypeVar("T")
U = TypeVar("U")

# Connecting and creating the group, at most (a gateway that accepts and never answers).
START_TIMEOUT = 10.0
# Closing waits this long at most for the settles still being answered.
CLOSE_TIMEOUT = 10.0
# Messages a receive asks for by default: the broker's cap unless configured otherwise
# (PULL_MAX_MESSAGES; asking more is refused, 400).
DEFAULT_BATCH = 100
# How the broker refuses a receive asking more than its cap.
OVER_THE_CAP = re.compile(r"max: at most (\d+) \(PULL_MAX_MESSAGES\)")
# Receipts one ack, nack or extend may carry (the broker's limit); more go in several.
MAX_RECEIPTS = 1000


class PullError(RuntimeError):
    """The broker refused a call: the HTTP status that fits (over TCP too) and one line."""

    def __init__(self, status: int, error: str) -> None:
        super().__init__(f"{status}: {error}")
        self.status = status
        self.error = error


class NotAGateway(ConnectionError):
    """The gateway's address answers, but not HTTP (the broker's protocol port, say) or
    not SKMQ's JSON."""


@dataclass(slots=True, eq=False)
class PulledMessage:
    msgid: str
    content: bytes
    kind: str
    attempt: int
    receipt: str
    consumer: PullConsumer = field(repr=False)
    # When the lease runs out, on the event loop's clock (as far as this client knows).
    lease_ends: float = field(default=0.0, repr=False)
    trace: str = field(default="", repr=False)  # its W3C traceparent, if it has one

    def ack(self) -> asyncio.Future[bool]:
        """Settle it, sent with the other settles of this event-loop turn whether or not
        it is awaited; the outcome: True when settled, False for a stale receipt (the
        lease ran out)."""
        return _then(self.consumer._settle_soon("ack", self.receipt, {}), _acked)

    def nack(self, delay_ms: int | None = None) -> asyncio.Future[str]:
        """A failed attempt, sent as ack() is (with the nacks of the same delay); the
        outcome: `retry` (after delay_ms, or the broker's backoff), `dead`, or `stale`."""
        return self.consumer._settle_soon("nack", self.receipt, _nack_args(delay_ms))

    async def extend(self, seconds: float) -> bool:
        """Lease it for `seconds` from now; False for a stale receipt."""
        return (await self.consumer.extend_all([self], seconds))[0]

    @contextlib.asynccontextmanager
    async def leased(self) -> AsyncIterator[None]:
        """Its lease extended while the block runs (by the consumer's one keeper, every
        half visibility, with the others held so: no task, no request a message)."""
        self.consumer._hold(self)
        try:
            yield
        finally:
            self.consumer._held.discard(self)


def _acked(status: str) -> bool:
    return status == "acked"


def _nack_args(delay_ms: int | None) -> dict[str, Any]:
    return {} if delay_ms is None else {"delay": delay_ms}


def _retrieved(outcome: asyncio.Future[Any]) -> None:
    if not outcome.cancelled():
        outcome.exception()


def _then(first: asyncio.Future[T], fn: Callable[[T], U]) -> asyncio.Future[U]:
    """fn of `first`'s result, once it has one (its failure or cancellation as it is). A
    failure nobody awaits is not reported, as a settle's is not (_settle_soon)."""
    then: asyncio.Future[U] = asyncio.get_running_loop().create_future()
    then.add_done_callback(_retrieved)

    def done(_: asyncio.Future[T]) -> None:
        if then.done():
            return
        if first.cancelled():
            then.cancel()
        elif (exc := first.exception()) is not None:
            then.set_exception(exc)
        else:
            then.set_result(fn(first.result()))

    first.add_done_callback(done)
    return then


class _Settle(NamedTuple):
    """One receipt to settle, waiting for the end of the event-loop turn."""

    verb: str
    args: tuple[tuple[str, Any], ...]  # the request's other fields (nack's delay, ...)
    receipt: str
    outcome: asyncio.Future[str]


class PullConsumer:
    """Receives up to `batch` messages a request, each leased for `visibility` seconds;
    `async for` hands them out one by one, extending the leases of those still waiting
    in one request once they are half gone. Without `batch`: DEFAULT_BATCH (100), the
    broker's default PULL_MAX_MESSAGES, or the broker's own cap when it says it is lower
    (a `batch` above the cap is refused: PullError 400). With `create_group`, a group
    that does not exist yet is made, reading from `position` (skmq/pull/position.py:
    "latest", "earliest", unix ms or an ISO-8601 time with its offset; BadPosition for
    another); a group that exists keeps its place."""

    def __init__(
        self,
        gateway: str,
        app: str,
        group: str,
        *,
        token: str | None = None,
        batch: int | None = None,
        wait: float = 20.0,
        visibility: float = 30.0,
        create_group: bool = True,
        position: str | int = "latest",
    ) -> None:
        self.gateway = gateway.rstrip("/")
        self.base = f"{self.gateway}/v1/apps/{app}/groups"
        self.app = app
        self.group = group
        self.token = token
        where = urlsplit(gateway)
        self._tcp = where.scheme == "tcp"
        self._address = (where.hostname or "127.0.0.1", where.port or 1734)
        # over TCP: receives (a long poll holds its connection's answers) and settles, on
        # a connection each: an ack is answered while a receive waits
        self._broker: Producer | None = None
        self._settler: Producer | None = None
        self.batch = DEFAULT_BATCH if batch is None else batch
        self._batch_given = batch is not None
        self.wait = wait
        self.visibility = visibility
        self.create_group = create_group
        self.position = parse_position(position)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._buffer: deque[PulledMessage] = deque()
        self._session: aiohttp.ClientSession | None = None
        # What a call may raise when the broker cannot be reached (HTTP adds aiohttp's).
        self.errors: tuple[type[Exception], ...] = (OSError,)
        self._settles: Coalescer[_Settle] = Coalescer(self._send_settles)
        self._settling: set[asyncio.Task[None]] = set()
        # messages in `leased()` blocks, and the task that extends their leases
        self._held: set[PulledMessage] = set()
        self._keeper: asyncio.Task[None] | None = None
        self._keeper_due = 0.0  # (the loop's time) when the keeper looks again
        self._keeper_wake = asyncio.Event()

    async def __aenter__(self) -> PullConsumer:
        """Connect and create the group, within START_TIMEOUT (TimeoutError)."""
        try:
            async with asyncio.timeout(START_TIMEOUT):
                if self._tcp:
                    host, port = self._address
                    self._broker = Producer(host, port, token=self.token)
                    self._settler = Producer(host, port, token=self.token)
                    await asyncio.gather(self._broker.connect(), self._settler.connect())
                else:
                    import aiohttp

                    timeout = aiohttp.ClientTimeout(total=self.wait + 30)
                    self._session = aiohttp.ClientSession(timeout=timeout, headers=self._headers)
                    self.errors = (OSError, aiohttp.ClientError)
                if self.create_group:
                    await self._call("create", self._new_group())
        except BaseException:
            await self.__aexit__()
            raise
        return self

    def _new_group(self) -> dict[str, Any]:
        """The create's body (latest, the default, is not said: a broker from before
        positions refuses the field)."""
        body: dict[str, Any] = {"group": self.group}
        if self.position != "latest":
            body["position"] = self.position
        return body

    async def __aexit__(self, *exc: object) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None
        # Received and never handed out (a loop left early): nacked with no wait, for the
        # group to hand them out again now rather than when their leases run out. The
        # attempt counts either way, as a JetStream message fetched and not acked does.
        while self._buffer:
            self._buffer.popleft().nack(delay_ms=0)
        self._settles.flush()  # settles asked for just before: sent, and answered
        if self._settling:
            await asyncio.wait(self._settling, timeout=CLOSE_TIMEOUT)
            for task in list(self._settling):  # (no answer: their callers are cancelled)
                task.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None
        for broker in (self._broker, self._settler):
            if broker is not None:
                await broker.close()
        self._broker = self._settler = None

    async def _call(self, op: str, body: dict[str, Any]) -> Any:
        """One operation (create, receive, ack, nack, extend) over HTTP or TCP."""
        broker = self._broker if op in ("create", "receive") else self._settler
        if broker is not None:
            fields = (("appid", self.app), ("group", self.group), ("op", op))
            resp = await broker.request("pull", fields, json.dumps(body).encode())
            if resp.ok:
                return json.loads(resp.content)
            code, _, why = resp.content.partition(" ")
            # a refusal without the gateway's status first
            if not (code.isascii() and code.isdigit()):
                code, why = "503", resp.content
            raise PullError(int(code), why)
        if self._session is None:
            raise RuntimeError("use `async with PullConsumer(...)`")
        import aiohttp

        url = self.base if op == "create" else f"{self.base}/{self.group}/{op}"
        try:
            async with self._session.post(url, json=body) as response:
                answer = await response.json(content_type=None)
        except aiohttp.ClientResponseError:  # (no answer is this: an answer that is not HTTP)
            address = urlsplit(self.gateway).netloc.rpartition("@")[2]
            raise NotAGateway(
                f"{self.gateway} does not answer HTTP (the broker's protocol port? "
                f"use tcp://{address} for that)"
            ) from None
        except ValueError:  # not JSON (json.JSONDecodeError)
            raise NotAGateway(f"{self.gateway} does not answer as SKMQ's HTTP gateway") from None
        if response.status >= 300:
            raise PullError(response.status, str(answer.get("error", answer)))
        return answer

    async def settle(self, verb: str, receipt: str, **extra: Any) -> str:
        """ack, nack or extend one receipt (extra: the request's other fields); its status.
        The settles of one verb and the same fields asked for in one event-loop turn go
        in one request."""
        return await self._settle_soon(verb, receipt, extra)

    def _settle_soon(self, verb: str, receipt: str, extra: dict[str, Any]) -> asyncio.Future[str]:
        """The settle, sent at the end of this event-loop turn; its status. (A failure
        nobody awaits is not reported as an exception never retrieved: an unsettled
        message comes back once its lease runs out.)"""
        outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        outcome.add_done_callback(_retrieved)
        self._settles.add(_Settle(verb, tuple(sorted(extra.items())), receipt, outcome))
        return outcome

    # -- leases kept while messages are handled (PulledMessage.leased) ---------------
    def _hold(self, msg: PulledMessage) -> None:
        self._held.add(msg)
        due = msg.lease_ends - self.visibility / 2
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.get_running_loop().create_task(self._keep_leases())
        elif due < self._keeper_due:
            self._keeper_wake.set()

    async def _keep_leases(self) -> None:
        """While messages are held, extend in one request those whose lease is half gone;
        a message whose receipt went stale is held no longer (its lease cannot come back).
        A request that failed is tried again a quarter visibility later."""
        loop = asyncio.get_running_loop()
        half = self.visibility / 2
        errors: tuple[type[Exception], ...] = (PullError, *self.errors)
        while self._held:
            now = loop.time()
            again: float | None = None
            if due := [m for m in self._held if m.lease_ends - now <= half]:
                try:
                    kept = await self.extend_all(due, self.visibility)
                except errors:
                    again = loop.time() + half / 2
                else:
                    stale = (m for m, ok in zip(due, kept, strict=True) if not ok)
                    self._held.difference_update(stale)
            if not self._held:
                break
            self._keeper_due = again or min(m.lease_ends for m in self._held) - half
            self._keeper_wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, self._keeper_due - loop.time())):
                    await self._keeper_wake.wait()

    def _send_settles(self, settles: list[_Settle]) -> None:
        """The turn is over: one request for each verb and its fields (MAX_RECEIPTS
        receipts at most a request)."""
        calls: dict[tuple[str, tuple[tuple[str, Any], ...]], list[_Settle]] = {}
        for s in settles:
            calls.setdefault((s.verb, s.args), []).append(s)
        loop = asyncio.get_running_loop()
        for batch in calls.values():
            for start in range(0, len(batch), MAX_RECEIPTS):
                task = loop.create_task(self._settle_batch(batch[start : start + MAX_RECEIPTS]))
                self._settling.add(task)  # (held: the loop keeps only weak references)
                task.add_done_callback(self._settling.discard)

    async def _settle_batch(self, batch: list[_Settle]) -> None:
        """Answer each settle of the batch with its receipt's status, or with the error
        that refused or lost the whole request."""
        try:
            answer = await self._call(
                batch[0].verb, {"receipts": [s.receipt for s in batch], **dict(batch[0].args)}
            )
            statuses = [str(r["status"]) for r in answer["results"]]
            if len(statuses) != len(batch):
                raise PullError(502, f"{len(statuses)} results for {len(batch)} receipts")
        except Exception as exc:
            for s in batch:
                if not s.outcome.done():  # (its caller may have been cancelled)
                    s.outcome.set_exception(exc)
            return
        except asyncio.CancelledError:  # (the loop closing): so are its callers
            for s in batch:
                s.outcome.cancel()
            raise
        for s, status in zip(batch, statuses, strict=True):
            if not s.outcome.done():
                s.outcome.set_result(status)

    def _settle_all(
        self, verb: str, messages: Iterable[PulledMessage], **extra: Any
    ) -> asyncio.Future[list[str]]:
        """Each message's settle, sent with the other settles of this event-loop turn
        (as msg.ack() is); their statuses, in order, or the first failure."""
        outcomes = [m.consumer._settle_soon(verb, m.receipt, extra) for m in messages]
        if not outcomes:
            nothing: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
            nothing.set_result([])
            return nothing
        return _then(asyncio.gather(*outcomes), lambda statuses: [str(s) for s in statuses])

    def ack_all(self, messages: Iterable[PulledMessage]) -> asyncio.Future[list[bool]]:
        """Ack these messages in one request (a request a MAX_RECEIPTS), sent at the end
        of this event-loop turn whether or not it is awaited, as msg.ack() is: not
        awaited, a batch's ack goes with the next receive. The outcome: for each message,
        in order, True when settled, False for a stale receipt; a refusal (PullError) or
        a lost broker raises, as ack() does."""
        return _then(self._settle_all("ack", messages), lambda ss: [_acked(s) for s in ss])

    def nack_all(
        self, messages: Iterable[PulledMessage], delay_ms: int | None = None
    ) -> asyncio.Future[list[str]]:
        """nack() for each message, in one request sent as ack_all's is: `retry`, `dead`
        or `stale` each."""
        return self._settle_all("nack", messages, **_nack_args(delay_ms))

    def extend_all(
        self, messages: Iterable[PulledMessage], seconds: float
    ) -> asyncio.Future[list[bool]]:
        """Lease each message for `seconds` from now, in one request sent as ack_all's
        is; False: stale."""
        held = list(messages)
        ends = asyncio.get_running_loop().time() + seconds  # (before asking: on the safe side)

        def extended(statuses: list[str]) -> list[bool]:
            for msg, status in zip(held, statuses, strict=True):
                if status == "extended":
                    msg.lease_ends = ends
            return [status == "extended" for status in statuses]

        return _then(self._settle_all("extend", held, visibility=seconds), extended)

    async def receive(self) -> list[PulledMessage]:
        """One receive: up to `batch` messages, waiting up to `wait` seconds."""
        body = {"max": self.batch, "wait": self.wait, "visibility": self.visibility}
        ends = asyncio.get_running_loop().time() + self.visibility
        try:
            answer = await self._call("receive", body)
        except PullError as exc:
            cap = OVER_THE_CAP.match(exc.error) if not self._batch_given else None
            if cap is None or int(cap[1]) >= self.batch:
                raise
            self.batch = int(cap[1])  # a broker with a lower PULL_MAX_MESSAGES: its cap
            return await self.receive()
        out = []
        for m in answer["messages"]:
            text: str = m["content"]
            raw = base64.b64decode(text) if m["encoding"] == "base64" else text.encode()
            msg = PulledMessage(m["msgid"], raw, m["kind"], m["attempt"], m["receipt"], self, ends)
            if trace := m.get("traceparent"):
                msg.trace = self._received(trace, msg.msgid)
            out.append(msg)
        return out

    def _received(self, parent: str, msgid: str) -> str:
        """With tracing on, a `skmq receive` span (a child of the broker's `skmq pull`):
        its traceparent, the parent for the handling of the message."""
        if tracing.tracer is None:
            return parent
        span = tracing.start("receive", parent, self.app, msgid, **{tracing.GROUP: self.group})
        span.end()
        return tracing.traceparent(span)

    @property
    def buffered(self) -> int:
        """Messages received and not handed out yet: `async for` hands out the next of
        them without waiting for the broker."""
        return len(self._buffer)

    def __aiter__(self) -> PullConsumer:
        return self

    async def __anext__(self) -> PulledMessage:
        while True:
            while not self._buffer:
                self._buffer.extend(await self.receive())
            await self._keep_buffer_leased()
            if self._buffer:
                return self._buffer.popleft()

    async def _keep_buffer_leased(self) -> None:
        """The messages of a batch wait here while those before them are handled: once
        the oldest lease is half gone, extend them all in one request, and drop those
        whose lease ran out already (the broker hands them out again)."""
        left = self._buffer[0].lease_ends - asyncio.get_running_loop().time()
        if left > self.visibility / 2:
            return
        held = list(self._buffer)
        kept = await self.extend_all(held, self.visibility)
        self._buffer = deque(msg for msg, ok in zip(held, kept, strict=True) if ok)
