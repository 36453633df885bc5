"""Delivery-log audit of SKMQ: a PySpark job on the DataFrame API.

Input
-----
The broker's delivery log (SPEC section 7): JSON lines files
``LOG_DIR/delivery-<broker_id>-<n>.jsonl``, one event a line::

    {"ts": <unix ms>, "event": str, "msgid": str, "appid": str, "kind": "queue"|"topic",
     "recipient": str|null, "attempt": int|null, "broker": str, "detail": str|null}

``--logs`` takes one or more paths.  A local directory is searched recursively for
``*.jsonl`` (also ``*.jsonl.gz``/``*.jsonl.bz2``; names starting with ``.`` or ``_`` are
skipped); a local glob is expanded; any other path (``hdfs://``, ``s3a://``, ...) is
given to Spark as it is.  The files are read with an explicit schema (no inference).
Events may come in any order within and across files.  A line that is not valid JSON
or lacks ``ts``, ``event`` or ``appid`` (or whose ``ts`` is not in ``0 .. 2**42``, i.e.
before the year 2109) is counted in ``anomalies.invalid_lines`` and otherwise ignored
(e.g. the torn last line of a broker killed mid-write); blank lines are skipped.

Definitions
-----------
*Message*: identified by ``(appid, msgid)`` (msgids are unique per app only).  Events
of ``recipient_registered``/``recipient_lost``/``recipient_alive`` and events with an
empty msgid are not message events.  A message *is stored* when it has a ``stored``
event; everything in ``totals``, ``latency_ms``, ``attempts`` and ``by_app`` is about
stored messages, except ``duplicates`` and ``pushes``, which count events.

``totals``
    ``messages``: distinct stored ``(appid, msgid)``.  ``duplicates``: number of
    ``duplicate`` events.  ``acked``: stored messages with at least one ``acked`` event.
    ``dead_lettered``: stored messages with a ``dead_lettered`` event and no ``acked``
    event.  ``unresolved``: stored messages with neither.  ``pushes``: number of
    ``pushed`` events.  So ``messages == acked + dead_lettered + unresolved``.
    These rules are applied to topic messages as they are, over all the message's
    events whatever the recipient: a topic message counts as acked when any recipient
    acked it, dead-lettered when some copy was dead-lettered and no copy was acked.
    A message dead-lettered, replayed and not acked since still counts as
    dead-lettered; one acked after a replay counts as acked.

``latency_ms``
    Over acked stored messages: ``first_ack_ts - stored_ts`` where ``stored_ts`` is the
    earliest ``stored`` event and ``first_ack_ts`` the earliest ``acked`` event of the
    message (any recipient for a topic message).  ``p50``/``p95``/``p99`` are *exact*
    percentiles with linear interpolation between closest ranks (Spark SQL's
    ``percentile``; numpy's default ``linear`` method): for the sorted values
    ``x[0..n-1]`` and fraction ``p``, ``r = p * (n - 1)``, the result is
    ``x[floor(r)] + (r - floor(r)) * (x[floor(r) + 1] - x[floor(r)])``.  Values are
    rounded to 0.001 ms; ``max`` is an integer.  All four are ``null`` when nothing was
    acked.  Latencies are not clamped: clock skew between brokers can make one negative
    (counted in ``anomalies.acked_before_stored``).

``attempts``
    For acked stored messages: how many had their first ``acked`` event (earliest ts;
    on a tie the lower attempt, an event without attempt last) on attempt 1, 2, ...;
    keys are the attempt numbers as strings in numeric order, ``"unknown"`` last for a
    first ``acked`` event without an attempt.

``by_app``
    One object per appid with at least one stored message, sorted by appid:
    ``appid``, ``messages``, ``acked``, ``dead_lettered``, ``unresolved`` (as in totals)
    and ``p99_ms`` (the app's exact p99 latency as above, ``null`` if nothing acked).

``by_recipient``
    One object per ``(appid, recipient)`` seen on any event with a recipient (including
    the recipient events, so an idle or lost recipient shows with zeros), sorted by
    appid then recipient: ``pushes``, ``acked``, ``rejected``, ``errored``, ``timeouts``:
    the numbers of ``pushed``, ``acked``, ``rejected``, ``errored`` and ``timeout``
    events naming that recipient.

``anomalies``
    Resolution is per *delivery*: a queue message is one delivery; a topic message has
    one delivery per recipient named on its events (events of a topic message without a
    recipient - e.g. ``stored`` - belong to the message; if such an event is an
    ``acked``, ``dead_lettered`` or ``replayed`` it applies to each of its deliveries);
    a stored topic message with no recipient at all is one delivery with recipient
    ``null``.  Only deliveries of stored messages are considered.

    - ``acked_more_than_once``: deliveries with more than one ``acked`` event;
    - ``pushed_after_ack``: deliveries with a ``pushed`` event later (strictly greater
      ts) than their first ``acked`` event (for a topic message a push to recipient B
      after recipient A's ack is normal and not counted);
    - ``acked_after_dead_letter``: deliveries with an ``acked`` event strictly later than
      a ``dead_lettered`` event with no ``replayed`` event between them (an ack after an
      operator's replay is normal; at equal ts the order is acked, dead_lettered,
      replayed);
    - ``unresolved``: deliveries with neither ``acked`` nor ``dead_lettered``, and
      ``unresolved_sample``: the first ``sample_size`` of them (default 20) as
      ``{"appid", "msgid", "recipient"}`` sorted by appid, msgid, recipient (nulls first);
    - ``samples``: the same kind of bounded sample for the three counts above;
    - ``acked_before_stored``: acked stored messages whose first ack is earlier than
      their ``stored`` event (clock skew);
    - ``unstored_messages``: ``(appid, msgid)`` with message events but no ``stored``
      event (a log file missing, or received and never stored); not in any other count;
    - ``invalid_lines``: lines that are not a valid event.

Outputs
-------
``OUT/report.json`` (top-level keys exactly ``totals``, ``latency_ms``, ``attempts``,
``by_app``, ``by_recipient``, ``anomalies``; lists sorted, so the same logs always give
the same bytes), ``OUT/report.html`` (self-contained, inline SVG charts, see
``report_html.py``), ``OUT/by_app.csv`` and ``OUT/by_recipient.csv`` (written by Python
from the collected rows, one file each).  Progress goes to stderr as stage lines.

Running it
----------
``skmq audit --logs DIR --out OUT [--master URL]`` or, on a cluster,
``spark-submit [--master URL] spark/audit.py --logs PATH --out OUT``; or
``python spark/audit.py ...``.  This file does not import ``skmq``; it needs
``report_html.py`` beside it (with ``--deploy-mode cluster`` add
``--py-files spark/report_html.py``).  No Python UDF is used: executors run only
Spark SQL expressions and need no Python code from this project.

Scaling on a cluster
--------------------
The logs are read in parallel splits (one task per file or per 128 MB of it; gzip files
are not splittable, so many moderate files beat one huge one), parsed once and cached
(memory and disk), since several aggregations read them.  One shuffle carries event
volume: the hash aggregation of events per delivery ``(appid, msgid, recipient of a
topic copy)``, with map-side partial aggregation, so what crosses the network is about
one row per delivery and map task (only fixed-width aggregates are used there, so no
sort of the events is needed).  The per-recipient and per-time-bucket counts are hash
aggregations too whose shuffles carry only partial counts.  The per-delivery table
(about one row per message) is shuffled once more for a window over ``(appid, msgid)``;
the per-message aggregation reuses that partitioning.  The per-app and global
aggregates shuffle partial aggregates only; the exact percentiles keep one count per
distinct latency value in ms per group, which stays small because latencies are whole
milliseconds within a bounded range.  The acked-after-dead-letter scan looks only at
deliveries having both an ack and a dead letter (normally few; AQE broadcasts them).
Only aggregated rows come back to the driver: one row per app, per recipient, per
attempt number, per latency bucket (at most 29) and per time bucket (at most ~120),
and at most ``sample_size`` msgids per anomaly sample; nothing grows with the number
of messages.  The work is spread over as many executors as there are partitions, so
it scales out roughly linearly with the log volume.  On a cluster pass ``--master``
(``spark://host:7077``, ``yarn``, ``k8s://...``) to ``skmq audit``/this file, or run
``spark-submit --master URL spark/audit.py --logs PATH --out DIR``; the log path must
then be readable by the executors (HDFS, S3, a shared mount), and ``--out`` is written
by the driver.  Local mode (the default ``local[*]``) sets
``spark.sql.shuffle.partitions`` to twice the cores and ``SPARK_LOCAL_IP=127.0.0.1``
unless set (under ``spark-submit`` the JVM is already up: set it in the environment).
"""

