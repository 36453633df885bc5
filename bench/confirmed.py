"""What the load processes of the other brokers share (bench.rabbit_load, bench.nats_load):
a producer that keeps up to `--window` publishes awaiting their confirmation, paced or
as fast as possible, and a consumer's tally of what it received."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from bench.childio import Control, cpu_seconds, emit, write_result
from bench.childio import msgid as make_msgid
from bench.pacing import Pacer

# Publish one message (msgid, body); returns once the broker confirmed it, raises if not.
Publish = Callable[[str, bytes], Awaitable[None]]


def make_content(ts: int, size: int) -> bytes:
    head = b"%d|" % ts
    return head + b"." * max(size - len(head), 0)


async def send_confirmed(args: argparse.Namespace, publish: Publish) -> dict[str, Any]:
    """Send `--count` messages (`--rate` msg/s paced by `bench.pacing`, 0: at once) for at
    most `--send-time` seconds, `--window` unconfirmed at most; then wait `--ack-wait` for
    the last confirmations. The producer's result, but `connection_lost`."""
    cpu0 = cpu_seconds()
    window = asyncio.Semaphore(args.window)
    acked = 0
    failed: list[str] = []
    failed_samples: list[str] = []
    t_last_confirm = 0
    pending: set[asyncio.Task[None]] = set()
    outstanding: set[str] = set()

    async def one(msgid: str) -> None:
        nonlocal acked, t_last_confirm
        try:
            # stamped when the publish starts (not when the batch was scheduled)
            await publish(msgid, make_content(time.time_ns(), args.size))
            acked += 1
        except Exception as exc:
            failed.append(msgid)
            if len(failed_samples) < 5:
                failed_samples.append(repr(exc)[:300])
        finally:
            outstanding.discard(msgid)
            t_last_confirm = time.time_ns()
            window.release()

    pacer = Pacer(args.rate, args.count)
    stop_at = time.monotonic() + args.send_time
    stopped_early = False  # the window stayed full up to the time cap
    t_start = time.time_ns()
    pacer.start()
    while not stopped_early and (due := await pacer.next_batch(stop_at)):
        # Everything due (500 at most before looking at the clock again): one publish
        # task each, `--window` unconfirmed at most.
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
            task = asyncio.create_task(one(msgid))
            pending.add(task)
            task.add_done_callback(pending.discard)
            pacer.record(1)
    seq = pacer.sent
    t_sent = time.time_ns()
    if pending:
        await asyncio.wait(set(pending), timeout=args.ack_wait)
    for task in list(pending):
        task.cancel()
    return {
        "role": "producer",
        "prefix": args.prefix,
        "sent": seq,
        "responses": acked + len(failed),
        "acked": acked,
        "failed": failed,
        "failed_samples": failed_samples,
        "unanswered": sorted(outstanding),
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
