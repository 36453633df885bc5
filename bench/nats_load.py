"""NATS JetStream load processes (nats-py): a producer awaiting each PubAck and a consumer.

Run by the harness as `python -m bench.nats_load producer|consumer ...`, the counterpart
of `bench.rabbit_load` with JetStream's reliable settings: a file-stored stream, every
publish awaited for its PubAck (up to `--window` unacknowledged per connection, like the
SKMQ producer's pipeline; `Nats-Msg-Id` for dedup), one durable consumer shared by the
consumer processes (a queue group), explicit acks, max_ack_pending `--max-pending`.
Same message content (`<send time.time_ns()>|...`, 100 bytes).
"""

from __future__ import annotations

import argparse

import nats
import uvloop
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from bench.childio import Control, emit, write_result
from bench.confirmed import Tally, add_load_flags, close_quietly, send_confirmed


async def producer_main(args: argparse.Namespace) -> None:
    control = Control(args.deadline)
    await control.start()
    nc = await nats.connect(args.url, connect_timeout=10)
    js = nc.jetstream(timeout=30)
    emit("ready")
    await control.wait_for("go")

    async def publish(msgid: str, body: bytes) -> None:
        await js.publish(args.subject, body, headers={"Nats-Msg-Id": msgid})

    result = await send_confirmed(args, publish)
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
