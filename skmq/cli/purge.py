"""`skmq purge --app A [--older-than SECONDS] [--max N] [--dry-run] [--json]`: delete
messages waiting in an app (pending, delayed, waiting for a retry or behind their
ordering key; never one in flight or dead), oldest first (skmq/console.py). Each is
written to the delivery log as `purged` (detail `pending message purged by an operator
(user ...)`) under this command's own instance id, so the audit counts it; a dry run
says what would go and changes nothing. Dead letters: `skmq dlq purge`."""

from __future__ import annotations

import argparse
import asyncio
import json

import structlog

from skmq.cli import seconds, whole_number
from skmq.cli.common import admin_app, open_store, operator, operator_log
from skmq.cli.tokens import add_operator_flags, admin_apps
from skmq.clock import now_ms
from skmq.config import settings_from_args
from skmq.console import purge
from skmq.logs import configure_logging


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--app", required=True, help="the app to purge")
    parser.add_argument("--older-than", type=seconds, help="only those stored SECONDS ago or more")
    parser.add_argument("--max", type=whole_number(1), help="at most N, oldest first")
    parser.add_argument("--dry-run", action="store_true", help="say what would go, do nothing")
    add_operator_flags(parser)
    parser.set_defaults(func=run)


async def _run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    configure_logging(settings.log_level, settings.log_format)
    app = admin_app(args.app, admin_apps(settings, args.token))
    user = operator()
    async with open_store(settings) as store:
        dlog = operator_log(settings)
        try:
            purged = await purge(store, dlog, app, args.older_than, args.max, args.dry_run,
                                 f"user {user}", now_ms())  # fmt: skip
        finally:
            dlog.close()
    msgids = [p.msgid for p in purged]
    if not args.dry_run:
        structlog.get_logger("skmq.console").info(
            "operator action", action="purge", user=user, app=app, done=len(purged),
            msgids=msgids[:100],
        )  # fmt: skip
    if args.json:
        print(json.dumps({"app": app, "purged": len(purged), "dry_run": args.dry_run,
                          "msgids": msgids}))  # fmt: skip
    elif args.dry_run:
        print(f"dry run: would purge {len(purged)} message(s) of app {app}; nothing done")
    else:
        print(f"purged {len(purged)} message(s) of app {app}")
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))
