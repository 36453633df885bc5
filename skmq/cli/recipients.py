"""`skmq recipients [--app A] [--json]`: every app's registered recipients, each with its
address, weight, state (alive or lost) and the age of its last heartbeat.

`skmq recipients remove --app A --id R`: remove a recipient gone for good, as its own
`unregister` would: its topic copies no longer wait for it (they fail as undeliverable,
dead-lettered after RETRY_TIMES) and its pushes in flight end as an unregistered
recipient's. Written to the delivery log (`recipient_removed`, under this command's own
instance id) and logged (a structlog line on stderr: who, what). Status 1 when it was not
registered.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from rich.table import Table

from skmq.cli.common import admin_app, open_store, operator, operator_log, table_console
from skmq.cli.dlq import printable
from skmq.cli.tokens import add_operator_flags, admin_apps
from skmq.clock import now_ms
from skmq.config import Settings, settings_from_args
from skmq.errors import UsageError
from skmq.logs import configure_logging
from skmq.registry.recipients import recipient_rows, remove_recipient
from skmq.registry.registration import CONTROL, MAX_ID


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--app", help="only this app")
    add_operator_flags(parser)
    verbs = parser.add_subparsers(dest="verb", metavar="remove")
    remove = verbs.add_parser("remove", help="remove a recipient gone for good")
    remove.add_argument("--app", required=True, help="its app")
    remove.add_argument("--id", required=True, dest="rid", help="its id")
    add_operator_flags(remove)
    parser.set_defaults(func=run, verb=None)


async def _list(args: argparse.Namespace, settings: Settings, only: frozenset[str] | None) -> int:
    async with open_store(settings) as store:
        apps = [args.app] if args.app else await store.apps()
        apps = [app for app in apps if only is None or app in only]
        rows = recipient_rows(await store.recipients(apps), now_ms())
    if args.json:
        print(json.dumps({"recipients": rows}, indent=2))
        return 0
    table = Table(title="recipients")
    for col in ("app", "recipient", "address", "weight", "state", "last seen"):
        table.add_column(col)
    for r in rows:
        age = r["last_seen_age_s"]
        table.add_row(
            printable(r["app"]),
            printable(r["id"]),
            printable(r["address"]),
            str(r["weight"]),
            r["state"],
            "never" if age is None else f"{age:.1f}s ago",
        )
    table_console().print(table)
    return 0


async def _remove(args: argparse.Namespace, settings: Settings) -> int:
    configure_logging(settings.log_level, settings.log_format)
    async with open_store(settings) as store:
        dlog = operator_log(settings)
        try:
            by = f"{operator()} via cli"
            removed = await remove_recipient(store.unregister, dlog, args.app, args.rid, by)
        finally:
            dlog.close()
    if args.json:
        print(json.dumps({"app": args.app, "id": args.rid, "removed": removed}))
    elif removed:
        print(f"removed recipient {printable(args.rid)} of app {printable(args.app)}")
    else:
        print(f"recipient {printable(args.rid)} of app {printable(args.app)} was not registered")
    return 0 if removed else 1


async def _run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    only = admin_apps(settings, args.token)
    if args.app is not None:
        admin_app(args.app, only)
    if args.verb != "remove":
        return await _list(args, settings, only)
    if not args.rid or len(args.rid) > MAX_ID or CONTROL.search(args.rid):
        raise UsageError(f"--id must be 1 to {MAX_ID} printable characters")
    return await _remove(args, settings)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))
