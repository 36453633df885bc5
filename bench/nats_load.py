"""NATS JetStream load processes (nats-py): an asynchronous publisher and a consumer.

Run by the harness as `python -m bench.nats_load producer|consumer ...`, the counterpart
of `bench.rabbit_load` with JetStream's reliable settings: a file-stored stream; the
producer publishes with `js.publish_async` (what a NATS user does to go fast: one reply
subscription for every PubAck, a future each, no request round trip awaited in a task
a message), up to `--window` PubAcks outstanding per connection, like the SKMQ producer's
pipeline; a message counts as acked only once its PubAck arrives (an error or no PubAck
within `PUBACK_TIMEOUT`: failed); `Nats-Msg-Id` for dedup. One durable consumer shared by
the consumer processes (a queue group), explicit acks, max_ack_pending `--max-pending`.
Same message content (`<send time.time_ns()>|...`, 100 bytes), stamped when the publish
starts.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import deque
from typing import Any

import nats
import uvloop
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from bench.childio import Control, emit, write_result
from bench.confirmed import Body, Start, Tally, add_load_flags, close_quietly, send_confirmed

PUBACK_TIMEOUT = 30.0  # s: js.publish's request timeout in this benchmark before


class PubAckDeadlines:
    """Fails the PubAck futures still waiting `timeout` s after their publish.

    `publish_async`'s futures have no timeout of their own; one sweep a second over the
    futures in publish order (PubAcks come back about in that order) instead of a timer
    a message."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.waiting: deque[tuple[float, asyncio.Future[Any]]] = deque()

    def add(self, future: asyncio.Future[Any]) -> None:
        self.waiting.append((time.monotonic() + self.timeout, future))

    def sweep(self) -> None:
        now = time.monotonic()
        while self.waiting and (self.waiting[0][1].done() or self.waiting[0][0] <= now):
            _, future = self.waiting.popleft()
            if not future.done():
                future.set_exception(TimeoutError(f"no PubAck within {self.timeout} s"))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.sweep()


def publisher(js: JetStreamContext, subject: str, deadlines: PubAckDeadlines) -> Start:
    """`js.publish_async` of one message (stamped now, `Nats-Msg-Id` its msgid): the
    future of its PubAck, failed by `deadlines` if none comes."""

    async def start(msgid: str, body: Body) -> asyncio.Future[Any]:
        future = await js.publish_async(subject, body(), headers={"Nats-Msg-Id": msgid})
        deadlines.add(future)
        return future

    return start


async def producer_main(args: argparse.Namespace) -> None:
    control = Control(args.deadline)
    await control.start()
    nc = await nats.connect(args.url, connect_timeout=10)
    # nats-py's own limit of outstanding async publishes: the window (send_confirmed
    # keeps to it already, so publish_async never stalls on it).
    js = nc.jetstream(timeout=PUBACK_TIMEOUT, publish_async_max_pending=args.window)
    deadlines = PubAckDeadlines(PUBACK_TIMEOUT)
    emit("ready")
    await control.wait_for("go")

    sweeper = asyncio.create_task(deadlines.run())
    result = await send_confirmed(args, publisher(js, args.subject, deadlines))
    sweeper.cancel()
    result["connection_lost"] = nc.is_closed
    await close_quietly(nc.close)
    write_result(args.result, result)


async def consumer_main(args: argparse.Namespace) -> None:
    control = Control(args.deadline)
    await control.start()
    nc = await nats.connect(args.url, connect_timeout=10)
    js = nc.jetstream(timeout=30)
    tally = Tally()

    async def on_message(msg: Msg) -> None:
        tally.note((msg.headers or {}).get("Nats-Msg-Id", "?"), msg.data)
        await msg.ack()

    config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=args.max_pending)
    await js.subscribe(args.subject, queue=args.durable, durable=args.durable, cb=on_message,
                       manual_ack=True, config=config)  # fmt: skip
    await tally.serve(control, args, nc.close)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.nats_load")
    add_load_flags(p)
    p.add_argument("--url", default="nats://127.0.0.1:4222")
    p.add_argument("--subject", required=True)
    p.add_argument("--durable", default="bench")
    p.add_argument("--max-pending", type=int, default=100)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    uvloop.run(producer_main(args) if args.role == "producer" else consumer_main(args))


if __name__ == "__main__":
    main()
