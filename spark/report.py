"""The report: every section of report.json, computed with Spark from the logs.

Only aggregated rows come back to the driver (one per app, per recipient, per
attempt and latency bucket, per time bucket, per bad-line reason) plus bounded
samples; nothing grows with the number of messages.
"""

from __future__ import annotations

import functools
import math
import operator
import re
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TextIO, TypeVar

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from skmq.events import GROUP_PREFIX, LOG_FIELDS, Event

from .arguments import DEFAULT_SAMPLE, DEFAULT_STUCK_AFTER_MS
from .deliveries import (
    FAILURES,
    OUTCOME_GROUPS,
    OUTCOMES,
    copy_key,
    count_if,
    counted,
    delivery_table,
    group_change,
    is_event,
    message_table,
)
from .inputs import (
    KEPT_FIELDS,
    ArrowLines,
    AuditInputError,
    BadLinesError,
    all_simple,
    read_arrow_lines,
    read_events,
    same_file,
)
from .session import input_bytes, is_small, local_cores

__all__ = [
    "DEFAULT_SAMPLE",
    "DEFAULT_STUCK_AFTER_MS",
    "REPORT_KEYS",
    "AuditResult",
    "Options",
    "Progress",
    "compute_report",
]

REPORT_KEYS = (
    "input",
    "totals",
    "outcomes",
    "latency_ms",
    "first_push_ms",
    "attempts",
    "unresolved",
    "dead_letters",
    "by_app",
    "by_recipient",
    "anomalies",
)
PERCENTILES = (0.5, 0.95, 0.99)
STAGES = 7
BAD_LINE_SAMPLES = 5
DLQ_TABLE = 20
HISTORY_EVENTS = 50
MAX_TIME_BUCKETS = 120
UNRESOLVED_STATES = tuple(o for o in OUTCOMES if OUTCOME_GROUPS[o] == "unresolved")
MESSAGE_GROUPS = ("acked", "dead_lettered", "dropped", "unresolved")
INVARIANT = (
    "messages = acked + dead_lettered + dropped + unresolved = the sum of the rows' "
    "messages, each stored message in one row; deliveries = the sum of the rows' deliveries"
)
# Bucket widths for the throughput chart, in ms: the smallest giving <= MAX_TIME_BUCKETS.
_TIME_WIDTHS = [
    s * 1000 for s in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600)
] + [43200_000 * k for k in (1, 2, 4, 7, 14, 28, 56, 112, 224, 448)]
_S, _MIN, _H = 1000, 60_000, 3_600_000
# Upper edges (exclusive, ms) of the latency histogram buckets, roughly log-spaced.
LATENCY_EDGES: tuple[int, ...] = (
    *(1, 2, 5, 10, 20, 50, 100, 200, 500),
    *(_S, 2 * _S, 5 * _S, 10 * _S, 20 * _S, 30 * _S),
    *(_MIN, 2 * _MIN, 5 * _MIN, 10 * _MIN, 20 * _MIN, 30 * _MIN),
    *(_H, 2 * _H, 6 * _H, 12 * _H, 24 * _H, 48 * _H),
)
# Ordering of events with equal ts in the acked-after-dead-letter scan.
_PRIO_ACKED, _PRIO_DEAD, _PRIO_REPLAYED = 0, 1, 2
_COUNTED_FLAGS = ("acked_more_than_once", "pushed_after_ack")
_CHART_EVENTS = (Event.STORED, Event.PUSHED, Event.ACKED, Event.DEAD_LETTERED)
_CHART_COLUMNS = {"c_" + e.value: e for e in _CHART_EVENTS}
_RECIPIENT_COLUMNS = {
    "pushes": Event.PUSHED,
    "acked": Event.ACKED,
    "rejected": Event.REJECTED,
    "errored": Event.ERRORED,
    "timeouts": Event.TIMEOUT,
    "unreachable": Event.UNREACHABLE,
    "lost": Event.RECIPIENT_LOST,
    "dead_lettered": Event.DEAD_LETTERED,
}
# Queries the driver runs at once (threads of this process): planning a query, a job's
# start and its last tasks leave a core idle that another query's tasks can use.
CONCURRENT_QUERIES = 3
# Hashes one task of the repeated-lines check counts at most (_has_repeats).
_DIGESTS_A_TASK = 500_000
_T = TypeVar("_T")


@dataclass
class AuditResult:
    """The report (what goes to report.json) and the extra series the HTML page draws."""

    report: dict[str, Any]
    extras: dict[str, Any] = field(default_factory=dict)


class Progress:
    """Stage lines on stderr: ``[2/6] grouping ... `` then ``[2/6] ... done (1.2s)``."""

    def __init__(self, total: int, stream: TextIO | None) -> None:
        self.total = total
        self.stream = stream
        self.index = 0
        self.started = time.monotonic()

    def note(self, text: str) -> None:
        if self.stream is not None:
            self.stream.write(text + "\n")
            self.stream.flush()

    @contextmanager
    def stage(self, label: str) -> Iterator[list[str]]:
        self.index += 1
        tag = f"[{self.index}/{self.total}]"
        self.note(f"{tag} {label} ...")
        start = time.monotonic()
        notes: list[str] = []
        yield notes
        now = time.monotonic()
        detail = f": {', '.join(notes)}" if notes else ""
        self.note(
            f"{tag} {label} done{detail} ({now - start:.1f}s, total {now - self.started:.1f}s)"
        )


