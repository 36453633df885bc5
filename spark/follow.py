"""``skmq audit --follow``: the audit of a live log directory, its report kept current.

A Spark Structured Streaming query reads the chunks of new lines that
:class:`~.tail.LogTail` takes from the log files (see tail.py for why not the log
files themselves); each micro-batch's lines are parsed once (``inputs.parse_lines``)
and appended to a Parquet table, the state kept across micro-batches.  Every
``--interval`` the report's definitions (``report.compute_report``) run over that table,
which holds every line seen so far: the percentiles, the dead-letter queue and the
unresolved deliveries are of the whole log, not of the last batch, so the report
written at the end equals a batch audit of the same files.  A delivery that the report
counts as stuck is printed once, on stdout, and listed in report.json's ``follow``.

SIGINT or SIGTERM ends it: the files are read to their end once more, and the final
report written.  The staging directory (``<out>/.follow``) is removed then.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from skmq.events import LOG_FIELDS

from .arguments import DEFAULT_INTERVAL_S
from .deliveries import delivery_table
from .inputs import KEPT_FIELDS, AuditInputError, file_uri, parse_lines
from .outputs import render_files, write_files
from .report import REPORT_KEYS, STAGES, AuditResult, Options, Progress, compute_report
from .report_html import render_html
from .tail import CHUNK_NAME, LogTail

__all__ = ["FollowSettings", "StopSignals", "follow"]

UTC = timezone.utc  # noqa: UP017 (3.10, as audit.py)
STAGING = ".follow"
# The longest a micro-batch may take to pick up chunks already written, at least.
MIN_CATCH_UP_S = 600.0
# Stuck deliveries kept in report.json's follow section (every one is printed).
STUCK_LISTED = 1000
_SOURCE = "source"


@dataclass
class FollowSettings:
    logs: Sequence[str]
    out: str
    interval_s: float = DEFAULT_INTERVAL_S
    options: Options = field(default_factory=Options)
    skip_bad_files: bool = False


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _iso_ms(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


class _Ingest:
    """The streaming query's foreachBatch: each batch's lines parsed once and appended
    to the state table."""

    def __init__(self, table: str) -> None:
        self.table = table
        self.batches = 0

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        chunk = F.regexp_extract(F.input_file_name(), CHUNK_NAME.pattern, 2).cast("int")
        parsed = parse_lines(batch.select("value", chunk.alias(_SOURCE)), _SOURCE)
        parsed.write.mode("append").parquet(self.table)
        self.batches += 1


def _all_processed(query: StreamingQuery, timeout: float) -> None:
    """``query.processAllAvailable()``, bounded: it has no timeout of its own, so it
    runs in a thread of its own, left to end with the query if it overruns."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            query.processAllAvailable()
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    waiter = threading.Thread(target=run, name="skmq-follow-wait", daemon=True)
    waiter.start()
    waiter.join(timeout)
    if failure:
        raise failure[0]
    if waiter.is_alive():
        raise TimeoutError(
            f"the streaming query did not take in the new lines within {timeout:.0f} s"
        )


