"""`skmq dlq list|replay|purge`: the dead-letter queue, for operators.

Replays are written to the delivery log (event `replayed`) under this command's own
instance id, so the audit sees them; every replay and purge is also logged (a structlog
line on stderr: who, what, how many). A MSGID that is not a dead letter fails the
command (status 1) before anything is done.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import socket

import structlog
from rich.progress import Progress

from skmq.cli.common import open_store
from skmq.cli.tokens import add_token_flag, admin_apps
from skmq.config import STORE_FLAGS, add_settings_flags, settings_from_args
from skmq.deliverylog import DeliveryLog, now_ms
from skmq.errors import UsageError
from skmq.events import Event
from skmq.logs import configure_logging
from skmq.store import DeadLetter, Store

CHUNK = 500


def configure(parser: argparse.ArgumentParser) -> None:
    verbs = parser.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="list dead letters")
    listing.add_argument("--app", help="only this app")
    listing.add_argument("--json", action="store_true", help="print JSON for scripts")
    listing.add_argument("--limit", type=int, default=None, help="at most N an app")
    add_settings_flags(listing, STORE_FLAGS)
    add_token_flag(listing, "admin token, when the settings configure auth")
    listing.set_defaults(func=run)
    for verb, what in (("replay", "back to pending, attempts reset"), ("purge", "delete")):
        p = verbs.add_parser(verb, help=f"dead letters: {what}")
        which = p.add_mutually_exclusive_group()
        which.add_argument("--all", action="store_true", help="every dead letter")
        which.add_argument("msgids", nargs="*", default=[], metavar="MSGID")
        p.add_argument("--app", help="only this app (with --all, or alone: all of this app)")
        p.add_argument("--json", action="store_true", help="print JSON for scripts")
        add_settings_flags(p, STORE_FLAGS)
        add_token_flag(p, "admin token, when the settings configure auth")
        p.set_defaults(func=run)


async def _selected(
    store: Store, args: argparse.Namespace, only: frozenset[str] | None
) -> list[DeadLetter]:
    apps = [args.app] if args.app else await store.apps()
    apps = [app for app in apps if only is None or app in only]
    letters = [
        d
        for app in apps
        for d in await store.dead_letters(app, args.limit if args.verb == "list" else None)
    ]
    if args.verb != "list" and args.msgids:
        wanted = set(args.msgids)
        letters = [d for d in letters if d.msgid in wanted]
    return letters


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
    if args.app and only is not None and args.app not in only:
        raise UsageError(f"this token has no admin role for app {args.app!r}")
    async with open_store(settings) as store:
        letters = await _selected(store, args, only)
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
        unknown = sorted(set(args.msgids) - {d.msgid for d in letters})
        if unknown:
            raise UnknownDeadLetter(
                f"no dead letter with msgid {', '.join(map(repr, unknown))}"
                f"{' in app ' + repr(args.app) if args.app else ''}: nothing done"
            )
        done = await _apply(store, settings.delivery_log_dir, args.verb, letters)
        structlog.get_logger("skmq.dlq").info(
            "operator action",
            action=f"dlq {args.verb}",
            user=_user(),
            done=done,
            selected=len(letters),
            msgids=[d.msgid for d in letters][:100],
        )
        if args.json:
            print(json.dumps({args.verb: done, "selected": len(letters)}))
        else:
            print(f"{args.verb}: {done} of {len(letters)} dead letter(s)")
        return 0 if done == len(letters) else 1


def _user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return str(os.getuid())


class UnknownDeadLetter(LookupError):
    """A MSGID given that is not a dead letter (nothing is done)."""


async def _apply(
    store: Store, log_dir: os.PathLike[str], verb: str, letters: list[DeadLetter]
) -> int:
    dlog = DeliveryLog(log_dir, f"cli-{socket.gethostname()}-{os.getpid()}")  # type: ignore[arg-type]
    done = 0
    try:
        with Progress(transient=True, disable=len(letters) <= CHUNK) as progress:
            task = progress.add_task(f"{verb}ing", total=len(letters))
            for i in range(0, len(letters), CHUNK):
                chunk = letters[i : i + CHUNK]
                by_app: dict[str, list[DeadLetter]] = {}
                for d in chunk:
                    by_app.setdefault(d.appid, []).append(d)
                for app, items in by_app.items():
                    ids = [d.delivery_id for d in items]
                    if verb == "replay":
                        results = await store.replay(app, ids, now_ms())
                    else:
                        results = await store.purge(app, ids)
                    for d, ok in zip(items, results, strict=True):
                        if ok:
                            done += 1
                            if verb == "replay":
                                dlog.event(
                                    Event.REPLAYED,
                                    d.msgid,
                                    app,
                                    d.kind,
                                    d.recipient,
                                    detail="dead letter replayed by an operator",
                                )
                progress.advance(task, len(chunk))
    finally:
        dlog.close()
    return done


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))