@dataclass
class Options:
    sample_size: int = DEFAULT_SAMPLE
    stuck_after_ms: int = DEFAULT_STUCK_AFTER_MS
    strict: bool = False


def _round(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return None if math.isnan(number) else round(number, 3)


def _percentiles(values: Any, maximum: Any) -> dict[str, Any]:
    pcts = list(values) if values is not None else [None] * len(PERCENTILES)
    return {
        "p50": _round(pcts[0]),
        "p95": _round(pcts[1]),
        "p99": _round(pcts[2]),
        "max": None if maximum is None else int(maximum),
    }


def _latency_bucket(col: Column) -> Column:
    """Index of the latency histogram bucket: -1 negative, i < len(EDGES), len for beyond."""
    expr = F.when(col < 0, F.lit(-1))
    for index, edge in enumerate(LATENCY_EDGES):
        expr = expr.when(col < edge, F.lit(index))
    return expr.otherwise(F.lit(len(LATENCY_EDGES)))


def _histogram(counts: dict[int, int]) -> list[dict[str, Any]]:
    """Latency buckets ``[lo, hi)`` in ms from the first to the last non-empty one."""
    if not counts:
        return []
    rows: list[dict[str, Any]] = []
    for index in range(min(counts), max(counts) + 1):
        if index == -1:
            lo, hi = None, 0
        elif index >= len(LATENCY_EDGES):
            lo, hi = LATENCY_EDGES[-1], None
        else:
            lo, hi = (0 if index == 0 else LATENCY_EDGES[index - 1]), LATENCY_EDGES[index]
        rows.append({"lo": lo, "hi": hi, "count": counts.get(index, 0)})
    return rows


def time_width(first_ts: int | None, last_ts: int | None) -> int:
    if first_ts is None or last_ts is None:
        return _TIME_WIDTHS[0]
    span = max(1, last_ts - first_ts + 1)
    for width in _TIME_WIDTHS:
        if span / width <= MAX_TIME_BUCKETS:
            return width
    return _TIME_WIDTHS[-1]


def fill_buckets(
    rows: Sequence[dict[str, int]], width: int, names: Sequence[str]
) -> list[dict[str, int]]:
    """Every bucket from the first to the last, the empty ones as zeros (time as time)."""
    if not rows:
        return []
    found = {r["t"]: r for r in rows}
    first, last = min(found), max(found)
    return [
        found.get(t, {"t": t, **dict.fromkeys(names, 0)}) for t in range(first, last + width, width)
    ]


def _ref_rows(rows: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"appid": r["appid"], "msgid": r["msgid"], "recipient": r["recipient"]} for r in rows]


def _attempt_key(attempt: Any) -> tuple[int, int]:
    return (1, 0) if attempt is None else (0, int(attempt))


def _failure_name(code: Any) -> str:
    return FAILURES[int(code) - 1] if code else "unknown"


def _invariant_holds(totals: dict[str, int], rows: Sequence[dict[str, Any]]) -> bool:
    """Every stored message is in one outcome row, and in its row's group; every delivery
    in one row."""
    groups = {g: sum(r["messages"] for r in rows if r["group"] == g) for g in MESSAGE_GROUPS}
    return (
        sum(r["messages"] for r in rows) == totals["messages"]
        and sum(totals[g] for g in MESSAGE_GROUPS) == totals["messages"]
        and all(groups[g] == totals[g] for g in MESSAGE_GROUPS)
        and sum(r["deliveries"] for r in rows) == totals["deliveries"]
    )


def _ref_order() -> list[Column]:
    return [F.col("appid").asc(), F.col("msgid").asc(), F.col("recipient").asc_nulls_first()]


_Ref = tuple[str, str, str | None]
# A pull's `pushed` detail: "pulled by <consumer>; receipt <receipt>".
_PULLED_BY = re.compile(r"pulled by (.+?); receipt ")


def _delivery_events(events: DataFrame, keys: DataFrame) -> DataFrame:
    """The events of the deliveries in ``keys`` (k_appid, k_msgid, k_recipient): a
    copy's own events (a topic recipient's, a consumer group's) and its message's events
    without recipient; a queue message's events."""
    of_copy = copy_key().isNotNull()
    return events.join(
        F.broadcast(keys),
        (events["appid"] == keys["k_appid"])
        & (events["msgid"] == keys["k_msgid"])
        & (~of_copy | (events["recipient"] == keys["k_recipient"])),
    )


