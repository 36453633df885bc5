"""What the load processes of the other brokers share (bench.rabbit_load, bench.nats_load):
a producer that keeps up to `--window` publishes awaiting their confirmation, paced or
as fast as possible, and a consumer's tally of what it received.

The producer starts each publish and holds a future for its confirmation (a done
callback, no task of its own): NATS's `publish_async` returns one; RabbitMQ's awaited
publish runs in a task (`in_tasks`)."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol

from bench.childio import Control, cpu_seconds, emit, write_result
from bench.childio import msgid as make_msgid
from bench.pacing import Pacer

# Publish one message (msgid, content); returns once the broker confirmed it, raises if not.
Publish = Callable[[str, bytes], Awaitable[None]]
# A message's content, stamped with the time it is called (`time.time_ns()`).
Body = Callable[[], bytes]
# Start publishing one message (msgid, its content, to call when the publish starts): a
# future done once the broker confirmed the message (any result), failed if it did not.
Start = Callable[[str, Body], Awaitable[asyncio.Future[Any]]]


def make_content(ts: int, size: int) -> bytes:
    head = b"%d|" % ts
    return head + b"." * max(size - len(head), 0)


def in_tasks(publish: Publish) -> Start:
    """A `Publish` awaited in a task of its own (aio-pika's way to keep many unconfirmed):
    the future is the task, and the content is stamped when the task begins, that is when
    its publish is written."""

    async def run(msgid: str, body: Body) -> None:
        await publish(msgid, body())

    async def start(msgid: str, body: Body) -> asyncio.Future[Any]:
        return asyncio.create_task(run(msgid, body))

    return start


async def send_confirmed(args: argparse.Namespace, start: Start) -> dict[str, Any]:
    """Send `--count` messages (`--rate` msg/s paced by `bench.pacing`, 0: at once) for at
    most `--send-time` seconds, `--window` unconfirmed at most; then wait `--ack-wait` for
    the last confirmations. A message counts as acked when its future has a result, as
    failed when it has an exception (or `start` raised); those still waiting at the end
    are `unanswered`. The producer's result, but `connection_lost`."""
    cpu0 = cpu_seconds()
    window = asyncio.Semaphore(args.window)
    acked = 0
    failed: list[str] = []
    failed_samples: list[str] = []
    t_last_confirm = 0
    pending: set[asyncio.Future[Any]] = set()
    outstanding: set[str] = set()

    def answered(msgid: str, exc: BaseException | None) -> None:
        nonlocal acked, t_last_confirm
        if exc is None:
            acked += 1
        else:
            failed.append(msgid)
            if len(failed_samples) < 5:
                failed_samples.append(repr(exc)[:300])
        outstanding.discard(msgid)
        t_last_confirm = time.time_ns()
        window.release()

    def confirmed(msgid: str, future: asyncio.Future[Any]) -> None:
        pending.discard(future)
        if not future.cancelled():  # cancelled: given up at the end, unanswered
            answered(msgid, future.exception())

    def body() -> bytes:
        return make_content(time.time_ns(), args.size)

    pacer = Pacer(args.rate, args.count)
    stop_at = time.monotonic() + args.send_time
    stopped_early = False  # the window stayed full up to the time cap
    t_start = time.time_ns()
    pacer.start()
    while not stopped_early and (due := await pacer.next_batch(stop_at)):
        # Everything due (500 at most before looking at the clock again): one publish
        # started each, `--window` unconfirmed at most.
        for _ in range(min(due, 500)):
            if window.locked():
                try:
                    async with asyncio.timeout(max(stop_at - time.monotonic(), 0.01)):
                        await window.acquire()
                except TimeoutError:
                    stopped_early = True
                    break
            else:
                await window.acquire()  # free: returns at once
            msgid = make_msgid(args.prefix, pacer.sent)
            outstanding.add(msgid)
            pacer.record(1)
            try:
                future = await start(msgid, body)
            except Exception as exc:
                answered(msgid, exc)
                continue
            pending.add(future)
            future.add_done_callback(partial(confirmed, msgid))
    seq = pacer.sent
    t_sent = time.time_ns()
    if pending:
        await asyncio.wait(set(pending), timeout=args.ack_wait)
    unanswered = sorted(outstanding)
    for future in list(pending):
        future.cancel()
    return {
        "role": "producer",
        "prefix": args.prefix,
        "sent": seq,
        "responses": acked + len(failed),
        "acked": acked,
        "failed": failed,
        "failed_samples": failed_samples,
        "unanswered": unanswered,
        "t_start": t_start,
        "t_sent": t_sent,
        "t_end": t_last_confirm or t_sent,
        "stopped_early": stopped_early or pacer.capped,
        **pacer.summary(),
        "cpu_s": cpu_seconds() - cpu0,
    }


class Tally:
    """What a consumer received: msgids in order, duplicates, send-to-receipt latency."""

    def __init__(self) -> None:
        self.msgids: list[str] = []
        self.seen: set[str] = set()
        self.latencies_us: list[int] = []
        self.duplicates = 0
        self.t_first = 0
        self.t_last = 0

    def note(self, msgid: str, body: bytes) -> None:
        now = time.time_ns()
        if msgid in self.seen:
            self.duplicates += 1
        else:
            self.seen.add(msgid)
        self.msgids.append(msgid)
        try:
            self.latencies_us.append((now - int(body.split(b"|", 1)[0])) // 1000)
        except ValueError:
            pass
        self.t_first = self.t_first or now
        self.t_last = now

    async def serve(
        self, control: Control, args: argparse.Namespace, close: Callable[[], Awaitable[Any]]
    ) -> None:
        """Ready; progress until the harness says stop; then close and write the result."""
        emit("ready")
        cpu_s = await report_until_stopped(control, args.progress_interval, self)
        await close_quietly(close)
        write_result(args.result, self.result(args.rid, cpu_s))

    def result(self, rid: str, cpu_s: float) -> dict[str, Any]:
        return {
            "role": "recipient",
            "rid": rid,
            "received": len(self.msgids),
            "unique": len(self.seen),
            "duplicates": self.duplicates,
            "msgids": self.msgids,
            "latencies_us": self.latencies_us,
            "t_first": self.t_first,
            "t_last": self.t_last,
            "cpu_s": cpu_s,
        }


class Received(Protocol):
    msgids: list[Any]
    seen: set[Any]
    t_last: int


async def report_until_stopped(control: Control, interval: float, got: Received) -> float:
    """Progress lines of a consumer until the harness says stop; the CPU seconds used."""
    cpu0 = cpu_seconds()
    last_reported = -1
    while not control.pending("stop"):
        n = len(got.msgids)
        if n != last_reported:
            emit("progress", received=n, unique=len(got.seen), t_last=got.t_last)
            last_reported = n
        await asyncio.sleep(interval)
    return cpu_seconds() - cpu0


def add_load_flags(p: argparse.ArgumentParser) -> None:
    """The flags both load processes take from the harness."""
    p.add_argument("role", choices=["producer", "consumer"])
    p.add_argument("--result", required=True)
    p.add_argument("--deadline", type=float, required=True, help="unix time: hard exit")
    p.add_argument("--prefix", default="m")
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--window", type=int, default=1000)
    p.add_argument("--rate", type=float, default=0.0)
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--send-time", type=float, default=60.0)
    p.add_argument("--ack-wait", type=float, default=30.0)
    p.add_argument("--rid", default="c1")
    p.add_argument("--progress-interval", type=float, default=0.2)


async def close_quietly(close: Callable[[], Awaitable[Any]]) -> None:
    try:
        async with asyncio.timeout(5):
            await close()
    except Exception:
        pass
