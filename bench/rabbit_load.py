"""RabbitMQ load processes (aio-pika): a producer with publisher confirms and a consumer.

Run by the harness as `python -m bench.rabbit_load producer|consumer ...`, the
counterpart of `bench.skmq_load` with RabbitMQ's usual reliable settings:
durable queue, persistent messages, publisher confirms (up to `--window`
unconfirmed per connection, like the SKMQ producer's pipeline), manual acks,
prefetch 100. Same message content (`<send time.time_ns()>|...`, 100 bytes).
"""

from __future__ import annotations

import argparse

import aio_pika
import uvloop
from aio_pika.abc import AbstractIncomingMessage
from pamqp.commands import Basic

from bench.childio import Control, emit, write_result
from bench.confirmed import Tally, add_load_flags, close_quietly, in_tasks, send_confirmed


async def producer_main(args: argparse.Namespace) -> None:
    control = Control(args.deadline)
    await control.start()
    connection = await aio_pika.connect(args.url, timeout=10)
    channel = await connection.channel(publisher_confirms=True)
    exchange = channel.default_exchange
    emit("ready")
    await control.wait_for("go")

    async def publish(msgid: str, body: bytes) -> None:
        message = aio_pika.Message(
            body, message_id=msgid, delivery_mode=aio_pika.DeliveryMode.PERSISTENT
        )
        confirmation = await exchange.publish(message, routing_key=args.queue, timeout=30)
        if not isinstance(confirmation, Basic.Ack):
            raise RuntimeError(f"not confirmed: {confirmation!r}")

    result = await send_confirmed(args, in_tasks(publish))
    result["connection_lost"] = connection.is_closed
    await close_quietly(connection.close)
    write_result(args.result, result)


async def consumer_main(args: argparse.Namespace) -> None:
    control = Control(args.deadline)
    await control.start()
    connection = await aio_pika.connect(args.url, timeout=10)
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=args.prefetch)
    queue = await channel.declare_queue(args.queue, durable=True)
    tally = Tally()

    async def on_message(message: AbstractIncomingMessage) -> None:
        tally.note(message.message_id or "?", message.body)
        await message.ack()

    await queue.consume(on_message, no_ack=False)
    await tally.serve(control, args, connection.close)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.rabbit_load")
    add_load_flags(p)
    p.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    p.add_argument("--queue", required=True)
    p.add_argument("--prefetch", type=int, default=100)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    uvloop.run(producer_main(args) if args.role == "producer" else consumer_main(args))


if __name__ == "__main__":
    main()