def _acked_after_dead_letter(picked: DataFrame) -> DataFrame:
    """Deliveries acked after a dead letter with no replay between (appid, msgid, recipient).

    ``picked``: the events of the deliveries with both an ack and a dead letter (only
    they can be); their ack, dead-letter and replay events are sorted by
    (ts, acked < dead_lettered < replayed) and scanned.
    """
    prio = (
        F.when(is_event(Event.ACKED), F.lit(_PRIO_ACKED))
        .when(is_event(Event.DEAD_LETTERED), F.lit(_PRIO_DEAD))
        .otherwise(F.lit(_PRIO_REPLAYED))
    )
    steps = picked.where(
        F.col("event").isin(Event.ACKED.value, Event.DEAD_LETTERED.value, Event.REPLAYED.value)
    ).select(
        F.col("k_appid").alias("appid"),
        F.col("k_msgid").alias("msgid"),
        F.col("k_recipient").alias("recipient"),
        F.struct(F.col("ts").alias("ts"), prio.alias("prio")).alias("step"),
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
        steps.groupBy("appid", "msgid", "recipient")
        .agg(scan["flag"].alias("flag"))
        .where(F.col("flag"))
        .select("appid", "msgid", "recipient")
    )


def _key_frame(spark: SparkSession, keys: Sequence[_Ref]) -> DataFrame:
    """A few delivery keys as a frame (k_appid, k_msgid, k_recipient) of literals: made
    in the JVM, where ``createDataFrame`` of Python rows would start a Python worker
    (seconds, for a handful of rows)."""
    rows = [
        F.struct(
            F.lit(appid).cast("string").alias("k_appid"),
            F.lit(msgid).cast("string").alias("k_msgid"),
            F.lit(recipient).cast("string").alias("k_recipient"),
        )
        for appid, msgid, recipient in keys
    ]
    if not rows:
        return spark.range(0).select(
            *(F.lit(None).cast("string").alias(k) for k in ("k_appid", "k_msgid", "k_recipient"))
        )
    return spark.range(1).select(F.inline(F.array(*rows)))


def _line_stats() -> list[Column]:
    """What the read stage counts of a set of lines: lines, first and last ts, the
    duplicate and pushed events."""
    return [
        F.count(F.lit(1)).alias("lines"),
        F.min("ts").alias("first_ts"),
        F.max("ts").alias("last_ts"),
        count_if(is_event(Event.DUPLICATE)).alias("duplicates"),
        count_if(is_event(Event.PUSHED)).alias("pushes"),
        count_if(group_change()).alias("group_changes"),
    ]


def _history_order() -> list[Column]:
    """A delivery's events in time, and those of the same millisecond (a broker logs
    several a millisecond) by attempt, then in the lifecycle's order (``Event``'s), then
    by their fields: the same order whatever order the lines were read in."""
    lifecycle = F.array_position(F.array(*(F.lit(e.value) for e in Event)), F.col("event"))
    order = [F.col("ts"), F.col("attempt"), lifecycle, F.col("recipient"), F.col("detail")]
    return [column.asc_nulls_first() for column in order]


def _has_repeats(events: DataFrame, count: int) -> bool:
    """Some of the ``count`` valid events have every field equal (a hash of the fields
    seen twice: one shuffle of longs, not of the events).  The hashes are partitioned by
    their value and counted there: a map-side partial count would find almost every
    hash once.  A partition counts at most _DIGESTS_A_TASK of them: with Spark's own
    number (10M events in 2 partitions on 2 cores) each task's table spilled to disk,
    and the check took 5.6 s of the audit's wall clock against 2.0 in 20 partitions."""
    digest = F.xxhash64(*LOG_FIELDS).alias("digest")
    shuffles = int(events.sparkSession.conf.get("spark.sql.shuffle.partitions") or 1)
    partitions = max(shuffles, math.ceil(count / _DIGESTS_A_TASK))
    by_digest = events.select(digest).repartition(partitions, "digest")
    return bool(by_digest.groupBy("digest").count().where(F.col("count") > 1).limit(1).count())


def _distinct(events: DataFrame) -> DataFrame:
    """Each valid event once, with ``copies``: how many lines had every field equal."""
    return events.groupBy(*LOG_FIELDS).agg(F.count(F.lit(1)).alias("copies"))


def _rows_fit(spark: SparkSession, paths: Sequence[str]) -> bool:
    """The lines of ``paths`` are few enough to keep as rows (uncompressed, about 200
    bytes a line): a local session, less than SMALL_INPUT_BYTES of local text."""
    return is_small(input_bytes(paths)) and local_cores(str(spark.sparkContext.master)) is not None


