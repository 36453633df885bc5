"""`skmq connections [--json]`: the producers, push links and pull polls of every live
broker, each with its broker, peer address, role (producer, recipient push link, pull
consumer, http), apps and since when, as the brokers' notes list them (each broker
publishes its own about once a second, at most 1000 connections: skmq/connections.py)."""

from __future__ import annotations

import argparse
import asyncio
import json

from rich.table import Table

from skmq.cli.common import open_store, table_console
from skmq.cli.dlq import printable
from skmq.cli.tokens import add_operator_flags, admin_apps
from skmq.clock import now_ms
from skmq.config import settings_from_args
from skmq.connections import live_connections, visible


def configure(parser: argparse.ArgumentParser) -> None:
    add_operator_flags(parser)
    parser.set_defaults(func=run)


async def _run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    only = admin_apps(settings, args.token)
    async with open_store(settings) as store:
        rows, truncated = live_connections(await store.brokers(), now_ms())
    rows = visible(rows, only)
    if args.json:
        print(json.dumps({"connections": rows, "truncated": truncated}, indent=2))
        return 0
    table = Table(title="connections")
    for col in ("broker", "peer", "role", "apps", "since"):
        table.add_column(col)
    for r in rows:
        apps = printable(", ".join(r["apps"]), 80)
        table.add_row(r["broker"], r["peer"], r["role"], apps, f"{r['since_s']:.1f}s ago")
    table_console().print(table)
    if truncated:
        print(f"{truncated} more connection(s) not listed (each broker lists 1000 at most)")
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))