from __future__ import annotations

import argparse
import atexit
import csv
import glob
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TextIO

from pyspark import StorageLevel
from pyspark.errors import AnalysisException
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType

# timezone.utc, not datetime.UTC: the official Spark images run Python 3.10.
UTC = timezone.utc  # noqa: UP017

try:
    from spark.report_html import render_html
except ImportError:  # run as a script (spark-submit spark/audit.py): the sibling module
    from report_html import render_html  # type: ignore[import-not-found,no-redef]

__all__ = [
    "LOG_SCHEMA",
    "REPORT_KEYS",
    "AuditInputError",
    "AuditResult",
    "build_spark",
    "compute_report",
    "main",
    "resolve_log_paths",
    "run_audit",
    "write_outputs",
]

LOG_SCHEMA = StructType(
    [
        StructField("ts", LongType(), True),
        StructField("event", StringType(), True),
        StructField("msgid", StringType(), True),
        StructField("appid", StringType(), True),
        StructField("kind", StringType(), True),
        StructField("recipient", StringType(), True),
        StructField("attempt", LongType(), True),
        StructField("broker", StringType(), True),
        StructField("detail", StringType(), True),
    ]
)

REPORT_KEYS = ("totals", "latency_ms", "attempts", "by_app", "by_recipient", "anomalies")
BY_APP_FIELDS = ("appid", "messages", "acked", "dead_lettered", "unresolved", "p99_ms")
BY_RECIPIENT_FIELDS = ("appid", "recipient", "pushes", "acked", "rejected", "errored", "timeouts")
RECIPIENT_EVENTS = ("recipient_registered", "recipient_lost", "recipient_alive")
LOG_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.bz2")
PERCENTILES = (0.5, 0.95, 0.99)
STAGES = 6
DEFAULT_SAMPLE = 20
MAX_TIME_BUCKETS = 120
# Bucket widths for the throughput chart, in ms: the smallest giving <= MAX_TIME_BUCKETS.
_TIME_WIDTHS = [
    s * 1000 for s in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600)
] + [43200_000 * k for k in (1, 2, 4, 7, 14, 28, 56, 112, 224, 448)]
# Upper edges (exclusive, ms) of the latency histogram buckets, roughly log-spaced.
_S, _MIN, _H = 1000, 60_000, 3_600_000
LATENCY_EDGES: tuple[int, ...] = (
    *(1, 2, 5, 10, 20, 50, 100, 200, 500),
    *(_S, 2 * _S, 5 * _S, 10 * _S, 20 * _S, 30 * _S),
    *(_MIN, 2 * _MIN, 5 * _MIN, 10 * _MIN, 20 * _MIN, 30 * _MIN),
    *(_H, 2 * _H, 6 * _H, 12 * _H, 24 * _H, 48 * _H),
)
# An acked event's (ts, attempt) packed in a long: ts << 20 | attempt (all ones: none).
_ATTEMPT_BITS = 20
_NO_ATTEMPT = (1 << _ATTEMPT_BITS) - 1
_MAX_ATTEMPT = _NO_ATTEMPT - 1
# Valid ts: 0 <= ts < 2**42 (until the year 2109), so that the packing cannot overflow.
MAX_TS = 1 << 42
# Ordering of events with equal ts in the acked-after-dead-letter scan.
_PRIO_ACKED, _PRIO_DEAD, _PRIO_REPLAYED = 0, 1, 2
_GLOB_CHARS = re.compile(r"[*?\[]")