class _Job:
    """One audit run: the cached frames and the report's sections, stage by stage."""

    def __init__(
        self,
        spark: SparkSession,
        paths: Sequence[str],
        options: Options,
        prog: Progress,
        pool: ThreadPoolExecutor,
        lines: DataFrame | None = None,
        simple: bool | None = None,
        parsed: ArrowLines | None = None,
    ) -> None:
        self.spark = spark
        self.paths = paths
        self.lines = lines
        self.simple = simple
        self.parsed = parsed
        self.options = options
        self.prog = prog
        self.pool = pool
        self.cached: list[DataFrame] = []
        self.level = StorageLevel.MEMORY_AND_DISK

    def start(self, work: Callable[[], _T]) -> Future[_T]:
        """Run ``work`` (Spark queries) beside the caller's: its result when asked for."""
        return self.pool.submit(work)

    def keep(self, frame: DataFrame) -> DataFrame:
        frame = frame.persist(self.level)
        self.cached.append(frame)
        return frame

    def keep_rows(self, frame: DataFrame) -> DataFrame:
        """``frame`` kept as Spark's rows (a local checkpoint, stored as its first job
        computes it) where the input is small and local, else :meth:`keep`.  Building
        the columnar cache costs more than it saves on the reads after it (1M lines:
        read, parse and keep about 8 task CPU s against 10 with the columnar cache,
        half its heap).  A local checkpoint is not computed again if an executor is
        lost: local mode only.  (Its blocks go with it: Spark's context cleaner drops
        them once the frame is unreachable; PySpark has no public call to drop them
        sooner, and the audit's session ends with the audit.)
        """
        if not _rows_fit(self.spark, self.paths):
            return self.keep(frame)
        return frame.localCheckpoint(eager=False, storageLevel=self.level)

    def release(self) -> None:
        for frame in self.cached:
            frame.unpersist()

    # ---- 1. lines: good events, bad lines per reason
    def read(self) -> dict[str, Any]:
        paths = self.paths
        with self.prog.stage(f"reading logs ({len(paths)} path{'s' * (len(paths) != 1)})") as notes:
            if self.parsed is not None:
                lines = read_arrow_lines(self.spark, self.parsed, paths)
            elif self.lines is None:
                simple = all_simple(paths) if self.simple is None else self.simple
                lines = self.keep_rows(read_events(self.spark, paths, simple))
            else:
                lines = self.keep(self.lines)
            untold = F.col("reason").isNotNull() & F.col("bad_text").isNull()
            stats = [*_line_stats(), count_if(untold).alias("untold")]
            rows = lines.groupBy("reason").agg(*stats).collect()
            good = next((r for r in rows if r["reason"] is None), None)
            by_reason = {r["reason"]: int(r["lines"]) for r in rows if r["reason"] is not None}
            bad_total = sum(by_reason.values())
            samples: list[dict[str, Any]] = []
            if bad_total:
                bad = lines.where(F.col("reason").isNotNull())
                if any(r["untold"] for r in rows):
                    # Bad lines of files read by Spark's JSON reader, which keeps no text
                    # of a line it could read: those files' bad lines read again as text.
                    files = bad.where(untold).select("bad_file").distinct()
                    named = [r[0] for r in files.collect()]
                    again = [p for p in paths if any(same_file(n, p) for n in named)]
                    bad = bad.where(~F.col("bad_file").isin(named)).unionByName(
                        read_events(self.spark, again).where(F.col("reason").isNotNull())
                    )
                rank = F.row_number().over(
                    Window.partitionBy("reason").orderBy("bad_file", "bad_text")
                )
                samples = [
                    {"reason": r["reason"], "file": r["bad_file"], "line": r["bad_text"]}
                    for r in bad.select("reason", "bad_file", "bad_text", rank.alias("rank"))
                    .where(F.col("rank") <= BAD_LINE_SAMPLES)
                    .orderBy("reason", "rank")
                    .collect()
                ]
            events = 0 if good is None else int(good["lines"])
            valid = lines.where(F.col("reason").isNull()).select(*LOG_FIELDS)
            repeated = 0
            maybe = self.parsed is None or self.parsed.repeats
            if events and maybe and _has_repeats(valid, events):
                # The same lines read twice (a rotated file both as .jsonl and .jsonl.gz
                # after a crash of the compression, a copy of a file) would count pushes
                # and acks twice, and time in the dead-letter queue wrongly: once each.
                valid = self.keep(_distinct(valid))
                good = valid.agg(
                    *_line_stats(), F.sum(F.col("copies") - 1).alias("repeated")
                ).first()
                assert good is not None
                events, repeated = int(good["lines"]), int(good["repeated"])
            notes.append(f"{events:,} events")
            if repeated:
                notes.append(f"{repeated:,} repeated lines")
            if bad_total:
                notes.append(f"{bad_total:,} bad lines")
        bad_lines = {
            "total": bad_total,
            "by_reason": dict(sorted(by_reason.items())),
            "samples": samples,
        }
        if self.options.strict and bad_total:
            first = samples[0]
            raise BadLinesError(
                f"{bad_total} bad line(s) ("
                + ", ".join(f"{k}: {v}" for k, v in sorted(by_reason.items()))
                + f"); first: {first['file']}: {first['line']}"
            )
        if events == 0:
            where = ", ".join(paths)
            raise AuditInputError(
                f"no valid events in {where}"
                + (f" ({bad_total} bad line(s), e.g. {samples[0]['line']!r})" if bad_total else "")
            )
        assert good is not None
        self.events = valid.select(*KEPT_FIELDS)
        return {
            "events": events,
            "repeated_lines": repeated,
            "bad_lines": bad_lines,
            "first_ts": int(good["first_ts"]),
            "last_ts": int(good["last_ts"]),
            "duplicates": int(good["duplicates"]),
            "pushes": int(good["pushes"]),
            "group_changes": int(good["group_changes"]),
        }

    # ---- 2. deliveries and messages
    def group(self, as_of: int, groups: bool) -> None:
        """``groups``: the logs make or delete a consumer group (its copies are counted)."""
        with self.prog.stage("grouping events by delivery and message") as notes:
            self.deliveries = self.keep(
                delivery_table(self.events, as_of, self.options.stuck_after_ms, groups)
            )
            self.messages = message_table(self.deliveries)
            count = self.deliveries.count()
            notes.append(f"{count:,} deliveries")

    # ---- 3. totals and outcomes per app, latencies, attempts, unresolved
    def outcomes(self, stats: dict[str, Any]) -> dict[str, Any]:
        stored = self.deliveries.where(F.col("stored"))
        status, outcome = F.col("status"), F.col("outcome")
        acked, dead = status == "acked", status == "dead"
        with self.prog.stage("totals, outcomes, latencies and attempts") as notes:
            # The bounded lists (then the dead-letter queue's histories and the late acks),
            # the messages per app and the deliveries per app (a rollup: its total row is
            # all apps') run beside the attempts' query.
            lists = self.start(self.listed)
            self.after_lists = self.start(lambda: self._histories_and_late(lists.result()))
            latency = F.when(acked, F.col("latency"))
            rolled_rows = self.start(
                lambda: (
                    stored.rollup("appid")
                    .agg(
                        F.grouping("appid").alias("all"),
                        F.count(F.lit(1)).alias("deliveries"),
                        count_if(dead).alias("dead_letter_entries"),
                        count_if(status == "purged").alias("purged_dead_letters"),
                        F.percentile(latency, list(PERCENTILES)).alias("p"),
                        F.max(latency).alias("max"),
                        count_if(latency < 0).alias("negative"),
                        F.percentile("push_latency", list(PERCENTILES)).alias("push_p"),
                        F.max("push_latency").alias("push_max"),
                        *(count_if(outcome == o).alias(o) for o in OUTCOMES),
                        count_if(F.col("topic")).alias("topic_deliveries"),
                        *(count_if(F.col(f)).alias(f) for f in _COUNTED_FLAGS),
                        *(
                            count_if(dead & (F.col("failure") == code)).alias(f"dead_{code}")
                            for code in range(len(FAILURES) + 1)
                        ),
                    )
                    .collect()
                )
            )
            message_rows_of = self.start(
                lambda: self.messages.groupBy("appid")
                .agg(
                    count_if(F.col("stored")).alias("messages"),
                    *(count_if(F.col("stored") & (F.col("status") == g)).alias(g)
                      for g in MESSAGE_GROUPS),
                    *(count_if(F.col("stored") & (F.col("outcome") == o)).alias("m_" + o)
                      for o in OUTCOMES),
                    count_if(~F.col("stored")).alias("unstored"),
                    count_if(F.col("in_dlq")).alias("in_dlq"),
                )
                .orderBy("appid")
                .collect()
            )  # fmt: skip
            attempt_rows = (
                stored.where(acked)
                .groupBy("attempt", _latency_bucket(F.col("latency")).alias("bucket"))
                .count()
                .collect()
            )
            rolled = rolled_rows.result()
            app_rows = [r for r in rolled if not r["all"]]
            empty: dict[str, Any] = dict.fromkeys(("p", "max", "push_p", "push_max"))
            empty |= dict.fromkeys(("negative", "deliveries", *OUTCOMES), 0)
            empty |= dict.fromkeys(("dead_letter_entries", "purged_dead_letters"), 0)
            everything = next((r.asDict() for r in rolled if r["all"]), empty)
            per_app = {r["appid"]: r for r in app_rows}
            message_rows = message_rows_of.result()
            by_app = [
                {
                    "appid": r["appid"],
                    "messages": int(r["messages"]),
                    **{g: int(r[g]) for g in MESSAGE_GROUPS},
                    "dead_letter_entries": int(per_app[r["appid"]]["dead_letter_entries"]),
                    "p99_ms": _round((per_app[r["appid"]]["p"] or [None] * 3)[2]),
                }
                for r in message_rows
                if r["messages"]
            ]
            attempts: dict[Any, int] = {}
            hist: dict[int, int] = {}
            for r in attempt_rows:
                attempts[r["attempt"]] = attempts.get(r["attempt"], 0) + int(r["count"])
                hist[int(r["bucket"])] = hist.get(int(r["bucket"]), 0) + int(r["count"])
            totals = {
                "messages": sum(a["messages"] for a in by_app),
                **{g: sum(a[g] for a in by_app) for g in MESSAGE_GROUPS},
                "deliveries": int(everything["deliveries"]),
                "dead_letter_entries": int(everything["dead_letter_entries"]),
                "purged_dead_letters": int(everything["purged_dead_letters"]),
                "duplicates": stats["duplicates"],
                "pushes": stats["pushes"],
            }
            outcome_rows = [
                {
                    "outcome": o,
                    "group": OUTCOME_GROUPS[o],
                    "messages": sum(int(r["m_" + o]) for r in message_rows),
                    "deliveries": int(everything[o]),
                }
                for o in OUTCOMES
            ]
            holds = _invariant_holds(totals, outcome_rows)
            if not holds:
                self.prog.note("warning: the outcomes do not add up to the messages stored")
            unresolved: dict[str, Any] = {s: int(everything[s]) for s in UNRESOLVED_STATES}
            unresolved["as_of"] = stats["last_ts"]
            unresolved["stuck_after_ms"] = self.options.stuck_after_ms
            self.lists = lists.result()
            unresolved["stuck_sample"] = _ref_rows(self.lists["stuck"])
            lat = everything
            notes.append(
                f"{totals['acked']:,} acked, p99 {_round(lat['p'][2]) if lat['p'] else None} ms"
            )
        return {
            "totals": totals,
            "outcomes": {"invariant": INVARIANT, "holds": holds, "rows": outcome_rows},
            "latency_ms": _percentiles(lat["p"], lat["max"]),
            "first_push_ms": _percentiles(lat["push_p"], lat["push_max"]),
            "attempts": {
                ("unknown" if k is None else str(int(k))): v
                for k, v in sorted(attempts.items(), key=lambda kv: _attempt_key(kv[0]))
            },
            "unresolved": unresolved,
            "by_app": by_app,
            "negative": int(lat["negative"]),
            "unstored": sum(int(r["unstored"]) for r in message_rows),
            "histogram": _histogram(hist),
            "topic_deliveries": {r["appid"]: int(r["topic_deliveries"]) for r in app_rows},
            "flags": {f: sum(int(r[f]) for r in app_rows) for f in _COUNTED_FLAGS},
            "dead_reasons": sorted(
                (
                    {"appid": r["appid"], "reason": _failure_name(code), "entries": count}
                    for r in app_rows
                    for code in range(len(FAILURES) + 1)
                    if (count := int(r[f"dead_{code}"]))
                ),
                key=lambda e: (e["appid"], e["reason"]),
            ),
            "dead_messages": sum(int(r["in_dlq"]) for r in message_rows),
        }

    def listed(self) -> dict[str, list[Any]]:
        """The stored deliveries each bounded list of the report names, each in its
        order, in one query (a window per list over the few candidates): the
        dead-letter queue's oldest and most tried entries (DLQ_TABLE each), samples of
        the stuck deliveries and of two anomalies (``sample_size`` each)."""
        c = F.col
        size = max(self.options.sample_size, 0)
        dead = c("status") == "dead"
        lists = {  # name: (which deliveries, how many, its first sort key)
            "oldest": (dead, DLQ_TABLE, c("dead_since")),
            "most_tried": (dead, DLQ_TABLE, -c("tries")),
            "stuck": (c("outcome") == "stuck", size, F.lit(0)),
            **{flag: (c(flag), size, F.lit(0)) for flag in _COUNTED_FLAGS},
        }
        wanted = {name: spec for name, spec in lists.items() if spec[1] > 0}
        name = c("list")

        def per_list(pick: int) -> Column:
            return F.coalesce(*(F.when(name == n, spec[pick]) for n, spec in wanted.items()))

        rank = F.row_number().over(Window.partitionBy(name).orderBy(per_list(2), *_ref_order()))
        in_some = functools.reduce(operator.or_, (spec[0] for spec in wanted.values()))
        names = F.array(*(F.when(spec[0], F.lit(n)) for n, spec in wanted.items()))
        rows = (
            self.deliveries.where(c("stored") & in_some)
            .select(
                F.explode(F.array_compact(names)).alias("list"),
                *("appid", "msgid", "recipient", "failure", "tries", "dead_since"),
            )
            .select("*", rank.alias("rank"))
            .where(c("rank") <= per_list(1))
            .collect()
        )
        found: dict[str, list[Any]] = {n: [] for n in lists}
        for r in sorted(rows, key=lambda r: int(r["rank"])):
            found[r["list"]].append(r)
        return found

    # ---- 4. the dead-letter queue
    def dead_letters(self, outcomes: dict[str, Any]) -> dict[str, Any]:
        """The DLQ: the dead deliveries (not purged), and the messages they are of."""
        with self.prog.stage("dead-letter queue") as notes:
            by_reason = outcomes["dead_reasons"]
            oldest_rows, most_rows = self.lists["oldest"], self.lists["most_tried"]
            histories, last_to, _ = self.after_lists.result()
            entries = sum(r["entries"] for r in by_reason)
            messages = outcomes["dead_messages"]
            notes.append(f"{entries:,} entries of {messages:,} messages")

        def entry(r: Any) -> dict[str, Any]:
            key = (r["appid"], r["msgid"], r["recipient"])
            return {
                "appid": r["appid"],
                "msgid": r["msgid"],
                "recipient": r["recipient"],
                "last_recipient": last_to.get(key),
                "reason": _failure_name(r["failure"]),
                "attempts": int(r["tries"]),
                "dead_since": int(r["dead_since"]),
                "history": histories.get(key, []),
            }

        return {
            "entries": entries,
            "messages": messages,
            "by_app_reason": by_reason,
            "oldest": [entry(r) for r in oldest_rows],
            "most_tried": [entry(r) for r in most_rows],
        }

    def _histories(self, rows: Sequence[Any]) -> tuple[dict[_Ref, list[Any]], dict[_Ref, str]]:
        """The log events of a few deliveries, in order (at most HISTORY_EVENTS each), and
        the last recipient each went to (a consumer group's: ``group:<name>/<consumer>``,
        the consumer its last pull names).

        The same pass over the events keeps those of the deliveries with both an ack
        and a dead letter, for the acked-after-dead-letter scan (``self.picked``).
        """
        wanted = _key_frame(
            self.spark, sorted({(r["appid"], r["msgid"], r["recipient"]) for r in rows}, key=str)
        )
        candidates = self.deliveries.where(F.col("stored") & F.col("acked_and_dead")).select(
            F.col("appid").alias("k_appid"),
            F.col("msgid").alias("k_msgid"),
            F.col("recipient").alias("k_recipient"),
        )
        self.picked = self.keep(
            _delivery_events(self.events, wanted.unionByName(candidates).distinct())
        )
        want = wanted.toDF("w_appid", "w_msgid", "w_recipient")
        joined = self.picked.join(
            F.broadcast(want),
            (F.col("k_appid") == F.col("w_appid"))
            & (F.col("k_msgid") == F.col("w_msgid"))
            & F.col("k_recipient").eqNullSafe(F.col("w_recipient")),
            "left_semi",
        )
        if not rows:
            return {}, {}
        found: dict[_Ref, list[Any]] = {}
        last_to: dict[_Ref, str] = {}
        consumer: dict[_Ref, str] = {}
        for r in joined.orderBy(*_history_order()).collect():
            key = (r["k_appid"], r["k_msgid"], r["k_recipient"])
            history = found.setdefault(key, [])
            if r["recipient"] is not None:
                last_to[key] = r["recipient"]
            pulled = _PULLED_BY.match(r["detail"] or "") if r["event"] == Event.PUSHED else None
            if pulled is not None:
                consumer[key] = pulled.group(1)
            if len(history) < HISTORY_EVENTS:
                history.append(
                    {
                        "ts": int(r["ts"]),
                        "event": r["event"],
                        "recipient": r["recipient"],
                        "attempt": r["attempt"],
                        "detail": r["detail"],
                    }
                )
        for key, to in last_to.items():
            if to.startswith(GROUP_PREFIX) and key in consumer:
                last_to[key] = f"{to}/{consumer[key]}"
        return found, last_to

    # ---- 5. per recipient and over time
    def count_events(self, stats: dict[str, Any]) -> None:
        """Start the count of events per recipient and per time bucket (one pass over
        the events), for :meth:`event_counts`."""
        width = time_width(stats["first_ts"], stats["last_ts"])
        self.counted = (
            width,
            self.start(
                lambda: (
                    self.events.groupBy(
                        "appid",
                        "recipient",
                        (F.floor(F.col("ts") / F.lit(width)) * F.lit(width)).alias("t"),
                    )
                    .agg(
                        *(
                            count_if(counted(e)).alias(name)
                            for name, e in (_RECIPIENT_COLUMNS | _CHART_COLUMNS).items()
                        )
                    )
                    .collect()
                )
            ),
        )

    def event_counts(self) -> tuple[Any, Any, dict[str, Any]]:
        """Per recipient and per time bucket (counted by :meth:`count_events`)."""
        recipient_columns, chart = _RECIPIENT_COLUMNS, _CHART_COLUMNS
        width, counted = self.counted
        with self.prog.stage("counts per recipient and over time") as notes:
            rows = counted.result()
            per_recipient: dict[tuple[str, str], dict[str, int]] = {}
            per_time: dict[int, dict[str, int]] = {}
            for r in rows:
                if r["recipient"] is not None:
                    counts = per_recipient.setdefault((r["appid"], r["recipient"]), {})
                    for name in recipient_columns:
                        counts[name] = counts.get(name, 0) + int(r[name])
                if any(r[name] for name in chart):
                    bucket = per_time.setdefault(int(r["t"]), dict.fromkeys(chart, 0))
                    for name in chart:
                        bucket[name] += int(r[name])
            keys = ("pushes", "acked", "rejected", "errored", "timeouts")
            by_recipient = [
                {"appid": a, "recipient": rid, **{k: c[k] for k in keys}}
                for (a, rid), c in sorted(per_recipient.items())
            ]
            extra = [
                {
                    "appid": a,
                    "recipient": rid,
                    **{k: c[k] for k in ("unreachable", "lost", "dead_lettered")},
                }
                for (a, rid), c in sorted(per_recipient.items())
            ]
            names = [e.value for e in _CHART_EVENTS]
            series = fill_buckets(
                [
                    {"t": t, **{e.value: c["c_" + e.value] for e in _CHART_EVENTS}}
                    for t, c in per_time.items()
                ],
                width,
                names,
            )
            notes.append(f"{len(by_recipient)} recipients, {len(series)} buckets of {width}ms")
        return by_recipient, extra, {"bucket_ms": width, "rows": series}

    # ---- 6. anomalies
    def _histories_and_late(self, lists: dict[str, list[Any]]) -> tuple[Any, Any, list[Any]]:
        """The dead-letter queue's histories (:meth:`_histories`), then the deliveries
        acked after a dead letter: how many, and the first ``sample_size`` of them, in
        one query."""
        histories, last_to = self._histories([*lists["oldest"], *lists["most_tried"]])
        by_ref = Window.orderBy(*_ref_order())
        everyone = by_ref.rowsBetween(Window.unboundedPreceding, Window.unboundedFollowing)
        late = (
            _acked_after_dead_letter(self.picked)
            .select(
                "appid",
                "msgid",
                "recipient",
                F.row_number().over(by_ref).alias("rank"),
                F.count(F.lit(1)).over(everyone).alias("late"),
            )
            .where(F.col("rank") <= max(self.options.sample_size, 1))
            .collect()
        )
        return histories, last_to, late

    def anomalies(self, outcomes: dict[str, Any]) -> dict[str, Any]:
        with self.prog.stage("anomalies") as notes:
            size = max(self.options.sample_size, 0)
            late = self.after_lists.result()[2]
            found = dict(outcomes["flags"])
            found["acked_after_dead_letter"] = int(late[0]["late"]) if late else 0
            anomalies: dict[str, Any] = dict(found)
            anomalies["samples"] = {
                **{flag: _ref_rows(self.lists[flag]) for flag in _COUNTED_FLAGS},
                "acked_after_dead_letter": _ref_rows(
                    sorted(late, key=lambda r: int(r["rank"]))[:size]
                ),
            }
            anomalies["acked_before_stored"] = outcomes["negative"]
            anomalies["unstored_messages"] = outcomes["unstored"]
            notes.append(", ".join(f"{v} {k.replace('_', ' ')}" for k, v in found.items()))
        return anomalies


