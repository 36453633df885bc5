"""RabbitMQ load processes (aio-pika): a producer with publisher confirms and a consumer.

Run by the harness as `python -m bench.rabbit_load producer|consumer ...`, the
counterpart of `bench.skmq_load` with RabbitMQ's usual reliable settings:
durable queue, persistent messages, publisher confirms (up to `--window`
unconfirmed per connection, like the SKMQ producer's pipeline), manual acks,
prefetch 100. Same message content (`<send time.time_ns()>|...`, 100 bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import aio_pika
import uvloop
from aio_pika.abc import AbstractIncomingMessage
from pamqp.commands import Basic

from bench.childio import Control, cpu_seconds, emit, write_result


def make_content(ts: int, size: int) -> bytes:
    head = b"%d|" % ts
    return head + b"." * max(size - len(head), 0)


async def producer_main(args: argparse.Namespace) -> None:
    control = Control(args.deadline)
    await control.start()
    connection = await aio_pika.connect(args.url, timeout=10)
    channel = await connection.channel(publisher_confirms=True)
    exchange = channel.default_exchange
    emit("ready")
    await control.wait_for("go")

    cpu0 = cpu_seconds()
    count: int = args.count
    rate: float = args.rate
    window = asyncio.Semaphore(args.window)
    acked = 0
    failed: list[str] = []
    failed_samples: list[str] = []
    t_last_confirm = 0
    pending: set[asyncio.Task[None]] = set()
    outstanding: set[str] = set()

    async def publish(msgid: str, body: bytes) -> None:
        nonlocal acked, t_last_confirm
        try:
            message = aio_pika.Message(
                body,
                message_id=msgid,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            confirmation = await exchange.publish(message, routing_key=args.queue, timeout=30)
            if isinstance(confirmation, Basic.Ack):
                acked += 1
            else:
                failed.append(msgid)
                if len(failed_samples) < 5:
                    failed_samples.append(repr(confirmation)[:300])
        except Exception as exc:
            failed.append(msgid)
            if len(failed_samples) < 5:
                failed_samples.append(repr(exc)[:300])
        finally:
            outstanding.discard(msgid)
            t_last_confirm = time.time_ns()
            window.release()

    seq = 0
    stop_at = time.monotonic() + args.send_time
    stopped_early = False
    t_start = time.time_ns()
    t0 = time.monotonic()
    while seq < count:
        now = time.monotonic()
        if now >= stop_at:
            stopped_early = True
            break
        if rate > 0:
            due_at = t0 + seq / rate
            if due_at > now:
                await asyncio.sleep(due_at - now)
                continue
        try:
            async with asyncio.timeout(max(stop_at - now, 0.01)):
                await window.acquire()
        except TimeoutError:
            stopped_early = True
            break
        body = make_content(time.time_ns(), args.size)
        msgid = f"{args.prefix}-{seq}"
        outstanding.add(msgid)
        task = asyncio.create_task(publish(msgid, body))
        pending.add(task)
        task.add_done_callback(pending.discard)
        seq += 1
    t_sent = time.time_ns()
    if pending:
        await asyncio.wait(set(pending), timeout=args.ack_wait)
    result: dict[str, Any] = {
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
        "stopped_early": stopped_early,
        "connection_lost": connection.is_closed,
        "cpu_s": cpu_seconds() - cpu0,
    }
    for task in list(pending):
        task.cancel()
    try:
        async with asyncio.timeout(5):
            await connection.close()
    except Exception:
        pass
    write_result(args.result, result)


async def consumer_main(args: argparse.Namespace) -> None:
    control = Control(args.deadline)
    await control.start()
    connection = await aio_pika.connect(args.url, timeout=10)
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=args.prefetch)
    queue = await channel.declare_queue(args.queue, durable=True)

    msgids: list[str] = []
    seen: set[str] = set()
    latencies_us: list[int] = []
    duplicates = 0
    t_first = 0
    t_last = 0

    async def on_message(message: AbstractIncomingMessage) -> None:
        nonlocal duplicates, t_first, t_last
        now = time.time_ns()
        msgid = message.message_id or "?"
        if msgid in seen:
            duplicates += 1
        else:
            seen.add(msgid)
        msgids.append(msgid)
        try:
            ts = int(message.body.split(b"|", 1)[0])
            latencies_us.append((now - ts) // 1000)
        except ValueError:
            pass
        if not t_first:
            t_first = now
        t_last = now
        await message.ack()

    await queue.consume(on_message, no_ack=False)
    emit("ready")
    cpu0 = cpu_seconds()
    last_reported = -1
    while not control.pending("stop"):
        n = len(msgids)
        if n != last_reported:
            emit("progress", received=n, unique=len(seen), t_last=t_last)
            last_reported = n
        await asyncio.sleep(args.progress_interval)
    result: dict[str, Any] = {
        "role": "recipient",
        "rid": args.rid,
        "received": len(msgids),
        "unique": len(seen),
        "duplicates": duplicates,
        "msgids": msgids,
        "latencies_us": latencies_us,
        "t_first": t_first,
        "t_last": t_last,
        "cpu_s": cpu_seconds() - cpu0,
    }
    try:
        async with asyncio.timeout(5):
            await connection.close()
    except Exception:
        pass
    write_result(args.result, result)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.rabbit_load")
    p.add_argument("role", choices=["producer", "consumer"])
    p.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    p.add_argument("--queue", required=True)
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
    p.add_argument("--prefetch", type=int, default=100)
    p.add_argument("--progress-interval", type=float, default=0.2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.role == "producer":
        uvloop.run(producer_main(args))
    else:
        uvloop.run(consumer_main(args))


if __name__ == "__main__":
    main()
