"""`skmq peek --app A [--max N] [--dead] [--json]`: the messages waiting in an app (or,
with --dead, its dead letters), oldest first, each with its age, attempts, ordering
key, size and the start of its content, shown safely (skmq/console.py); nothing
changes."""

from __future__ import annotations

import argparse
import asyncio
import json

from skmq.cli import whole_number
from skmq.cli.common import admin_app, open_store
from skmq.cli.tokens import add_operator_flags, admin_apps
from skmq.clock import now_ms
from skmq.config import settings_from_args
from skmq.console import PEEK_MAX, dead_json, waiting_json


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--app", required=True, help="the app to look into")
    parser.add_argument(
        "--max",
        type=whole_number(1, PEEK_MAX),
        default=20,
        help=f"at most N, oldest first (default 20, at most {PEEK_MAX})",
    )
    parser.add_argument("--dead", action="store_true", help="the dead letters instead")
    add_operator_flags(parser)
    parser.set_defaults(func=run)


async def _run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    app = admin_app(args.app, admin_apps(settings, args.token))
    async with open_store(settings) as store:
        now = now_ms()
        if args.dead:
            found = [dead_json(d, now) for d in await store.dead_letters(app, args.max)]
        else:
            found = [waiting_json(w, now) for w in await store.peek(app, args.max, now)]
    if args.json:
        print(json.dumps({"messages": found}, indent=2))
        return 0
    for m in found:
        key = f" key={m['key']}" if m["key"] is not None else ""
        print(f"{m['msgid']} age={m['age_s']:.1f}s attempts={m['attempts']}{key} "
              f"size={m['size']} preview={m['preview']}")  # fmt: skip
    print(f"{len(found)} {'dead letter' if args.dead else 'message'}(s)")
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))