class AuditInputError(Exception):
    """The given log paths hold no delivery log (or do not exist)."""


@dataclass
class AuditResult:
    """The report (what goes to report.json) and the extra series the HTML page draws."""

    report: dict[str, Any]
    extras: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- progress


class _Progress:
    """Stage lines on stderr: ``[2/6] grouping ... `` then ``[2/6] ... done (1.2s)``."""

    def __init__(self, total: int, stream: TextIO | None) -> None:
        self.total = total
        self.stream = stream
        self.index = 0
        self.started = time.monotonic()

    def _say(self, text: str) -> None:
        if self.stream is not None:
            self.stream.write(text + "\n")
            self.stream.flush()

    @contextmanager
    def stage(self, label: str) -> Iterator[list[str]]:
        self.index += 1
        tag = f"[{self.index}/{self.total}]"
        self._say(f"{tag} {label} ...")
        start = time.monotonic()
        notes: list[str] = []
        yield notes
        now = time.monotonic()
        detail = f": {', '.join(notes)}" if notes else ""
        self._say(
            f"{tag} {label} done{detail} ({now - start:.1f}s, total {now - self.started:.1f}s)"
        )

    def note(self, text: str) -> None:
        self._say(text)


# ------------------------------------------------------------------------------ input


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _log_files_under(directory: str) -> list[str]:
    found: list[str] = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        for name in files:
            if name.startswith((".", "_")):
                continue
            if name.endswith(LOG_SUFFIXES):
                found.append(os.path.join(root, name))
    return sorted(found)


def resolve_log_paths(logs: str | Sequence[str], *, must_exist: bool = True) -> list[str]:
    """Turn ``--logs`` arguments into the list of paths given to Spark.

    Local directories are searched recursively for ``*.jsonl`` files, local globs are
    expanded, URIs with a scheme pass through.  Raises :class:`AuditInputError` when a
    local argument yields no file.  With ``must_exist=False`` (a cluster) a path that is
    not found here passes through too (Spark resolves it on the cluster's default
    file system, e.g. HDFS) and local files are given as ``file:`` URIs.
    """
    items = [logs] if isinstance(logs, str) else list(logs)
    if not items:
        raise AuditInputError("no log path given")
    uris: list[str] = []  # given to Spark as they are
    files: list[str] = []  # found here
    for item in items:
        if _is_remote(item):
            uris.append(item)
            continue
        local = item[len("file://") :] if item.startswith("file://") else item
        local = os.path.expanduser(local)
        if os.path.isdir(local):
            found = _log_files_under(local)
            if not found:
                raise AuditInputError(
                    f"no delivery log files ({', '.join('*' + s for s in LOG_SUFFIXES)}) "
                    f"under {item}"
                )
            files.extend(found)
        elif os.path.isfile(local):
            files.append(local)
        elif _GLOB_CHARS.search(local) and glob.glob(local, recursive=True):
            for match in sorted(glob.glob(local, recursive=True)):
                files.extend(_log_files_under(match) if os.path.isdir(match) else [match])
        elif not must_exist:
            uris.append(item)
        elif _GLOB_CHARS.search(local):
            raise AuditInputError(f"no file matches {item}")
        else:
            raise AuditInputError(f"no such file or directory: {item}")
    if not files and not uris:
        raise AuditInputError(f"no delivery log files in {', '.join(items)}")
    absolute = [os.path.abspath(f) for f in files]
    if not must_exist:
        absolute = [f"file://{f}" for f in absolute]
    return list(dict.fromkeys([*absolute, *uris]))


