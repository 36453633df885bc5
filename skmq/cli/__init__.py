"""The `skmq` command: one subcommand a module, each exposing `configure(parser)`.

Only the module of the command being run is imported (with its parser's flags), so that
a client command never pays for the broker, pydantic-settings or Spark. Every failure
reaches the user as one line on stderr: status 2 for a bad setting, file or address,
1 for an operational failure; `--debug` shows the traceback too (for a failure a command
reports itself) or instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from skmq import __version__
from skmq.errors import UsageError, redis_error_text

# name -> one-line help; the command is the module skmq.cli.<name>
COMMANDS = {
    "serve": "run the broker",
    "config": "the settings in effect and where each comes from",
    "send": "send one message to the broker",
    "consume": "receive pushed messages",
    "status": "apps, depths, recipients and how Redis persists them",
    "apps": "each app at a glance: depths, oldest pending, recipients, rates",
    "peek": "look at an app's waiting messages (or dead letters), changing nothing",
    "purge": "delete an app's waiting messages (not in flight, not dead)",
    "dlq": "list, replay or purge dead letters",
    "groups": "list, create, reset or delete consumer groups",
    "recipients": "list registered recipients, or remove one gone for good",
    "connections": "producers, push links and pull polls of every live broker",
    "audit": "audit delivery logs with Spark (report.json, report.html, CSV)",
}


def seconds(text: str) -> float:
    """An argparse type: a time in seconds above 0 (and finite)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds above 0")
    return value


def group_position(text: str) -> str | int:
    """An argparse type: where a consumer group reads from (skmq/pull/position.py)."""
    from skmq.pull.position import BadPosition, parse_position

    try:
        return parse_position(text)
    except BadPosition as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def whole_number(least: int, most: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number from `least` (to `most`, if given)."""
    span = f"{least}-{most}" if most is not None else f"at least {least}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least or (most is not None and value > most):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {span}")
        return value

    return parse


def unreachable(exc: BaseException) -> str:
    """Why a peer could not be reached or did not answer, never empty (a timeout's own
    message is)."""
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def describe(exc: BaseException) -> str:
    """One line for a failure, without the traceback."""
    if isinstance(exc, OSError) and exc.strerror:
        where = exc.filename if exc.filename is not None else ""
        return f"{exc.strerror}: {where}" if where else exc.strerror
    if type(exc).__module__.startswith("redis"):
        return f"Redis: {redis_error_text(exc)}"
    if (isinstance(exc, RuntimeError) or type(exc).__module__.startswith("skmq.")) and str(exc):
        return str(exc)  # our own errors say what is wrong in their message
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# `skmq --debug`: a failure a command says in one line shows its traceback too.
debugging = False


def fail(command: str, message: str, status: int) -> int:
    """Say why `skmq COMMAND` failed, one line on stderr (after the traceback of the
    exception being handled, under --debug); returns its exit status."""
    if debugging and sys.exc_info()[1] is not None:
        traceback.print_exc()
    print(f"skmq {command}: {message}", file=sys.stderr)
    return status


def trace_as_the_environment_says(command: str) -> None:
    """Spans as the OTEL_* variables ask (docs/OPERATIONS.md, "Tracing"), under the
    service name skmq-COMMAND unless OTEL_SERVICE_NAME says otherwise; when they ask for
    traces that cannot be made, one line on stderr, and the command runs untraced."""
    from skmq.tracing import from_environment

    if (why := from_environment(f"skmq-{command}")) is not None:
        print(f"skmq {command}: tracing off: {why}", file=sys.stderr)


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (status 2) instead of the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = Parser(prog="skmq", description="SKMQ: a push-delivery broker.")
    parser.add_argument("--version", action="version", version=f"skmq {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of failures")
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, text in COMMANDS.items():
        command = sub.add_parser(name, help=text, description=text)
        if name == wanted:
            try:
                importlib.import_module(f"skmq.cli.{name}").configure(command)
            except ModuleNotFoundError as exc:  # a client-only install (docs: pyproject)
                extra = "audit" if exc.name and "spark" in exc.name else "server"
                parser.exit(2, f"skmq {name}: needs `pip install 'skmq[{extra}]'` "
                               f"({exc.name} is not installed)\n")  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args, extra = build_parser(args_list).parse_known_args(args_list)
    global debugging
    debugging = args.debug
    if extra:  # (said for the command they were given to, not for `skmq`)
        command = args.subcommand
        return fail(command, f"unrecognized arguments: {' '.join(extra)} "
                             f"(see skmq {command} --help)", 2)  # fmt: skip
    try:
        result: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        return fail(args.subcommand, describe(exc), 2 if isinstance(exc, UsageError) else 1)
    return result
