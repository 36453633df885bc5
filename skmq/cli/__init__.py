"""The `skmq` command: one subcommand a module, each exposing `register(subparsers)`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from skmq.cli import audit, consume, dlq, send, serve, status

SUBCOMMANDS = (serve, send, consume, status, dlq, audit)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="skmq", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.register(sub)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result
