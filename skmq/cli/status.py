"""`skmq status [--json] [--watch]`: per app depths, each recipient's state, each
consumer group's backlog, in flight, delayed and dead, and how Redis persists them."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from skmq.cli import seconds
from skmq.cli.common import open_store, table_console
from skmq.cli.tokens import add_operator_flags, admin_apps
from skmq.clock import now_ms
from skmq.config import settings_from_args
from skmq.pull.groups import Groups
from skmq.queue.owned_store import OwnedStore
from skmq.store.checks import persistence


def configure(parser: argparse.ArgumentParser) -> None:
    add_operator_flags(parser)
    parser.add_argument("--watch", action="store_true", help="refresh in place (live view)")
    parser.add_argument("--interval", type=seconds, default=1.0, help="--watch refresh, seconds")
    parser.set_defaults(func=run)


async def snapshot(store: OwnedStore, only: frozenset[str] | None = None) -> dict[str, Any]:
    """Every app's depths and recipients; with `only`, just those apps'."""
    now = now_ms()
    apps = [app for app in await store.apps() if only is None or app in only]
    counts = await store.counts(apps, now)
    recipients = await store.recipients(apps)
    brokers = await store.brokers()
    groups = await Groups(store).describe_apps(apps)
    tallies = await store.tallies(apps)
    return {
        "ts": now,
        "redis": await persistence(store.redis),
        "apps": [
            {
                "appid": app,
                "pending": counts[app].pending,
                "delayed": counts[app].delayed,
                "in_flight": counts[app].in_flight,
                "dead": counts[app].dead,
                # stored with no recipient and no group to go to (skmq/workers/routes.py)
                "unroutable": tallies[app].unroutable,
                # registrations that took an id alive at another address over
                "takeovers": tallies[app].takeovers,
                "last_takeover": tallies[app].last_takeover,
                "recipients": [
                    {
                        # A record of another shape (by hand, an older release) shows
                        # as what it has: the broker skips it.
                        "id": r.get("id"),
                        "host": r.get("host"),
                        "port": r.get("port"),
                        "weight": r.get("weight", 0),
                        "state": "alive" if r["alive"] else "lost",
                        "last_heartbeat": r["last_heartbeat"],
                    }
                    for r in recipients[app]
                ],
                "groups": [
                    {
                        "group": g.name,
                        "backlog": g.backlog,
                        "in_flight": g.in_flight,
                        "delayed": g.delayed,
                        "dead": g.dead,
                    }
                    for g in groups.get(app, [])
                ],
            }
            for app in apps
        ],
        "brokers": [
            {"id": k, "last_seen": v.get("last_seen"), "alive": now - v.get("last_seen", 0) < 5000}
            for k, v in sorted(brokers.items())
        ],
    }


def render(snap: dict[str, Any], rates: dict[str, float] | None = None) -> Group:
    apps = Table(title="apps")
    columns = ["app", "pending", "delayed", "in flight", "dead", "unroutable", "takeovers"]
    if rates is not None:
        columns.append("done/s")
    for col in columns:
        apps.add_column(col, justify="right" if col != "app" else "left")
    recips = Table(title="recipients")
    for col in ("app", "recipient", "address", "weight", "state", "last heartbeat"):
        recips.add_column(col)
    groups = Table(title="consumer groups")
    for col in ("app", "group", "backlog", "in flight", "delayed", "dead"):
        groups.add_column(col, justify="left" if col in ("app", "group") else "right")
    for a in snap["apps"]:
        row = [
            a["appid"],
            str(a["pending"]),
            str(a["delayed"]),
            str(a["in_flight"]),
            str(a["dead"]),
            str(a.get("unroutable", 0)),
            str(a.get("takeovers", 0)),
        ]
        if rates is not None:
            row.append(f"{rates.get(a['appid'], 0.0):.0f}")
        apps.add_row(*row)
        for r in a["recipients"]:
            ago = (snap["ts"] - r["last_heartbeat"]) / 1000 if r["last_heartbeat"] else None
            recips.add_row(
                a["appid"],
                r["id"],
                f"{r['host']}:{r['port']}",
                str(r["weight"]),
                r["state"],
                "never" if ago is None else f"{ago:.1f}s ago",
            )
        for g in a.get("groups", []):
            groups.add_row(a["appid"], g["group"], str(g["backlog"]), str(g["in_flight"]),
                           str(g["delayed"]), str(g["dead"]))  # fmt: skip
    tables = (apps, recips, groups) if groups.row_count else (apps, recips)
    return Group(*tables, *takeovers(snap), Text(persisted(snap["redis"])))


def takeovers(snap: dict[str, Any]) -> list[Text]:
    """A line for each app's last takeover: a registration that took an id alive at
    another address over (a second consumer started with an id in use)."""
    lines = []
    for a in snap["apps"]:
        last = a.get("last_takeover")
        if last:
            ago = (snap["ts"] - int(last.get("ts", 0))) / 1000
            lines.append(Text(
                f"takeover: app {a['appid']} recipient {last.get('id')} taken over from "
                f"{last.get('from')} by {last.get('to')}, {ago:.0f}s ago "
                f"({a['takeovers']} in all)"
            ))  # fmt: skip
    return lines


def persisted(redis: dict[str, str | None]) -> str:
    """`Redis: appendonly yes, appendfsync everysec` (a cluster's nodes differing: each
    value found; unknown where CONFIG is not allowed)."""
    found = ", ".join(f"{name} {value or 'unknown'}" for name, value in redis.items())
    volatile = "" if redis.get("appendonly") in ("yes", None) else " (volatile: no AOF)"
    return f"Redis: {found}{volatile}"


async def _run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    only = admin_apps(settings, args.token)
    async with open_store(settings) as store:
        if not args.watch:
            snap = await snapshot(store, only)
            if args.json:
                print(json.dumps(snap, indent=2))
            else:
                table_console().print(render(snap))
            return 0
        previous: dict[str, int] = {}
        stamp = time.monotonic()
        with Live(render(await snapshot(store, only)), refresh_per_second=4) as live:
            while True:
                await asyncio.sleep(args.interval)
                snap = await snapshot(store, only)
                now = time.monotonic()
                # A drop in pending + in flight + delayed is what left: a throughput estimate.
                total = {
                    a["appid"]: a["pending"] + a["in_flight"] + a["delayed"] for a in snap["apps"]
                }
                rates = {
                    app: max(0.0, (previous.get(app, n) - n) / (now - stamp))
                    for app, n in total.items()
                }
                previous, stamp = total, now
                live.update(render(snap, rates))


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 0
