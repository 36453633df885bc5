"""``skmq audit``: run the Spark delivery-log audit (spark/audit.py) on a log directory.

``skmq audit --logs PATH [PATH ...] --out DIR [--master URL]`` runs the job in
``local[*]`` by default, or on the cluster at ``--master``; docs/AUDIT.md defines
every figure.  With ``--follow`` it watches a live log directory, rewrites the reports
every ``--interval`` seconds and prints each stuck delivery once, until SIGINT or
SIGTERM, then writes the final report (local mode only).  Exit status: 0 done, 1
Spark or storage failed (one line; the trace with ``--debug``), 2 bad arguments or
unreadable input, 3 bad lines under ``--strict``, 130 or 143 stopped by SIGINT or
SIGTERM (without ``--follow``).  It needs PySpark, psutil and
PyArrow (``pip install 'skmq[audit]'``) and Java 17 or 21 (``JAVA_HOME`` or ``java`` on the
PATH); without either it says what to install and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from typing import Any

from skmq.audit_job.arguments import add_arguments
from skmq.cli import fail

SUPPORTED_JAVA = (17, 21)
JAVA_HELP = (
    "Spark 4 needs Java 17 or 21. Install one, for example:\n"
    "  Debian/Ubuntu:  sudo apt-get install openjdk-17-jre-headless\n"
    "  Fedora/RHEL:    sudo dnf install java-17-openjdk-headless\n"
    "  macOS:          brew install openjdk@17\n"
    "then set JAVA_HOME to its directory or put its `java` on the PATH."
)
AUDIT_PACKAGES = ("pyspark", "psutil", "pyarrow")
PYSPARK_HELP = "skmq audit needs PySpark, psutil and PyArrow: pip install 'skmq[audit]'"


def configure(parser: argparse.ArgumentParser) -> None:
    """The ``audit`` subcommand's flags (the job's own, skmq.audit_job.arguments)."""
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_arguments(parser)
    parser.set_defaults(func=run)


def java_version(java: str) -> int | None:
    """The major version of ``java`` (``java -version``), None if it cannot be told."""
    try:
        done = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r'version "(\d+)(?:\.(\d+))?', done.stderr + done.stdout)
    if found is None:
        return None
    major = int(found.group(1))
    if major == 1 and found.group(2) is not None:  # "1.8.0_392" is Java 8
        major = int(found.group(2))
    return major


def find_java() -> tuple[str | None, int | None, str]:
    """(java, major version or None, "") when usable, else (None, version, the reason).

    Spark's launcher uses ``$JAVA_HOME/bin/java`` when JAVA_HOME is set, else ``java``
    on the PATH; so does this check.
    """
    home = os.environ.get("JAVA_HOME")
    if home:
        java = os.path.join(home, "bin", "java")
        if not os.access(java, os.X_OK):
            return None, None, f"JAVA_HOME is {home}, but there is no {java}."
    else:
        found = shutil.which("java")
        if found is None:
            return None, None, "no Java: JAVA_HOME is not set and no `java` is on the PATH."
        java = found
    version = java_version(java)
    if version is not None and version < SUPPORTED_JAVA[0]:
        return None, version, f"{java} is Java {version}, too old."
    return java, version, ""


def run(args: argparse.Namespace) -> int:
    """Run the audit; 0 on success, 2 when PySpark, Java or the logs are missing."""
    if any(importlib.util.find_spec(name) is None for name in AUDIT_PACKAGES):
        print(PYSPARK_HELP, file=sys.stderr)
        return 2
    java, version, problem = find_java()
    if java is None:
        return fail("audit", f"{problem}\n{JAVA_HELP}", 2)
    if version is not None and version not in SUPPORTED_JAVA:
        print(
            f"skmq audit: warning: {java} is Java {version}; Spark 4 supports Java 17 and 21.",
            file=sys.stderr,
        )

    from skmq.audit_job.audit import audit_from_args

    report: dict[str, Any] | int = audit_from_args(args, "skmq audit")
    if isinstance(report, int):
        return report
    totals = report["totals"]
    latency = report["latency_ms"]
    anomalies = report["anomalies"]
    unresolved = report["unresolved"]
    bad = report["input"]["bad_lines"]
    print(
        f"{totals['messages']:,} messages: {totals['acked']:,} acked, "
        f"{totals['dead_lettered']:,} dead-lettered ({totals['dead_letter_entries']:,} "
        f"dead-letter entries), {totals['dropped']:,} expired and dropped, "
        f"{totals['unresolved']:,} unresolved; "
        f"{totals['duplicates']:,} duplicates, {totals['pushes']:,} pushes"
    )
    if latency["p50"] is not None:
        print(
            f"latency due->ack: p50 {latency['p50']} ms, p95 {latency['p95']} ms, "
            f"p99 {latency['p99']} ms, max {latency['max']} ms"
        )
    print(
        f"unresolved deliveries: {unresolved['not_yet_due']:,} not yet due, "
        f"{unresolved['waiting_for_recipient']:,} waiting for a recipient, "
        f"{unresolved['in_flight']:,} in flight, {unresolved['stuck']:,} stuck"
    )
    print(
        f"anomalies: {anomalies['acked_more_than_once']} acked more than once, "
        f"{anomalies['pushed_after_ack']} pushed after ack, "
        f"{anomalies['acked_after_dead_letter']} acked after dead letter"
    )
    if bad["total"]:
        reasons = ", ".join(f"{k} {v}" for k, v in bad["by_reason"].items())
        print(f"bad lines skipped: {bad['total']:,} ({reasons})")
    print(f"report: {args.out} (report.html, report.json, by_app.csv, by_recipient.csv)")
    return 0
