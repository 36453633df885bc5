"""`skmq consume --pull --group G`: pull the app's messages through the HTTP gateway
(docs/HTTP.md) instead of listening for pushes. Each message is handled as a pushed one
(printed, or --exec CMD), its lease extended meanwhile; then acked, or nacked (a reject
or a failure: retried after the broker's backoff)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from skmq.cli import fail, group_position, seconds, unreachable, whole_number
from skmq.cli.broker_settings import broker_addresses
from skmq.client import Handler, Message
from skmq.loop import run_main

ExecHandler = Callable[[str, int | None, float], Handler]


def add_pull_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pull", action="store_true", help="pull through the HTTP gateway")
    p.add_argument("--group", help="the consumer group to pull for (created if missing)")
    p.add_argument("--from", dest="position", type=group_position, default="latest",
                   metavar="POSITION", help="where the group starts, if created (pull): "
                   "latest, earliest, unix ms or an ISO-8601 time")  # fmt: skip
    p.add_argument(
        "--gateway",
        help="the HTTP gateway (http[s]://HOST:PORT), or tcp://HOST:PORT for the broker port "
        "(default: where the broker's settings put it: http://HOST:HTTP_PORT from "
        "$SKMQ_HOST, $SKMQ_HTTP_PORT or --config, else http://127.0.0.1:1735; "
        "tcp://HOST:PORT when HTTP_PORT is 0)",
    )
    p.add_argument("--visibility", type=seconds, default=30.0, help="lease seconds (pull)")
    p.add_argument(
        "--batch",
        type=whole_number(1),
        default=None,
        help="messages a receive (pull; default: the broker's cap, PULL_MAX_MESSAGES, 100)",
    )


async def _pull(args: argparse.Namespace, handler: Handler) -> int:
    from skmq.pull.consumer import NotAGateway, PullConsumer, PullError

    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    starting = asyncio.current_task()

    def on_signal() -> None:  # while starting, nothing is held: stop at once
        stopped.set()
        if starting is not None:
            starting.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    done = {"acked": 0, "nacked": 0}
    try:
        async with PullConsumer(
            args.gateway, args.app, args.group, token=args.token,
            batch=args.batch, visibility=args.visibility, position=args.position,
        ) as consumer:  # fmt: skip
            starting = None
            print(f"skmq consume: pulling {args.app}/{args.group} from {args.gateway}",
                  file=sys.stderr, flush=True)  # fmt: skip
            messages = aiter(consumer)

            def counted(verb: str) -> Callable[[asyncio.Future[Any]], None]:
                def settled(outcome: asyncio.Future[Any]) -> None:
                    if not outcome.cancelled() and outcome.exception() is None:
                        done[verb] += 1

                return settled

            while not stopped.is_set():
                if consumer.buffered:  # (the batch received: handed out at once)
                    msg = await anext(messages)
                else:
                    nxt = asyncio.ensure_future(anext(messages))
                    stop = asyncio.ensure_future(stopped.wait())
                    await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
                    stop.cancel()
                    if not nxt.done():
                        nxt.cancel()
                        break
                    msg = nxt.result()
                try:
                    async with msg.leased():
                        await handler(Message(args.app, msg.msgid, msg.content, {}))
                except Exception:
                    msg.nack().add_done_callback(counted("nacked"))
                else:  # (sent with the settles of this turn; answered by the close)
                    msg.ack().add_done_callback(counted("acked"))
    except PullError as exc:
        return fail("consume", f"refused: {exc}", 1)
    except NotAGateway as exc:
        return fail("consume", str(exc), 2)
    except (OSError, TimeoutError) as exc:
        return fail("consume", f"cannot reach {args.gateway}: {unreachable(exc)}", 2)
    except asyncio.CancelledError:
        if not stopped.is_set():
            raise
        return fail("consume", f"stopped before {args.gateway} answered", 1)
    stats = " ".join(f"{k}={v}" for k, v in done.items())
    print(f"skmq consume: stopped ({stats})", file=sys.stderr, flush=True)
    return 0


def consume_pull(
    args: argparse.Namespace,
    exec_handler: ExecHandler,
    print_message: Callable[[Message], Awaitable[None]],
) -> int:
    if not args.group:
        return fail("consume", "--pull needs --group G", 2)
    if args.gateway is None:
        args.gateway = broker_addresses(args.config).gateway
    scheme = urlsplit(args.gateway).scheme
    if scheme not in ("http", "https", "tcp"):
        return fail("consume", "--gateway must be http://, https:// or tcp://HOST:PORT", 2)
    if scheme != "tcp" and importlib.util.find_spec("aiohttp") is None:
        needs = "the HTTP gateway needs aiohttp: pip install 'skmq[server]'"
        return fail("consume", f"{needs}, or use --gateway tcp://HOST:PORT (the broker's port)", 2)
    handler = (
        print_message
        if args.command is None
        else exec_handler(args.command, args.reject_exit_code, args.exec_timeout)
    )
    code: int = run_main(_pull(args, handler))
    return code
