"""`skmq serve`: run the broker (zero configuration: an embedded Redis under DATA_DIR)."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    from skmq.config import add_settings_flags, settings_help

    parser.description = (
        "Run the broker. Each setting is a flag, an SKMQ_* environment variable or a key of "
        "the --config file; `skmq config` shows those in effect and where each comes from."
    )
    parser.usage = "skmq serve [--config PATH] [--SETTING VALUE ...]"
    parser.formatter_class = settings_help
    add_settings_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """0 after SIGTERM/SIGINT; a failure raises (one line by `skmq`, status 1, or 2 for a
    bad setting)."""
    import os

    import structlog

    from skmq.broker import serve
    from skmq.config import settings_from_args, unknown_env
    from skmq.logs import configure_logging
    from skmq.loop import run_main
    from skmq.tracing import from_environment

    settings = settings_from_args(args)
    configure_logging(settings.log_level, settings.log_format)
    log = structlog.get_logger("skmq")
    for name in unknown_env(os.environ):
        log.warning("environment variable names no setting", name=name)
    if (why := from_environment("skmq-broker")) is not None:
        log.warning("tracing off", reason=why)
    run_main(serve(settings))
    return 0
