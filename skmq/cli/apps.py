"""`skmq apps [--json]`: each app at a glance (skmq/console.py): pending, delayed, in
flight, dead, the oldest pending message's age, recipients alive and lost, consumer
groups, and messages in and out a second over the last minute (of the live brokers)."""

from __future__ import annotations

import argparse
import asyncio
import json

from rich.table import Table

from skmq.cli.common import open_store, table_console
from skmq.cli.tokens import add_operator_flags, admin_apps
from skmq.clock import now_ms
from skmq.config import settings_from_args
from skmq.console import overview

COLUMNS = ("app", "pending", "delayed", "in flight", "dead", "oldest pending",
           "recipients alive/lost", "groups", "in/s", "out/s", "unroutable")  # fmt: skip


def configure(parser: argparse.ArgumentParser) -> None:
    add_operator_flags(parser)
    parser.set_defaults(func=run)


async def _run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    only = admin_apps(settings, args.token)
    async with open_store(settings) as store:
        apps = await overview(store, only, now_ms())
    if args.json:
        print(json.dumps({"apps": apps}, indent=2))
        return 0
    table = Table(title="apps")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "app" else "right")
    for a in apps:
        age = a["oldest_pending_age_s"]
        who = a["recipients"]
        table.add_row(
            a["app"], str(a["pending"]), str(a["delayed"]), str(a["in_flight"]), str(a["dead"]),
            "-" if age is None else f"{age:.1f}s", f"{who['alive']}/{who['lost']}",
            str(a["groups"]), f"{a['rate_in']:.2f}", f"{a['rate_out']:.2f}", str(a["unroutable"]),
        )  # fmt: skip
    table_console().print(table)
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))
