"""`skmq dlq list|replay|purge`: the dead-letter queue, for operators.

Replay and purge take filters (`--reason`, `--since`/`--until`, `--max`), a pace
(`--rate N/s`) and `--dry-run` (says what would be done, changes nothing); `replay
--to-app OTHER` makes each dead letter a new message of OTHER (same msgid), purged
from its own app in the same script.

Replays and purges are written to the delivery log (events `replayed`, `purged`) under
this command's own instance id, so the audit sees them; each is also logged (a
structlog line on stderr: who, what, how many). A MSGID that is not a dead letter fails the
command (status 1) before anything is done.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from datetime import UTC, datetime

import structlog
from rich.progress import Progress

from skmq.cli.common import open_store, operator, operator_log
from skmq.cli.tokens import add_operator_flags, admin_apps
from skmq.clock import now_ms
from skmq.config import settings_from_args
from skmq.deliverylog import DeliveryLog
from skmq.dlq import CHUNK, DeadLetters, Filters, Verb, choose, dead_letters_of, redrive
from skmq.errors import UsageError
from skmq.ids import bad_app
from skmq.logs import configure_logging
from skmq.pull.groups import bad_group
from skmq.queue.owned_store import OwnedStore
from skmq.ratelimit import TokenBucket
from skmq.store import DeadLetter


def configure(parser: argparse.ArgumentParser) -> None:
    verbs = parser.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="list dead letters")
    listing.add_argument("--app", help="only this app")
    listing.add_argument("--json", action="store_true", help="print JSON for scripts")
    listing.add_argument("--limit", type=_positive, default=None, help="at most N an app")
    listing.add_argument("--group", help=GROUP_HELP)
    add_operator_flags(listing, json=False)
    listing.set_defaults(func=run)
    for verb, what in (("replay", "back to pending, attempts reset"), ("purge", "delete")):
        p = verbs.add_parser(verb, help=f"dead letters: {what}")
        which = p.add_mutually_exclusive_group()
        which.add_argument("--all", action="store_true", help="every dead letter")
        which.add_argument("msgids", nargs="*", default=[], metavar="MSGID")
        p.add_argument("--app", help="only this app (with --all, or alone: all of this app)")
        p.add_argument("--json", action="store_true", help="print JSON for scripts")
        p.add_argument("--reason", help="only dead letters whose last error holds this text")
        p.add_argument("--since", type=_when, help="died at or after: ISO time, unix ms, or 2h")
        p.add_argument("--until", type=_when, help="died before: ISO time, unix ms, or 30m")
        p.add_argument("--max", type=_positive, help="at most N, oldest first")
        p.add_argument("--rate", type=_rate, help="at most N a second (N/s)")
        p.add_argument("--dry-run", action="store_true", help="say what would be done, do nothing")
        p.add_argument("--group", help=GROUP_HELP)
        if verb == "replay":
            p.add_argument("--to-app", help="replay into this app (a new message there)")
        add_operator_flags(p, json=False)
        p.set_defaults(func=run)


GROUP_HELP = "the dead letters of this consumer group of --app (not of its pushes)"
_AGO = re.compile(r"(\d+)([smhd])")
_UNIT_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def _when(text: str) -> int:
    """A point in time (unix ms): `2026-11-23T12:00` (UTC unless it says), unix ms, or
    a duration ago (`90s`, `15m`, `2h`, `3d`)."""
    if text.isascii() and text.isdigit():
        return int(text)
    if ago := _AGO.fullmatch(text):
        return now_ms() - int(ago[1]) * _UNIT_MS[ago[2]]
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an ISO time, unix ms or a duration ago (90s, 15m, 2h, 3d)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def _positive(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _rate(text: str) -> float:
    number = text.removesuffix("/s")
    try:
        rate = float(number)
    except ValueError:
        rate = 0.0
    if not rate > 0 or rate == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive rate (N/s)")
    return rate


def _filters(args: argparse.Namespace) -> Filters:
    return Filters(args.reason, args.since, args.until, args.max)


async def _selected(
    where: DeadLetters, store: OwnedStore, args: argparse.Namespace, only: frozenset[str] | None
) -> list[DeadLetter]:
    apps = [args.app] if args.app else await store.apps()
    apps = [app for app in apps if only is None or app in only]
    letters = [
        d
        for app in apps
        for d in await where.dead_letters(app, args.limit if args.verb == "list" else None)
    ]
    if args.verb == "list":
        return letters
    return choose(letters, args.msgids, _filters(args), args.app)


def printable(text: str, limit: int = 60) -> str:
    """Text for one terminal line: CR, LF and other controls escaped, cut at `limit`."""
    cut = text[:limit]
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return shown + ("..." if len(text) > limit else "")


async def _run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    configure_logging(settings.log_level, settings.log_format)
    if args.verb != "list" and not (args.all or args.msgids or args.app):
        raise UsageError("say which: --all, --app A, or MSGID ...")
    only = admin_apps(settings, args.token)
    to_app = getattr(args, "to_app", None)
    if to_app is not None and (why := bad_app(to_app)) is not None:
        raise UsageError(f"--to-app {why}")
    if args.group is not None:
        if not args.app:
            raise UsageError("--group needs --app: the app whose consumer group it is")
        if (why := bad_group(args.group)) is not None:
            raise UsageError(f"--group {why}")
        if to_app is not None:
            raise UsageError("--to-app: a group's dead letters replay into their group")
    for app in (args.app, to_app):
        if app and only is not None and app not in only:
            raise UsageError(f"this token has no admin role for app {app!r}")
    async with open_store(settings) as store:
        where = dead_letters_of(store, args.group)
        letters = await _selected(where, store, args, only)
        if args.verb == "list":
            if args.json:
                print(json.dumps([d.as_json() for d in letters], indent=2))
            else:
                for d in letters:
                    who = f" recipient={d.recipient}" if d.recipient else ""
                    content = printable(d.content.decode("utf-8", "replace"))
                    print(
                        f"{d.appid} {d.msgid}{who} attempts={d.attempts}"
                        f" error={printable(d.last_error, 200)} content={content}"
                    )
                print(f"{len(letters)} dead letter(s)")
            return 0
        verb = f"{args.verb} into {to_app}" if to_app else args.verb
        if args.dry_run:
            return _dry_run(verb, letters, args.json)
        pace = TokenBucket(args.rate, burst=max(1.0, args.rate)) if args.rate else None
        done = await _apply(where, operator_log(settings), args.verb, letters, to_app, pace)
        structlog.get_logger("skmq.dlq").info(
            "operator action",
            action=f"dlq {args.verb}",
            user=operator(),
            done=done,
            selected=len(letters),
            msgids=[d.msgid for d in letters][:100],
        )
        if args.json:
            print(json.dumps({args.verb: done, "selected": len(letters)}))
        else:
            print(f"{verb}: {done} of {len(letters)} dead letter(s)")
        return 0 if done == len(letters) else 1


def _dry_run(verb: str, letters: list[DeadLetter], as_json: bool) -> int:
    if as_json:
        selected = [{"appid": d.appid, "msgid": d.msgid, "recipient": d.recipient} for d in letters]
        print(json.dumps({"dry_run": verb, "selected": selected}))
        return 0
    for d in letters:
        who = f" recipient={d.recipient}" if d.recipient else ""
        print(f"would {verb}: {d.appid} {d.msgid}{who} error={printable(d.last_error, 200)}")
    print(f"dry run: would {verb} {len(letters)} dead letter(s); nothing done")
    return 0


async def _apply(
    store: DeadLetters,
    dlog: DeliveryLog,
    verb: Verb,
    letters: list[DeadLetter],
    to_app: str | None = None,
    pace: TokenBucket | None = None,
) -> int:
    try:
        with Progress(transient=True, disable=len(letters) <= CHUNK) as progress:
            task = progress.add_task(f"{verb}ing", total=len(letters))
            return await redrive(
                store, dlog, verb, letters, to_app, pace, lambda n: progress.advance(task, n)
            )
    finally:
        dlog.close()


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))
