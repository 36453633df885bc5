"""`skmq serve`: run the broker (zero configuration: an embedded Redis under DATA_DIR)."""

from __future__ import annotations

import argparse
import sys

import uvloop

from skmq.auth import SecurityConfigError
from skmq.broker import serve
from skmq.cli.common import load_settings
from skmq.config import add_settings_flags
from skmq.embedded import DataDirBusy
from skmq.logs import configure_logging


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "serve",
        help="run the broker",
        description="Run the broker. Every setting is also SKMQ_<NAME>.",
    )
    add_settings_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = load_settings(args)
    configure_logging(settings.log_level, settings.log_format)
    try:
        uvloop.run(serve(settings))
    except (DataDirBusy, SecurityConfigError) as exc:
        sys.stderr.write(f"skmq serve: {exc}\n")
        return 2
    return 0
