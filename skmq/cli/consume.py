"""`skmq consume`: register a recipient and handle pushed messages until stopped.

Without --exec each message is printed as one line `<appid> <msgid> <content>`
(CR and LF in the content shown as \\r and \\n) and acked. With --exec, CMD runs
through the shell with the content on stdin and SKMQ_APPID / SKMQ_MSGID set:
exit status 0 acks, --reject-exit-code rejects, anything else answers error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from skmq.cli import fail, seconds, trace_as_the_environment_says, unreachable, whole_number
from skmq.cli.broker_settings import broker_addresses
from skmq.cli.consume_pull import add_pull_flags, consume_pull
from skmq.cli.send import port_number
from skmq.cli.tokens import add_token_flag
from skmq.client import (
    DEFAULT_MAX_FRAME_BYTES,
    AuthenticationError,
    CannotListen,
    Consumer,
    ExtensionUnsupported,
    Handler,
    Message,
    RegistrationError,
    Reject,
)
from skmq.loop import run_main
from skmq.signing import secret_key

# The smallest --max-frame-bytes, as the broker's MAX_FRAME_BYTES: less holds no push.
MIN_FRAME_BYTES = 64


def configure(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--app", required=True, help="application id to receive messages of")
    p.add_argument("--id", help="recipient id (unique within the app; push only, required)")
    p.add_argument("--port", type=port_number, help="port to listen on (0: any; push, required)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--advertise-host", help="host to register (default: --host)")
    p.add_argument("--weight", type=whole_number(0), default=0, help="load-balancing weight (>= 0)")
    p.add_argument("--exec", dest="command", metavar="CMD", help="shell command per message")
    p.add_argument(
        "--reject-exit-code",
        type=whole_number(1, 255),
        metavar="N",
        help="CMD exit status to reject (1-255)",
    )
    p.add_argument(
        "--exec-timeout",
        type=seconds,
        default=60.0,
        metavar="SECONDS",
        help="kill CMD (answer error) after this long (default 60)",
    )
    p.add_argument("--arrived", action="store_true", help="answer arrived before processing")
    p.add_argument(
        "--concurrency", type=whole_number(1), default=64, help="messages handled at once"
    )
    p.add_argument(
        "--max-frame-bytes",
        type=whole_number(MIN_FRAME_BYTES),
        default=DEFAULT_MAX_FRAME_BYTES,
        help=f"largest push accepted, in bytes (at least {MIN_FRAME_BYTES}; default %(default)s)",
    )
    add_token_flag(p, "token sent in an auth frame first (brokers with AUTH_TOKEN/AUTH_FILE)")
    p.add_argument(
        "--signing-secret",
        default=os.environ.get("SKMQ_SIGNING_SECRET") or None,
        help="the broker's SIGNING_SECRET: reject pushes not signed with it, or stale"
        " (default: $SKMQ_SIGNING_SECRET)",
    )
    p.add_argument(
        "--broker-host", help="broker host (default: $SKMQ_HOST, --config's, or 127.0.0.1)"
    )
    p.add_argument(
        "--broker-port",
        type=port_number,
        help="broker port (default: $SKMQ_PORT, --config's, or 1734)",
    )
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="the broker's TOML settings file (as given to skmq serve): its HOST, PORT and "
        "HTTP_PORT say where the broker is when no flag or SKMQ_* variable does",
    )
    p.add_argument(
        "--unregister-on-exit",
        action="store_true",
        help="unregister when stopped (default: keep the registration for a restart)",
    )
    add_pull_flags(p)
    p.set_defaults(func=run)


async def print_message(msg: Message) -> None:
    text = msg.content.decode("utf-8", "replace").replace("\r", "\\r").replace("\n", "\\n")
    sys.stdout.write(f"{msg.appid} {msg.msgid} {text}\n")
    sys.stdout.flush()


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    """Write the content and close stdin. A handler may exit without reading it: the
    broken pipe that follows (under uvloop a RuntimeError on the closed transport) is
    not a failure, the exit status says how the handler did."""
    try:
        stdin.write(data)
        await stdin.drain()
    except (BrokenPipeError, ConnectionResetError, RuntimeError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            stdin.close()


def exec_handler(command: str, reject_exit_code: int | None, timeout: float) -> Handler:
    """A handler running `command` through the shell for each message, killed (an `error`
    answer) if it runs longer than `timeout` seconds."""

    async def handle(msg: Message) -> None:
        env = {**os.environ, "SKMQ_APPID": msg.appid, "SKMQ_MSGID": msg.msgid}
        # A session of its own: a hung handler is killed with everything it started.
        proc = await asyncio.create_subprocess_shell(
            command, stdin=asyncio.subprocess.PIPE, env=env, start_new_session=True
        )
        assert proc.stdin is not None
        feed = asyncio.ensure_future(_feed(proc.stdin, msg.content))
        try:
            async with asyncio.timeout(timeout):
                code = await proc.wait()
        except TimeoutError:
            raise RuntimeError(f"handler timed out after {timeout:g}s") from None
        finally:
            feed.cancel()
            await asyncio.gather(feed, return_exceptions=True)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.stdin.transport.abort()  # unsent content must not hold the pipe open
                await proc.wait()
        if code == 0:
            return
        reason = f"exit status {code}" if code > 0 else f"killed by signal {-code}"
        if code == reject_exit_code:
            raise Reject(reason)
        raise RuntimeError(reason)

    return handle


async def _consume(args: argparse.Namespace, broker_host: str, broker_port: int) -> int:
    handler = (
        print_message
        if args.command is None
        else exec_handler(args.command, args.reject_exit_code, args.exec_timeout)
    )
    consumer = Consumer(
        args.app,
        args.id,
        handler,
        host=args.host,
        port=args.port,
        weight=args.weight,
        broker_host=broker_host,
        broker_port=broker_port,
        send_arrived=args.arrived,
        concurrency=args.concurrency,
        advertise_host=args.advertise_host,
        max_frame_bytes=args.max_frame_bytes,
        token=args.token,
        signing_secret=args.signing_secret,
    )
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopped.set)
    try:
        await consumer.start()
    except (RegistrationError, AuthenticationError) as exc:
        return fail("consume", f"refused: {exc.resp.content}", 1)
    except CannotListen as exc:  # its own port, not the broker's
        where = f"{args.host}:{args.port}"
        return fail("consume", f"cannot listen on {where} (--host/--port): {unreachable(exc)}", 2)
    except ConnectionRefusedError:
        where = f"{broker_host}:{broker_port}"
        return fail("consume", f"cannot reach broker at {where}: connection refused", 2)
    except (OSError, TimeoutError) as exc:
        where = f"{broker_host}:{broker_port}"
        return fail("consume", f"cannot start with the broker at {where}: {unreachable(exc)}", 2)
    print(
        f"skmq consume: {args.app}/{args.id} listening on {args.host}:{consumer.port}, "
        f"registered with {broker_host}:{broker_port}",
        file=sys.stderr,
        flush=True,
    )
    if consumer.took_over:
        print(f"skmq consume: took the id {args.id} over from {consumer.took_over} "
              "(another consumer was running with it)", file=sys.stderr, flush=True)  # fmt: skip
    await stopped.wait()
    code = await _unregister(consumer) if args.unregister_on_exit else 0
    await consumer.stop()
    stats = " ".join(f"{k}={v}" for k, v in consumer.stats.items())
    print(f"skmq consume: stopped ({stats})", file=sys.stderr, flush=True)
    return code


async def _unregister(consumer: Consumer) -> int:
    """0 if the broker removed (or never had) the registration, else 1, said in one line."""
    try:
        resp = await consumer.unregister()
    except ExtensionUnsupported as exc:
        return fail("consume", f"not unregistered: {exc}", 1)
    except (OSError, TimeoutError) as exc:
        return fail("consume", f"unregister failed: {exc or type(exc).__name__}", 1)
    if not resp.ok:
        return fail("consume", f"unregister refused: {resp.content}", 1)
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="skmq consume: %(levelname)s %(message)s"
    )
    trace_as_the_environment_says("consume")
    if args.pull:
        return consume_pull(args, exec_handler, print_message)
    if args.id is None or args.port is None:
        return fail("consume", "--id and --port are required (or --pull --group G)", 2)
    broker = broker_addresses(args.config)
    broker_host = broker.host if args.broker_host is None else args.broker_host
    broker_port = broker.port if args.broker_port is None else args.broker_port
    try:
        if args.signing_secret is not None:
            secret_key(args.signing_secret)
    except ValueError as exc:  # says what is wrong, never the secret
        return fail("consume", f"signing secret: {exc}", 2)
    code: int = run_main(_consume(args, broker_host, broker_port))
    return code
