"""The audit's command-line options, shared by ``skmq audit`` and ``spark/audit.py``.

Imports nothing heavy (no pyspark), so that ``skmq --help`` stays fast.
"""

from __future__ import annotations

import argparse
import math

__all__ = [
    "DEFAULT_INTERVAL_S",
    "DEFAULT_SAMPLE",
    "DEFAULT_STUCK_AFTER_MS",
    "MAX_INTERVAL_S",
    "MAX_STUCK_AFTER_S",
    "add_arguments",
    "check_arguments",
]

DEFAULT_SAMPLE = 20
DEFAULT_INTERVAL_S = 10.0
MAX_INTERVAL_S = 86_400.0
DEFAULT_STUCK_AFTER_MS = 600_000
MAX_STUCK_AFTER_S = 10**9  # 31 years: any log's span; ms beyond 2**63 would not run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the audit's options to ``parser``."""
    parser.add_argument(
        "--logs",
        required=True,
        nargs="+",
        metavar="PATH",
        help="log directory (searched for *.jsonl, .jsonl.gz, .jsonl.bz2), glob, file or URI; "
        "several allowed",
    )
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="directory or URI for the reports"
    )
    parser.add_argument(
        "--master",
        default=None,
        metavar="URL",
        help="Spark master (default local[*] or spark-submit's): spark://host:7077, yarn, ...",
    )
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting, as spark-submit --conf (repeatable)",
    )
    parser.add_argument(
        "--driver-memory", default=None, metavar="SIZE", help="spark.driver.memory, e.g. 4g"
    )
    parser.add_argument(
        "--strict", action="store_true", help="any bad line is an error (exit status 3)"
    )
    parser.add_argument(
        "--skip-bad-files",
        action="store_true",
        help="audit the readable files when some cannot be read (truncated gzip, ...)",
    )
    parser.add_argument(
        "--stuck-after",
        type=float,
        default=DEFAULT_STUCK_AFTER_MS / 1000,
        metavar="SECONDS",
        help="an unresolved delivery with no event for this long is stuck (default 600)",
    )
    parser.add_argument(
        "--sample",
        type=int,
        default=DEFAULT_SAMPLE,
        metavar="N",
        help=f"msgids kept in each sample (default {DEFAULT_SAMPLE})",
    )
    parser.add_argument(
        "--follow",
        action="store_true",
        help="watch a live log directory: rewrite the reports every --interval, print each "
        "stuck delivery once, until SIGINT or SIGTERM (then a final report)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        metavar="SECONDS",
        help=f"with --follow: seconds between reports (default {DEFAULT_INTERVAL_S:g})",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--debug", action="store_true", help="show the stack trace of a failure")


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError (one line) for a value the parser let pass: ``--stuck-after inf``."""
    stuck = args.stuck_after
    if not (math.isfinite(stuck) and 0 < stuck <= MAX_STUCK_AFTER_S):
        raise ValueError(
            f"--stuck-after {stuck:g}: expected a number of seconds above 0 and at most "
            f"{MAX_STUCK_AFTER_S:g}"
        )
    interval = args.interval
    if not (math.isfinite(interval) and 0 < interval <= MAX_INTERVAL_S):
        raise ValueError(
            f"--interval {interval:g}: expected a number of seconds above 0 and at most "
            f"{MAX_INTERVAL_S:g}"
        )
    if args.sample < 0:
        raise ValueError(f"--sample {args.sample}: expected 0 or more")
