"""Pull consumer processes of `bench.pull_drain`: SKMQ through its public client
(`skmq.pull.consumer.PullConsumer`, over TCP or HTTP) and NATS JetStream (nats-py, a
durable pull consumer shared by every process, `fetch(batch)`).

Run as `python -m bench.pull_load skmq|nats ...`. Unlike the other load processes
(`bench.skmq_load`), the SKMQ consumer imports `skmq`: what is measured is the client a
user gets. Every message's content is `<send time.time_ns()>|...` (bench.confirmed), so
the send-to-receipt latency is known when a producer runs beside the consumers.

`--ack batch` settles each received batch in one request (`await
consumer.ack_all(msgs)`), `--ack sent` the same without awaiting it: sent at the end of
the event-loop turn, it goes with the next receive. The client gathers the `msg.ack()`
calls made in one event-loop turn into one request: `--ack gather` handles a received
batch's messages concurrently, each awaiting its own `msg.ack()` (`asyncio.gather`), one
request a batch again;
`--ack each` is the README's loop: `async for msg in consumer`, the message handled in
`async with msg.leased()`, then `msg.ack()` not awaited (it sends without waiting), one
request a batch; `--ack each-wait` awaits each `msg.ack()` before taking the next
message: one request a message.
NATS acks each message with `msg.ack()` (its documented way: a publish, not awaited
for an answer). With `--wait-go` the process consumes only once the harness says `go`
(a stored backlog's drain, timed from the first receive).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop

from bench.childio import Control, cpu_seconds, emit, write_result
from bench.confirmed import Tally, close_quietly


class PullTally(Tally):
    """The tally of bench.confirmed, plus acks and the time each receive call took."""

    def __init__(self) -> None:
        super().__init__()
        self.acked = 0
        self.t_acked = 0
        self.receive_us: list[int] = []

    def received(self, started_ns: int) -> None:
        """A receive call (started at `started_ns`) returned."""
        self.receive_us.append((time.time_ns() - started_ns) // 1000)

    def settled(self, n: int) -> None:
        self.acked += n
        self.t_acked = time.time_ns()


# Consume until cancelled, noting into the tally.
Consume = Callable[[PullTally], Coroutine[Any, Any, None]]


async def serve(args: argparse.Namespace, consume: Consume, close: Callable[[], Any]) -> None:
    """Ready; (go); consume while reporting progress until the harness says stop; then
    write the result."""
    control = Control(args.deadline)
    await control.start()
    tally = PullTally()
    emit("ready")
    if args.wait_go:
        await control.wait_for("go")
    cpu0 = cpu_seconds()
    task = asyncio.create_task(consume(tally))
    last = (-1, -1)
    while not control.pending("stop") and not task.done():
        if (len(tally.msgids), tally.acked) != last:
            last = (len(tally.msgids), tally.acked)
            emit(
                "progress",
                received=last[0],
                unique=len(tally.seen),
                acked=last[1],
                t_last=tally.t_last,
            )
        await asyncio.sleep(args.progress_interval)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # (a consume that failed raises here: the harness sees the exit)
    cpu_s = cpu_seconds() - cpu0
    await close_quietly(close)
    result = tally.result(args.rid, cpu_s)
    result.update(acked=tally.acked, t_acked=tally.t_acked, receive_us=tally.receive_us)
    write_result(args.result, result)


async def skmq_main(args: argparse.Namespace) -> None:
    from skmq.pull.consumer import PullConsumer, PulledMessage

    consumer = PullConsumer(
        args.gateway, args.app, args.group, batch=args.batch, wait=args.wait, create_group=False
    )
    await consumer.__aenter__()

    def by_batch(awaited: bool) -> Consume:
        """receive, then ack_all: awaited before the next receive, or sent with it."""

        async def consume(tally: PullTally) -> None:
            def settled(acked: asyncio.Future[list[bool]]) -> None:
                if not acked.cancelled() and acked.exception() is None:
                    tally.settled(len(acked.result()))

            while True:
                started = time.time_ns()
                msgs = await consumer.receive()
                tally.received(started)
                for m in msgs:
                    tally.note(m.msgid, m.content)
                if not msgs:
                    continue
                acked = consumer.ack_all(msgs)
                if awaited:
                    await acked
                    tally.settled(len(msgs))
                else:
                    acked.add_done_callback(settled)

        return consume

    async def gathered(tally: PullTally) -> None:
        async def handle(m: PulledMessage) -> None:
            tally.note(m.msgid, m.content)
            await m.ack()
            tally.settled(1)

        while True:
            started = time.time_ns()
            msgs = await consumer.receive()
            tally.received(started)
            await asyncio.gather(*(handle(m) for m in msgs))

    async def each(tally: PullTally) -> None:
        def acked(outcome: asyncio.Future[bool]) -> None:
            if not outcome.cancelled() and outcome.exception() is None and outcome.result():
                tally.settled(1)

        async for m in consumer:
            async with m.leased():
                tally.note(m.msgid, m.content)
            m.ack().add_done_callback(acked)

    async def each_wait(tally: PullTally) -> None:
        async for m in consumer:
            tally.note(m.msgid, m.content)
            await m.ack()
            tally.settled(1)

    modes = {
        "batch": by_batch(awaited=True),
        "sent": by_batch(awaited=False),
        "gather": gathered,
        "each": each,
        "each-wait": each_wait,
    }
    await serve(args, modes[args.ack], consumer.__aexit__)


async def nats_main(args: argparse.Namespace) -> None:
    import nats
    from nats.errors import TimeoutError as NatsTimeout

    nc = await nats.connect(args.url, connect_timeout=10)
    js = nc.jetstream(timeout=30)
    sub = await js.pull_subscribe(args.subject, durable=args.durable, stream=args.stream)

    async def consume(tally: PullTally) -> None:
        while True:
            started = time.time_ns()
            try:
                msgs = await sub.fetch(args.batch, timeout=args.wait)
            except NatsTimeout:
                continue
            tally.received(started)
            for m in msgs:
                tally.note((m.headers or {}).get("Nats-Msg-Id", "?"), m.data)
                await m.ack()
            tally.settled(len(msgs))

    await serve(args, consume, nc.close)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.pull_load")
    p.add_argument("system", choices=["skmq", "nats"])
    p.add_argument("--result", required=True)
    p.add_argument("--deadline", type=float, required=True, help="unix time: hard exit")
    p.add_argument("--rid", default="c1")
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--wait", type=float, default=5.0, help="a receive's long poll, seconds")
    p.add_argument("--wait-go", action="store_true", help="consume once the harness says go")
    p.add_argument("--progress-interval", type=float, default=0.05)
    # SKMQ
    p.add_argument("--gateway", help="tcp://HOST:PORT or http://HOST:PORT")
    p.add_argument("--app", default="bench")
    p.add_argument("--group", default="drain")
    p.add_argument(
        "--ack", choices=["batch", "sent", "gather", "each", "each-wait"], default="batch"
    )
    # NATS
    p.add_argument("--url", default="nats://127.0.0.1:4222")
    p.add_argument("--subject")
    p.add_argument("--stream")
    p.add_argument("--durable")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    uvloop.run(skmq_main(args) if args.system == "skmq" else nats_main(args))


if __name__ == "__main__":
    main()
