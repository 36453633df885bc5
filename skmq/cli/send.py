"""`skmq send`: send one message and print the broker's resp as JSON.

Exit status: 0 if the broker answered ack, 1 if it answered otherwise (or lacks
an extension asked for, such as --delay on an original broker), 2 if it could not
be reached (or did not answer in time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from skmq.cli import fail, seconds, trace_as_the_environment_says, unreachable, whole_number
from skmq.cli.tokens import add_token_flag
from skmq.client import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    AuthenticationError,
    ExtensionUnsupported,
    Producer,
    Resp,
)
from skmq.codec import encode_frame
from skmq.loop import run_main


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)")
    return value


def broker_address(host: str | None, port: int | None) -> tuple[str, int]:
    """Flags win, then SKMQ_HOST / SKMQ_PORT, then 127.0.0.1:1734."""
    if host is None:
        host = os.environ.get("SKMQ_HOST") or DEFAULT_HOST
    if port is None:
        env_port = os.environ.get("SKMQ_PORT")
        port = int(env_port) if env_port else DEFAULT_PORT
    return host, port


def configure(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.add_argument("--app", required=True, help="application id (appid)")
    p.add_argument("--topic", action="store_true", help="broadcast to every recipient")
    p.add_argument("--msgid", help="message id (default: a new uuid4 hex)")
    p.add_argument(
        "--delay", type=whole_number(0), metavar="MS", help="deliver no sooner than MS ms from now"
    )
    p.add_argument(
        "--deliver-at", type=whole_number(0), metavar="MS", help="deliver at this unix time in ms"
    )
    p.add_argument(
        "--mandatory",
        action="store_true",
        help="refused (reject), not stored, when the app has no recipient and no group",
    )
    p.add_argument("--host", help="broker host (default: $SKMQ_HOST or 127.0.0.1)")
    p.add_argument("--port", type=port_number, help="broker port (default: $SKMQ_PORT or 1734)")
    p.add_argument("--timeout", type=seconds, default=30.0, help="seconds to wait for the resp")
    add_token_flag(p, "token sent in an auth frame first (brokers with AUTH_TOKEN/AUTH_FILE)")
    p.add_argument(
        "content", nargs="?", default="-", metavar="CONTENT", help="the content; - reads stdin"
    )
    p.set_defaults(func=run)


async def _send(args: argparse.Namespace, host: str, port: int, content: bytes) -> Resp:
    async with Producer(host, port, token=args.token) as producer:
        return await asyncio.wait_for(
            producer.send(
                args.app,
                content,
                topic=args.topic,
                msgid=args.msgid,
                delay_ms=args.delay,
                deliver_at_ms=args.deliver_at,
                mandatory=args.mandatory,
            ),
            args.timeout,
        )


def run(args: argparse.Namespace) -> int:
    try:
        host, port = broker_address(args.host, args.port)
    except ValueError:
        return fail("send", f"invalid SKMQ_PORT {os.environ.get('SKMQ_PORT')!r}", 2)
    try:  # a field the protocol cannot carry (CR or LF in --msgid): a usage error
        encode_frame("queue", {"appid": args.app, "msgid": args.msgid or ""}, None)
    except ValueError as exc:
        return fail("send", f"not sent: {exc}", 2)
    # os.fsencode gives back exactly the bytes of the argument, even non-UTF-8 ones.
    content = sys.stdin.buffer.read() if args.content == "-" else os.fsencode(args.content)
    trace_as_the_environment_says("send")
    try:
        resp: Resp = run_main(_send(args, host, port, content))
    except AuthenticationError as exc:
        resp = exc.resp
    except TimeoutError:
        return fail("send", f"no answer from {host}:{port} in {args.timeout:g}s", 2)
    except OSError as exc:
        return fail("send", f"cannot reach broker at {host}:{port}: {unreachable(exc)}", 2)
    except ExtensionUnsupported as exc:
        return fail("send", f"not sent: {exc}", 1)
    print(json.dumps(resp.to_dict()), flush=True)
    return 0 if resp.ok else 1
