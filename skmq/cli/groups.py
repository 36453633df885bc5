"""`skmq groups list|create|reset|delete --app A [GROUP]`: consumer groups, for operators
(the same operations as the HTTP gateway's, docs/HTTP.md)."""

from __future__ import annotations

import argparse
import asyncio
import json

from skmq.cli import group_position
from skmq.cli.common import open_store, operator_log
from skmq.cli.tokens import add_operator_flags, admin_apps
from skmq.clock import now_ms
from skmq.config import settings_from_args
from skmq.errors import UsageError
from skmq.pull.groups import Groups, bad_group
from skmq.pull.position import HELP, BadPosition


class NoSuchGroup(LookupError):
    """The group named does not exist (nothing is done)."""


def configure(parser: argparse.ArgumentParser) -> None:
    verbs = parser.add_subparsers(dest="verb", required=True)
    for verb, what in (
        ("list", "the app's groups: backlog, in flight, delayed, dead, oldest message's age"),
        ("create", "subscribe a group: it gets every message stored from --from on"),
        ("reset", "move a group to latest, earliest or a time, dropping its leases and waits"),
        ("delete", "delete a group"),
    ):
        p = verbs.add_parser(verb, help=what, description=what)
        p.add_argument("--app", required=True, help="the app")
        if verb != "list":
            p.add_argument("group", metavar="GROUP")
        if verb in ("create", "reset"):
            flag = {"create": "--from", "reset": "--to"}[verb]
            p.add_argument(flag, dest="position", type=group_position, metavar="POSITION",
                           required=verb == "reset", default="latest",
                           help=f"where the group reads from: {HELP}")  # fmt: skip
        add_operator_flags(p)
        p.set_defaults(func=run)


async def _run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    only = admin_apps(settings, args.token)
    if only is not None and args.app not in only:
        raise UsageError(f"this token has no admin role for app {args.app!r}")
    group = getattr(args, "group", None)
    if group is not None and (why := bad_group(group)) is not None:
        raise UsageError(f"group {why}")
    async with open_store(settings) as store:
        if args.verb == "list":
            infos = await Groups(store).describe(args.app)
            now = now_ms()
            rows = [
                {"group": i.name, "backlog": i.backlog, "in_flight": i.in_flight,
                 "delayed": i.delayed, "dead": i.dead, "oldest_age_s": i.oldest_age_s(now)}
                for i in infos
            ]  # fmt: skip
            if args.json:
                print(json.dumps(rows))
            else:
                for row in rows:
                    print(" ".join(f"{k}={v}" for k, v in row.items()))
                print(f"{len(rows)} group(s) of app {args.app!r}")
            return 0
        assert group is not None
        dlog = operator_log(settings)
        groups = Groups(store, dlog)
        try:
            if args.verb in ("create", "reset"):
                start = groups.create if args.verb == "create" else groups.reset
                try:
                    done = await start(args.app, group, args.position)
                except BadPosition as exc:  # (a time after the store's clock)
                    raise UsageError(f"position: {exc}") from None
                said = f"reset to {args.position}"
                if args.verb == "create":
                    said = "created" if done else "exists already"
            else:
                done = await groups.delete(args.app, group)
                said = "deleted"
        finally:
            dlog.close()
        if not done and args.verb != "create":
            raise NoSuchGroup(f"no group {group!r} for app {args.app!r}: nothing done")
        print(json.dumps({"group": group, "result": said}) if args.json else f"{group}: {said}")
        return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))