# ------------------------------------------------------------------------------ spark

# WARN at the root (the level Spark's shell default expects, so it says nothing about
# it); ERROR for the usual start-up noise; build_spark then sets ERROR everywhere.
_LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
"""


def _quiet_log4j_file() -> str:
    directory = tempfile.mkdtemp(prefix="skmq-audit-log4j-")
    atexit.register(shutil.rmtree, directory, True)
    path = os.path.join(directory, "log4j2.properties")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(_LOG4J2)
    return path


def _local_cores(master: str | None) -> int | None:
    """Cores of a local master (``None`` means the default ``local[*]``); None if not local."""
    cpus = os.cpu_count() or 2
    if master is None or master == "local[*]":
        return cpus
    found = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\s*\d+)?\])?", master.strip())
    if found is None:
        return None
    value = found.group(1)
    if value is None:
        return 1
    return cpus if value == "*" else max(1, int(value))


def build_spark(master: str | None = None, app_name: str = "skmq-audit") -> SparkSession:
    """A quiet SparkSession: ``local[*]`` unless ``master`` (or spark-submit) says otherwise.

    In local mode ``SPARK_LOCAL_IP`` defaults to 127.0.0.1 and the shuffle partitions to
    twice the cores.  The UI is off and the log level is ERROR.
    """
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ  # the JVM already runs
    cores = _local_cores(master) if (master is not None or not under_submit) else None
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
    if cores is not None:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = builder.config("spark.sql.shuffle.partitions", str(max(2, 2 * cores)))
    if not under_submit:
        builder = builder.config(
            "spark.driver.extraJavaOptions",
            f"-Dlog4j2.configurationFile=file:{_quiet_log4j_file()}",
        )
    builder = (
        builder.config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.adaptive.enabled", "true")
    )
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session


# ------------------------------------------------------------------------ computation


def _is(name: str) -> Column:
    return F.col("event") == F.lit(name)


def _count_if(cond: Column) -> Column:
    return F.count(F.when(cond, F.lit(1)))


def _round(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    if math.isnan(number):
        return None
    return round(number, 3)


def _latency_bucket(col: Column) -> Column:
    """Index of the latency histogram bucket: -1 negative, i < len(EDGES), len for beyond."""
    expr = F.when(col < 0, F.lit(-1))
    for index, edge in enumerate(LATENCY_EDGES):
        expr = expr.when(col < edge, F.lit(index))
    return expr.otherwise(F.lit(len(LATENCY_EDGES)))


def _ack_key() -> Column:
    """``ts`` and ``attempt`` of an event in one long that orders as (ts, attempt).

    A missing attempt sorts after any number; attempts are clamped to the field.
    """
    attempt = F.least(F.greatest(F.col("attempt"), F.lit(0)), F.lit(_MAX_ATTEMPT))
    return F.shiftleft(F.col("ts"), _ATTEMPT_BITS) + F.coalesce(attempt, F.lit(_NO_ATTEMPT))


def _ack_ts(key: Column) -> Column:
    return F.shiftright(key, _ATTEMPT_BITS)


def _ack_attempt(key: Column) -> Column:
    attempt = key.bitwiseAND(F.lit(_NO_ATTEMPT))
    return F.when(attempt != _NO_ATTEMPT, attempt)


def _acked_after_dead_letter(message_events: DataFrame, deliveries: DataFrame) -> DataFrame:
    """Deliveries acked after a dead letter with no replay between (appid, msgid, recipient).

    Only deliveries with both an ack and a dead letter can be: their ack, dead-letter
    and replay events (those of the recipient, and the message-wide ones) are gathered,
    sorted by (ts, acked < dead_lettered < replayed) and scanned.
    """
    candidates = deliveries.where(F.col("acked_and_dead")).select(
        F.col("appid").alias("c_appid"),
        F.col("msgid").alias("c_msgid"),
        F.col("recipient"),
    )
    prio = (
        F.when(_is("acked"), F.lit(_PRIO_ACKED))
        .when(_is("dead_lettered"), F.lit(_PRIO_DEAD))
        .otherwise(F.lit(_PRIO_REPLAYED))
    )
    steps = message_events.where(F.col("event").isin("acked", "dead_lettered", "replayed")).select(
        "appid",
        "msgid",
        F.when(
            (F.col("kind") == "topic") & F.col("recipient").isNotNull(), F.col("recipient")
        ).alias("rkey"),
        F.struct(F.col("ts").alias("ts"), prio.alias("prio")).alias("step"),
    )
    joined = steps.join(
        candidates,
        (steps["appid"] == candidates["c_appid"])
        & (steps["msgid"] == candidates["c_msgid"])
        & (steps["rkey"].isNull() | steps["rkey"].eqNullSafe(candidates["recipient"])),
    )
    scan = F.aggregate(
        F.array_sort(F.collect_list("step")),
        F.struct(F.lit(False).alias("dead"), F.lit(False).alias("flag")),
        lambda acc, x: F.struct(
            F.when(x["prio"] == _PRIO_DEAD, F.lit(True))
            .when(x["prio"] == _PRIO_REPLAYED, F.lit(False))
            .otherwise(acc["dead"])
            .alias("dead"),
            (acc["flag"] | ((x["prio"] == _PRIO_ACKED) & acc["dead"])).alias("flag"),
        ),
    )
    return (
        joined.groupBy("appid", "msgid", "recipient")
        .agg(scan["flag"].alias("flag"))
        .where(F.col("flag"))
        .select("appid", "msgid", "recipient")
    )


def _time_width(first_ts: int | None, last_ts: int | None) -> int:
    if first_ts is None or last_ts is None:
        return _TIME_WIDTHS[0]
    span = max(1, last_ts - first_ts + 1)
    for width in _TIME_WIDTHS:
        if span / width <= MAX_TIME_BUCKETS:
            return width
    return _TIME_WIDTHS[-1]


def _ref_rows(rows: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"appid": r["appid"], "msgid": r["msgid"], "recipient": r["recipient"]} for r in rows]


def _attempt_key(attempt: Any) -> tuple[int, int]:
    return (1, 0) if attempt is None else (0, int(attempt))


def compute_report(
    spark: SparkSession,
    paths: Sequence[str],
    *,
    sample_size: int = DEFAULT_SAMPLE,
    progress: _Progress | None = None,
) -> AuditResult:
    """Run the Spark job over ``paths`` (already resolved) and collect the report."""
    prog = progress if progress is not None else _Progress(STAGES, None)
    cached: list[DataFrame] = []
    try:
        return _compute(spark, paths, sample_size, prog, cached)
    finally:
        for frame in cached:
            frame.unpersist()


def _compute(
    spark: SparkSession,
    paths: Sequence[str],
    sample_size: int,
    prog: _Progress,
    cached: list[DataFrame],
) -> AuditResult:
    level = StorageLevel.MEMORY_AND_DISK

    # ---- 1. read and parse the logs (once), with an explicit schema
    noun = "path" if any(_is_remote(p) for p in paths) else "file"
    with prog.stage(f"reading logs ({len(paths)} {noun}{'s' if len(paths) != 1 else ''})") as notes:
        try:
            raw = spark.read.schema(LOG_SCHEMA).option("mode", "PERMISSIVE").json(list(paths))
        except AnalysisException as exc:  # a path that Spark cannot find
            raise AuditInputError(str(exc).splitlines()[0]) from exc
        events = raw.select(
            "ts",
            "event",
            "msgid",
            "appid",
            "kind",
            "recipient",
            "attempt",
            (
                F.col("ts").isNull()
                | (F.col("ts") < 0)
                | (F.col("ts") >= MAX_TS)
                | F.col("event").isNull()
                | F.col("appid").isNull()
            ).alias("invalid"),
        ).persist(level)
        cached.append(events)
        stats = events.agg(
            F.count(F.lit(1)).alias("lines"),
            _count_if(F.col("invalid")).alias("invalid"),
            _count_if(~F.col("invalid") & _is("duplicate")).alias("duplicates"),
            _count_if(~F.col("invalid") & _is("pushed")).alias("pushes"),
            F.min(F.when(~F.col("invalid"), F.col("ts"))).alias("first_ts"),
            F.max(F.when(~F.col("invalid"), F.col("ts"))).alias("last_ts"),
        ).first()
        assert stats is not None
        lines = int(stats["lines"])
        invalid = int(stats["invalid"])
        notes.append(f"{lines - invalid:,} events")
        if invalid:
            notes.append(f"{invalid:,} invalid lines")

    valid = events.where(~F.col("invalid"))
    message_events = valid.where(
        ~F.col("event").isin(*RECIPIENT_EVENTS)
        & F.col("msgid").isNotNull()
        & (F.col("msgid") != "")
    )

    # ---- 2. per delivery, then per message
    with prog.stage("grouping events by message and delivery") as notes:
        # Only fixed-width aggregates here, so that Spark hash-aggregates (a string max,
        # a struct min or collect_list would make it sort all the events).
        topic_recipient = F.when(
            (F.col("kind") == "topic") & F.col("recipient").isNotNull(), F.col("recipient")
        )
        units = message_events.groupBy("appid", "msgid", topic_recipient.alias("rkey")).agg(
            _count_if(_is("stored")).alias("n_stored"),
            F.min(F.when(_is("stored"), F.col("ts"))).alias("stored_ts"),
            _count_if(_is("acked")).alias("n_acked"),
            F.min(F.when(_is("acked"), _ack_key())).alias("first_ack"),
            _count_if(_is("dead_lettered")).alias("n_dl"),
            F.max(F.when(_is("pushed"), F.col("ts"))).alias("last_push_ts"),
            _count_if(F.col("kind") == "topic").alias("n_topic"),
        )
        msg_window = Window.partitionBy("appid", "msgid")
        message_level = F.col("rkey").isNull()

        def from_message_row(col: str) -> Column:
            return F.first(F.when(message_level, F.col(col)), ignorenulls=True).over(msg_window)

        wide = units.select(
            "*",
            F.sum("n_stored").over(msg_window).alias("m_stored"),
            F.count("rkey").over(msg_window).alias("m_recipients"),
            from_message_row("n_acked").alias("ml_n_acked"),
            from_message_row("first_ack").alias("ml_first_ack"),
            from_message_row("n_dl").alias("ml_n_dl"),
        ).persist(level)
        cached.append(wide)

        messages = (
            wide.groupBy("appid", "msgid")
            .agg(
                (F.sum("n_stored") > 0).alias("stored"),
                F.min("stored_ts").alias("stored_ts"),
                F.sum("n_acked").alias("n_acked"),
                F.min("first_ack").alias("first_ack"),
                F.sum("n_dl").alias("n_dl"),
                (F.sum("n_topic") > 0).alias("topic"),
            )
            .select(
                "appid",
                "msgid",
                "stored",
                "topic",
                F.when(F.col("n_acked") > 0, F.lit("acked"))
                .when(F.col("n_dl") > 0, F.lit("dead_lettered"))
                .otherwise(F.lit("unresolved"))
                .alias("status"),
                (_ack_ts(F.col("first_ack")) - F.col("stored_ts")).alias("latency"),
                _ack_attempt(F.col("first_ack")).alias("attempt"),
            )
            .persist(level)
        )
        cached.append(messages)

        # Deliveries: recipient rows of topic messages (plus the message-wide ack and
        # dead-letter events), or the message row itself (queue, or topic without any).
        own = message_level
        zero = F.lit(0)
        acks = F.when(own, F.col("n_acked")).otherwise(
            F.col("n_acked") + F.coalesce(F.col("ml_n_acked"), zero)
        )
        dls = F.when(own, F.col("n_dl")).otherwise(
            F.col("n_dl") + F.coalesce(F.col("ml_n_dl"), zero)
        )
        first_ack = F.when(own, F.col("first_ack")).otherwise(
            F.least(F.col("first_ack"), F.col("ml_first_ack"))
        )
        deliveries = (
            wide.where(
                (F.col("m_stored") > 0) & (F.col("rkey").isNotNull() | (F.col("m_recipients") == 0))
            )
            .select(
                "appid",
                "msgid",
                F.col("rkey").alias("recipient"),
                (acks > 1).alias("acked_more_than_once"),
                F.coalesce(F.col("last_push_ts") > _ack_ts(first_ack), F.lit(False)).alias(
                    "pushed_after_ack"
                ),
                ((acks > 0) & (dls > 0)).alias("acked_and_dead"),
                ((acks == 0) & (dls == 0)).alias("unresolved"),
            )
            .persist(level)
        )
        cached.append(deliveries)
        counts = messages.agg(
            _count_if(F.col("stored")).alias("stored"),
            _count_if(~F.col("stored")).alias("unstored"),
        ).first()
        assert counts is not None
        notes.append(f"{int(counts['stored']):,} stored messages")
        if counts["unstored"]:
            notes.append(f"{int(counts['unstored']):,} without a stored event")

    stored = messages.where(F.col("stored"))
    acked = stored.where(F.col("status") == "acked")

    # ---- 3. totals (summed from the per-app rows), latencies, attempts
    with prog.stage("totals, latencies and attempts") as notes:
        app_rows = (
            stored.groupBy("appid")
            .agg(
                F.count(F.lit(1)).alias("messages"),
                _count_if(F.col("status") == "acked").alias("acked"),
                _count_if(F.col("status") == "dead_lettered").alias("dead_lettered"),
                _count_if(F.col("status") == "unresolved").alias("unresolved"),
                F.percentile(F.col("latency"), 0.99).alias("p99_ms"),
                _count_if(F.col("topic")).alias("topic_messages"),
            )
            .orderBy("appid")
            .collect()
        )
        by_app = [
            {
                "appid": r["appid"],
                "messages": int(r["messages"]),
                "acked": int(r["acked"]),
                "dead_lettered": int(r["dead_lettered"]),
                "unresolved": int(r["unresolved"]),
                "p99_ms": _round(r["p99_ms"]),
            }
            for r in app_rows
        ]
        lat = acked.agg(
            F.percentile(F.col("latency"), list(PERCENTILES)).alias("p"),
            F.max("latency").alias("max"),
            _count_if(F.col("latency") < 0).alias("negative"),
        ).first()
        assert lat is not None
        pcts = list(lat["p"]) if lat["p"] is not None else [None] * len(PERCENTILES)
        latency_ms = {
            "p50": _round(pcts[0]),
            "p95": _round(pcts[1]),
            "p99": _round(pcts[2]),
            "max": None if lat["max"] is None else int(lat["max"]),
        }
        attempt_rows = acked.groupBy("attempt").count().collect()
        attempts = {
            ("unknown" if r["attempt"] is None else str(int(r["attempt"]))): int(r["count"])
            for r in sorted(attempt_rows, key=lambda r: _attempt_key(r["attempt"]))
        }
        hist_rows = (
            acked.groupBy(_latency_bucket(F.col("latency")).alias("bucket")).count().collect()
        )
        totals = {
            "messages": sum(a["messages"] for a in by_app),
            "duplicates": int(stats["duplicates"]),
            "acked": sum(a["acked"] for a in by_app),
            "dead_lettered": sum(a["dead_lettered"] for a in by_app),
            "unresolved": sum(a["unresolved"] for a in by_app),
            "pushes": int(stats["pushes"]),
        }
        notes.append(f"{totals['acked']:,} acked, p99 {latency_ms['p99']} ms")

    # ---- 4. per recipient, anomalies
    with prog.stage("per-recipient counts and anomalies") as notes:
        recipient_rows = (
            valid.where(F.col("recipient").isNotNull())
            .groupBy("appid", "recipient")
            .agg(
                _count_if(_is("pushed")).alias("pushes"),
                _count_if(_is("acked")).alias("acked"),
                _count_if(_is("rejected")).alias("rejected"),
                _count_if(_is("errored")).alias("errored"),
                _count_if(_is("timeout")).alias("timeouts"),
                _count_if(_is("unreachable")).alias("unreachable"),
                _count_if(_is("recipient_lost")).alias("lost"),
                _count_if(_is("dead_lettered")).alias("dead_lettered"),
            )
            .orderBy("appid", "recipient")
            .collect()
        )
        by_recipient = [{k: r[k] for k in BY_RECIPIENT_FIELDS} for r in recipient_rows]
        recipient_extra = [
            {
                "appid": r["appid"],
                "recipient": r["recipient"],
                "unreachable": int(r["unreachable"]),
                "lost": int(r["lost"]),
                "dead_lettered": int(r["dead_lettered"]),
            }
            for r in recipient_rows
        ]
        flags = ("acked_more_than_once", "pushed_after_ack", "acked_after_dead_letter")
        late = _acked_after_dead_letter(message_events, deliveries).persist(level)
        cached.append(late)
        anomaly_counts = deliveries.agg(
            *[
                _count_if(F.col(name)).alias(name)
                for name in ("acked_more_than_once", "pushed_after_ack", "unresolved")
            ]
        ).first()
        assert anomaly_counts is not None
        found = {name: int(anomaly_counts[name]) for name in anomaly_counts.asDict()}
        found["acked_after_dead_letter"] = late.count()
        order = [F.col("appid").asc(), F.col("msgid").asc(), F.col("recipient").asc_nulls_first()]

        def sample(name: str) -> list[dict[str, Any]]:
            if sample_size <= 0 or found[name] == 0:
                return []
            frame = late if name == "acked_after_dead_letter" else deliveries.where(F.col(name))
            rows = (
                frame.select("appid", "msgid", "recipient")
                .orderBy(*order)
                .limit(sample_size)
                .collect()
            )
            return _ref_rows(rows)

        anomalies: dict[str, Any] = {name: found[name] for name in flags}
        anomalies["unresolved"] = found["unresolved"]
        anomalies["unresolved_sample"] = sample("unresolved")
        anomalies["samples"] = {name: sample(name) for name in flags}
        anomalies["acked_before_stored"] = int(lat["negative"])
        anomalies["unstored_messages"] = int(counts["unstored"])
        anomalies["invalid_lines"] = invalid
        notes.append(
            f"{len(by_recipient)} recipients, "
            + ", ".join(f"{anomalies[n]} {n.replace('_', ' ')}" for n in (*flags, "unresolved"))
        )

    # ---- 5. throughput over time (for the HTML page)
    with prog.stage("throughput over time") as notes:
        first_ts = None if stats["first_ts"] is None else int(stats["first_ts"])
        last_ts = None if stats["last_ts"] is None else int(stats["last_ts"])
        width = _time_width(first_ts, last_ts)
        series_rows = (
            valid.where(F.col("event").isin("stored", "pushed", "acked", "dead_lettered"))
            .groupBy((F.floor(F.col("ts") / F.lit(width)) * F.lit(width)).alias("t"))
            .agg(
                _count_if(_is("stored")).alias("stored"),
                _count_if(_is("pushed")).alias("pushed"),
                _count_if(_is("acked")).alias("acked"),
                _count_if(_is("dead_lettered")).alias("dead_lettered"),
            )
            .orderBy("t")
            .collect()
        )
        notes.append(f"{len(series_rows)} buckets of {width // 1000}s")

    report: dict[str, Any] = {
        "totals": totals,
        "latency_ms": latency_ms,
        "attempts": attempts,
        "by_app": by_app,
        "by_recipient": by_recipient,
        "anomalies": anomalies,
    }
    hist = {int(r["bucket"]): int(r["count"]) for r in hist_rows}
    extras: dict[str, Any] = {
        "events": lines - invalid,
        "invalid_lines": invalid,
        "first_ts": first_ts,
        "last_ts": last_ts,
        "paths": list(paths),
        "topic_messages": {r["appid"]: int(r["topic_messages"]) for r in app_rows},
        "recipients": recipient_extra,
        "throughput": {
            "bucket_ms": width,
            "rows": [
                {
                    "t": int(r["t"]),
                    "stored": int(r["stored"]),
                    "pushed": int(r["pushed"]),
                    "acked": int(r["acked"]),
                    "dead_lettered": int(r["dead_lettered"]),
                }
                for r in series_rows
            ],
        },
        "latency_histogram": _histogram(hist),
    }
    return AuditResult(report=report, extras=extras)


def _histogram(counts: dict[int, int]) -> list[dict[str, Any]]:
    """Latency buckets ``[lo, hi)`` in ms from the first to the last non-empty one."""
    if not counts:
        return []
    rows: list[dict[str, Any]] = []
    low, high = min(counts), max(counts)
    for index in range(low, high + 1):
        if index == -1:
            lo, hi = None, 0
        elif index >= len(LATENCY_EDGES):
            lo, hi = LATENCY_EDGES[-1], None
        else:
            lo, hi = (0 if index == 0 else LATENCY_EDGES[index - 1]), LATENCY_EDGES[index]
        rows.append({"lo": lo, "hi": hi, "count": counts.get(index, 0)})
    return rows


# --------------------------------------------------------------------------- outputs


def _csv_value(value: Any) -> Any:
    return "" if value is None else value


def write_outputs(result: AuditResult, out: str, meta: dict[str, Any] | None = None) -> list[str]:
    """Write report.json, report.html, by_app.csv and by_recipient.csv into ``out``."""
    os.makedirs(out, exist_ok=True)
    report = {key: result.report[key] for key in REPORT_KEYS}
    written: list[str] = []

    def target(name: str) -> str:
        path = os.path.join(out, name)
        written.append(path)
        return path

    with open(target("report.json"), "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2, ensure_ascii=False, allow_nan=False)
        handle.write("\n")
    with open(target("report.html"), "w", encoding="utf-8") as handle:
        handle.write(render_html(report, result.extras, meta or {}))
    for name, fields, rows in (
        ("by_app.csv", BY_APP_FIELDS, report["by_app"]),
        ("by_recipient.csv", BY_RECIPIENT_FIELDS, report["by_recipient"]),
    ):
        with open(target(name), "w", encoding="utf-8", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(fields)
            for row in rows:
                writer.writerow([_csv_value(row[f]) for f in fields])
    return written


def run_audit(
    logs: str | Sequence[str],
    out: str,
    master: str | None = None,
    *,
    spark: SparkSession | None = None,
    sample_size: int = DEFAULT_SAMPLE,
    progress: bool = True,
    stream: TextIO | None = None,
) -> dict[str, Any]:
    """Audit the delivery logs at ``logs``, write the reports into ``out``, return the report.

    ``spark``: an existing session to use (left running); otherwise one is built with
    :func:`build_spark` (``master`` or ``local[*]``) and stopped at the end.
    Raises :class:`AuditInputError` when there is nothing to read.
    """
    prog = _Progress(STAGES, (stream or sys.stderr) if progress else None)
    if spark is not None:
        local_mode = str(spark.sparkContext.master).startswith("local")
    elif master is not None:
        local_mode = _local_cores(master) is not None
    else:  # local[*], unless spark-submit already started the JVM with its own master
        local_mode = "PYSPARK_GATEWAY_PORT" not in os.environ
    paths = resolve_log_paths(logs, must_exist=local_mode)
    own_session = spark is None
    if spark is None:
        prog.note(f"starting Spark ({master or 'local[*]'}) ...")
        session = build_spark(master)
    else:
        session = spark
    try:
        result = compute_report(session, paths, sample_size=sample_size, progress=prog)
        with prog.stage(f"writing reports to {out}") as notes:
            meta = {
                "generated": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
                "logs": [logs] if isinstance(logs, str) else list(logs),
                "files": len(paths),
                "master": session.sparkContext.master,
                "elapsed_s": round(time.monotonic() - prog.started, 1),
            }
            written = write_outputs(result, out, meta)
            notes.append(", ".join(os.path.basename(p) for p in written))
    finally:
        if own_session:
            session.stop()
    return result.report


def main(argv: Sequence[str] | None = None) -> int:
    """``python spark/audit.py`` / ``spark-submit spark/audit.py``: --logs, --out, --master."""
    parser = argparse.ArgumentParser(
        prog="audit.py", description="Audit SKMQ delivery logs with Spark."
    )
    parser.add_argument(
        "--logs", required=True, nargs="+", help="log directory, glob or file (several allowed)"
    )
    parser.add_argument("--out", required=True, help="output directory for the reports")
    parser.add_argument(
        "--master", default=None, help="Spark master URL (default: local[*] or spark-submit's)"
    )
    parser.add_argument(
        "--sample", type=int, default=DEFAULT_SAMPLE, help="msgids kept per anomaly sample"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    try:
        report = run_audit(
            args.logs, args.out, args.master, sample_size=args.sample, progress=not args.quiet
        )
    except AuditInputError as exc:
        print(f"audit: {exc}", file=sys.stderr)
        return 2
    totals = report["totals"]
    print(
        f"{totals['messages']} messages: {totals['acked']} acked, "
        f"{totals['dead_lettered']} dead-lettered, {totals['unresolved']} unresolved; "
        f"report in {os.path.join(args.out, 'report.html')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