def compute_report(
    spark: SparkSession,
    paths: Sequence[str],
    *,
    options: Options | None = None,
    progress: Progress | None = None,
    lines: DataFrame | None = None,
    simple: bool | None = None,
    parsed: ArrowLines | None = None,
) -> AuditResult:
    """Run the Spark job over ``paths`` (already resolved) and collect the report.

    ``lines``: the lines of ``paths`` already parsed (``inputs.read_events``'s columns,
    as ``skmq audit --follow`` keeps them), instead of reading the files.  ``simple``:
    whether ``inputs.all_simple(paths)`` holds (None: it is asked here).  ``parsed``: the
    lines of ``paths`` as ``inputs.arrow_lines`` parsed them, read from there."""
    opts = options or Options()
    prog = progress if progress is not None else Progress(STAGES, None)
    pool = ThreadPoolExecutor(CONCURRENT_QUERIES, thread_name_prefix="audit-query")
    job = _Job(spark, paths, opts, prog, pool, lines, simple, parsed)
    try:
        stats = job.read()
        job.count_events(stats)
        job.group(stats["last_ts"], stats["group_changes"] > 0)
        outcomes = job.outcomes(stats)
        dead_letters = job.dead_letters(outcomes)
        by_recipient, recipient_extra, throughput = job.event_counts()
        anomalies = job.anomalies(outcomes)
    finally:
        pool.shutdown(cancel_futures=True)
        job.release()
    report: dict[str, Any] = {
        "input": {
            "files": len(paths),
            "events": stats["events"],
            "repeated_lines": stats["repeated_lines"],
            "bad_lines": stats["bad_lines"],
        },
        "totals": outcomes["totals"],
        "outcomes": outcomes["outcomes"],
        "latency_ms": outcomes["latency_ms"],
        "first_push_ms": outcomes["first_push_ms"],
        "attempts": outcomes["attempts"],
        "unresolved": outcomes["unresolved"],
        "dead_letters": dead_letters,
        "by_app": outcomes["by_app"],
        "by_recipient": by_recipient,
        "anomalies": anomalies,
    }
    extras: dict[str, Any] = {
        "first_ts": stats["first_ts"],
        "last_ts": stats["last_ts"],
        "paths": list(paths),
        "topic_deliveries": outcomes["topic_deliveries"],
        "recipients": recipient_extra,
        "throughput": throughput,
        "latency_histogram": outcomes["histogram"],
    }
    return AuditResult(report=report, extras=extras)