class _Follower:
    def __init__(
        self, spark: SparkSession, settings: FollowSettings, prog: Progress, stdout: TextIO
    ) -> None:
        self.spark = spark
        self.settings = settings
        self.prog = prog
        self.stdout = stdout
        self.staging = Path(settings.out) / STAGING
        shutil.rmtree(self.staging, ignore_errors=True)
        self.tail = LogTail(settings.logs, self.staging / "chunks", settings.skip_bad_files)
        self.table = str(self.staging / "lines")
        self.ingest = _Ingest(self.table)
        self.stuck: dict[tuple[str, str, str | None], dict[str, Any]] = {}
        self.updates = 0
        self.started = time.monotonic()

    @contextlib.contextmanager
    def stream(self) -> Iterator[StreamingQuery]:
        period = max(0.5, min(self.settings.interval_s / 4, 5.0))
        query = (
            self.spark.readStream.format("text")
            # A chunk linked from an old compressed log keeps its time: none is too old.
            .option("maxFileAge", "36500d")
            .load(str(self.staging / "chunks"))
            .writeStream.foreachBatch(self.ingest)
            .option("checkpointLocation", str(self.staging / "checkpoint"))
            .trigger(processingTime=f"{period} seconds")
            .start()
        )
        try:
            yield query
        finally:
            query.stop()

    def catch_up(self, query: StreamingQuery, final: bool) -> None:
        if self.tail.poll(final):
            _all_processed(query, max(MIN_CATCH_UP_S, 10 * self.settings.interval_s))

    def lines(self) -> DataFrame | None:
        if self.ingest.batches == 0:
            return None
        frame = self.spark.read.parquet(self.table)
        gone = self.tail.gone()
        if gone:
            frame = frame.where(~F.col(_SOURCE).isin(*gone))
        names = self.spark.createDataFrame(
            [(n, file_uri(name)) for n, name in self.tail.names().items()],
            f"{_SOURCE} int, file string",
        )
        return frame.join(F.broadcast(names), _SOURCE, "left").select(
            *LOG_FIELDS,
            "reason",
            F.when(F.col("reason").isNotNull(), F.col("file")).alias("bad_file"),
            "bad_text",
        )

    def report(self, final: bool) -> dict[str, Any] | None:
        """Compute and write the report (None: no valid event yet)."""
        lines = self.lines()
        if lines is None:
            if final:
                raise AuditInputError(f"no delivery log lines in {', '.join(self.settings.logs)}")
            return None
        files = self.tail.files()
        quiet = Progress(STAGES, None)
        try:
            result = compute_report(
                self.spark, files, options=self.settings.options, progress=quiet, lines=lines
            )
        except AuditInputError as exc:
            if final or not str(exc).startswith("no valid events"):
                raise
            return None
        result.report["input"]["skipped_files"] = [
            {"path": b.path, "problem": b.problem} for b in self.tail.skipped
        ]
        self._report_stuck(lines, result.report)
        self.updates += 1
        report = {key: result.report[key] for key in REPORT_KEYS}
        report["follow"] = {
            "final": final,
            "updated": _now(),
            "updates": self.updates,
            "interval_s": self.settings.interval_s,
            "stuck_reported": len(self.stuck),
            "stuck": list(self.stuck.values())[-STUCK_LISTED:],
        }
        self._write(result, report, files)
        return report

    def _report_stuck(self, lines: DataFrame, report: dict[str, Any]) -> None:
        """Print each delivery stuck (as the report counts them) the first time."""
        unresolved = report["unresolved"]
        if not unresolved["stuck"]:
            return
        as_of = int(unresolved["as_of"])
        events = lines.where(F.col("reason").isNull()).select(*KEPT_FIELDS)
        rows = (
            delivery_table(events, as_of, self.settings.options.stuck_after_ms)
            .where(F.col("stored") & (F.col("status") == "stuck"))
            .select("appid", "msgid", "recipient", "last_ts")
            .orderBy("last_ts", "appid", "msgid", "recipient")
            .collect()
        )
        for row in rows:
            key = (row["appid"], row["msgid"], row["recipient"])
            if key in self.stuck:
                continue
            last = int(row["last_ts"])
            self.stuck[key] = {
                "appid": key[0],
                "msgid": key[1],
                "recipient": key[2],
                "last_event": last,
                "reported": _now(),
            }
            to = f" to {key[2]}" if key[2] is not None else ""
            self.stdout.write(
                f"stuck: {key[0]} {key[1]}{to}: unresolved, no event since {_iso_ms(last)} "
                f"({(as_of - last) / 1000:.0f} s before the log's last event)\n"
            )
        self.stdout.flush()

    def _write(self, result: AuditResult, report: dict[str, Any], files: list[str]) -> None:
        meta = {
            "generated": _now(),
            "logs": list(self.settings.logs),
            "files": len(files),
            "master": self.spark.sparkContext.master,
            "elapsed_s": round(time.monotonic() - self.started, 1),
        }
        texts = render_files(report, lambda: render_html(report, result.extras, meta))
        write_files(texts, self.settings.out, self.spark)


class StopSignals:
    """SIGINT and SIGTERM set the event (the handlers before restored on exit); entered
    before Spark starts, so that a signal meanwhile still ends with a final report, and
    taken back (``again``) once it started: PySpark's SparkContext sets a SIGINT handler
    of its own (cancel every job, raise KeyboardInterrupt), which would end a follow with
    no final report."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.saved: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.event.set()

    def __enter__(self) -> threading.Event:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.saved[signum] = signal.signal(signum, self._handle)
        return self.event

    def again(self) -> None:
        """Take the signals back (from a SparkContext started meanwhile)."""
        for signum in self.saved:
            signal.signal(signum, self._handle)

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)


def follow(
    spark: SparkSession,
    settings: FollowSettings,
    *,
    progress: TextIO | None = sys.stderr,
    stdout: TextIO = sys.stdout,
    stop: threading.Event | None = None,
    on_update: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Follow the logs until SIGINT/SIGTERM (or ``stop``); the final report.

    ``progress``: a line per report on it (None: quiet); ``on_update``: called with each
    report written.
    """
    prog = Progress(STAGES, progress)
    follower = _Follower(spark, settings, prog, stdout)
    signals = StopSignals() if stop is None else contextlib.nullcontext(stop)
    with signals as stopping:
        assert stopping is not None
        try:
            with follower.stream() as query:
                prog.note(
                    f"following {', '.join(settings.logs)}: report in {settings.out} every "
                    f"{settings.interval_s:g} s; SIGINT or SIGTERM ends it"
                )
                while not stopping.is_set():
                    start = time.monotonic()
                    follower.catch_up(query, final=False)
                    report = follower.report(final=False)
                    if report is not None:
                        _note(prog, report, time.monotonic() - start)
                        if on_update is not None:
                            on_update(report)
                    stopping.wait(max(0.0, settings.interval_s - (time.monotonic() - start)))
                prog.note("stopping: reading the logs to their end for the final report ...")
                start = time.monotonic()
                follower.catch_up(query, final=True)
                final = follower.report(final=True)
                assert final is not None
                _note(prog, final, time.monotonic() - start)
        finally:
            follower.tail.close()
    shutil.rmtree(follower.staging, ignore_errors=True)
    return final


def _note(prog: Progress, report: dict[str, Any], seconds: float) -> None:
    totals = report["totals"]
    prog.note(
        f"{report['follow']['updated']}: {report['input']['events']:,} events, "
        f"{totals['messages']:,} messages ({totals['acked']:,} acked, "
        f"{totals['dead_lettered']:,} dead-lettered, {totals['dropped']:,} dropped, "
        f"{totals['unresolved']:,} unresolved), "
        f"{report['unresolved']['stuck']:,} stuck deliveries; report written ({seconds:.1f} s)"
    )
