"""Delivery-log audit of SKMQ: a PySpark job on the DataFrame API (docs/AUDIT.md).

Run it as ``skmq audit --logs PATH --out DIR``, as ``python -m skmq.audit_job.audit``,
or on a cluster as ``spark-submit [--master URL] spark/audit.py --logs PATH --out DIR``
(the driver needs ``skmq`` installed, ``pip install 'skmq[audit]'``; executors run
only Spark SQL expressions, no Python).  This module is the entry point: arguments,
input checks, the session, the outputs; the work is in ``report.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any, TextIO

if __name__ == "__main__" and not __package__:
    # spark-submit spark/audit.py: run the installed package (relative imports below).
    sys.exit(importlib.import_module("skmq.audit_job.audit").main())

from py4j.protocol import Py4JNetworkError
from pyspark.sql import SparkSession

from .arguments import add_arguments, check_arguments
from .inputs import (
    LOG_SCHEMA,
    ArrowLines,
    AuditInputError,
    BadFile,
    BadLinesError,
    VanishedFile,
    all_simple,
    arrow_lines,
    check_files,
    is_remote,
    resolve_log_paths,
    same_file,
)
from .outputs import check_out, render_files, write_files
from .report import (
    REPORT_KEYS,
    STAGES,
    AuditResult,
    Options,
    Progress,
    compute_report,
)
from .report_html import render_html
from .session import (
    EndOnSignal,
    build_spark,
    input_bytes,
    is_small,
    local_cores,
    parse_conf,
)

# timezone.utc, not datetime.UTC: the official Spark images run Python 3.10.
UTC = timezone.utc  # noqa: UP017

__all__ = [
    "LOG_SCHEMA",
    "REPORT_KEYS",
    "AuditInputError",
    "AuditResult",
    "Options",
    "add_arguments",
    "build_spark",
    "compute_report",
    "error_line",
    "follow_audit",
    "main",
    "resolve_log_paths",
    "run_audit",
    "write_outputs",
]

_JAVA_CLASS = re.compile(r"^(?:[a-z][a-z0-9_]*\.)+(?=[A-Z]\w*(?:Exception|Error)\b)")
_URI = re.compile(r"\b(?:file|hdfs|s3a?|gs|abfss?|wasbs?|viewfs):/+[^\s,;'\"]+")
# Spark's error for a file it could not read (FAILED_READ_FILE), and the cause's line.
_FAILED_READ = re.compile(r"Encountered error while reading file (\S+?)\.?(?:\s|$)")
_CAUSE = re.compile(r"^\s*Caused by: (.+)$", re.MULTILINE)


def write_outputs(
    result: AuditResult,
    out: str,
    meta: dict[str, Any] | None = None,
    spark: SparkSession | None = None,
) -> list[str]:
    """Write report.json, report.html, by_app.csv and by_recipient.csv into ``out``."""
    report = {key: result.report[key] for key in REPORT_KEYS}
    files = render_files(report, lambda: render_html(report, result.extras, meta or {}))
    return write_files(files, out, spark)


def _usable(paths: list[str], skip_bad_files: bool) -> tuple[list[str], list[BadFile]]:
    bad = check_files(paths)
    if bad and not skip_bad_files:
        raise AuditInputError(
            f"cannot read {len(bad)} file(s): "
            + "; ".join(b.line() for b in bad)
            + " (--skip-bad-files to audit the others)"
        )
    skipped = {b.path for b in bad}
    usable = [p for p in paths if p not in skipped]
    if not usable:
        raise AuditInputError("no readable log file: " + "; ".join(b.line() for b in bad))
    return usable, bad


def _failed_file(exc: BaseException, paths: Sequence[str]) -> BadFile | None:
    """The input file a Spark failure names as the one it could not read, and why."""
    text = "\n".join([str(exc), *(str(getattr(exc, a, "")) for a in ("java_exception",))])
    found = _FAILED_READ.search(text)
    if found is None:
        return None
    path = next((p for p in paths if same_file(found.group(1), p)), None)
    if path is None:
        return None
    causes = _CAUSE.findall(text)
    problem = _JAVA_CLASS.sub("", causes[-1].strip(), count=1) if causes else "Spark failed"
    if len(problem) > 200:
        problem = problem[:200] + "..."
    return BadFile(path, f"Spark cannot read it ({problem})")


def _inspect(paths: list[str], parse: bool) -> tuple[bool, ArrowLines | None]:
    """Whether every file is simple (``inputs.all_simple``) and, if ``parse``, the
    lines parsed by Arrow (``inputs.arrow_lines``): a cold audit of 1M events spends
    about 1.5 CPU s there against 10 in Spark's JSON reader on a JVM not yet warm, and
    0.9 more on whether any lines repeat, against about 2 in Spark's check."""
    simple = all_simple(paths)
    return simple, arrow_lines(paths) if simple and parse else None


def _compute(
    session: SparkSession,
    paths: list[str],
    skipped: list[BadFile],
    skip_bad_files: bool,
    options: Options | None,
    prog: Progress,
    simple: bool | None = None,
    parsed: ArrowLines | None = None,
) -> AuditResult:
    """The report; a file Spark fails on (that the checks let pass: a cut .zst, a remote
    file, one gone since it was listed) stops the audit, or with ``skip_bad_files`` is
    skipped and the audit run again. A log file its broker compressed meanwhile is read
    compressed. ``simple``: ``inputs.all_simple(paths)``, None to ask it; ``parsed``:
    ``inputs.arrow_lines(paths)``."""
    while True:
        cause: Exception
        try:
            return compute_report(
                session, paths, options=options, progress=prog, simple=simple, parsed=parsed
            )
        except VanishedFile as exc:
            path = next((p for p in paths if same_file(exc.named, p)), None)
            if path is None:
                raise
            if path.endswith(".jsonl") and os.path.exists(path + ".gz"):
                # Its broker compressed it meanwhile (skmq/logarchive.py): the same lines.
                paths[paths.index(path)] = path + ".gz"
                simple, parsed = False, None  # a compressed file: read as text
                prog.note(f"{path} was compressed meanwhile: reading {path}.gz")
                prog.index = 0
                continue
            bad, cause = BadFile(path, "gone while the audit ran"), exc
        except AuditInputError:
            raise
        except Exception as exc:
            found = _failed_file(exc, paths)
            if found is None:
                raise
            bad, cause = found, exc
        if not skip_bad_files:
            raise AuditInputError(
                f"cannot read 1 file(s): {bad.line()} (--skip-bad-files to audit the others)"
            ) from cause
        skipped.append(bad)
        paths.remove(bad.path)
        parsed = None
        prog.note(f"skipping {bad.line()}; reading the others again")
        if not paths:
            raise AuditInputError(
                "no readable log file: " + "; ".join(b.line() for b in skipped)
            ) from cause
        prog.index = 0


def run_audit(
    logs: str | Sequence[str],
    out: str,
    master: str | None = None,
    *,
    spark: SparkSession | None = None,
    options: Options | None = None,
    skip_bad_files: bool = False,
    conf: dict[str, str] | None = None,
    driver_memory: str | None = None,
    progress: bool = True,
    stream: TextIO | None = None,
    debug: bool = False,
    exiting: bool = False,
) -> dict[str, Any]:
    """Audit the delivery logs at ``logs``, write the reports into ``out``, return the report.

    ``spark``: an existing session to use (left running); otherwise one is built with
    :func:`build_spark` and stopped at the end, unless ``exiting``: this process ends
    next (``skmq audit``), and the JVM stops the session itself as it exits once this
    process has (its stdin closes, Spark's shutdown hook runs), where PySpark's stop
    would wait up to half a second more, its accumulator server's poll.  Raises
    :class:`AuditInputError` when there is nothing to read, a file cannot be read (unless
    ``skip_bad_files``), or a line is bad under ``options.strict``.  ``debug``: Spark's
    log and traces on stderr.
    """
    prog = Progress(STAGES, (stream or sys.stderr) if progress else None)
    # spark-submit started the JVM already, with its own --master (none given here)
    submitted = spark is None and master is None and "PYSPARK_GATEWAY_PORT" in os.environ
    if spark is not None:
        local_mode = str(spark.sparkContext.master).startswith("local")
    elif master is not None:
        local_mode = local_cores(master) is not None
    else:  # local[*], unless submitted
        local_mode = not submitted
    paths, skipped = _usable(resolve_log_paths(logs, must_exist=local_mode), skip_bad_files)
    if (unusable := check_out(out)) is not None:
        raise AuditInputError(unusable)
    for bad in skipped:
        prog.note(f"skipping {bad.line()}")
    # Whether Spark's JSON reader can read the files (every line simple), and for a
    # small local input the lines parsed by Arrow: found while the JVM starts.
    size = input_bytes(paths)
    checker = ThreadPoolExecutor(1, thread_name_prefix="audit-check")
    inspected = checker.submit(_inspect, list(paths), local_mode and is_small(size))
    checker.shutdown(wait=False)
    session = spark
    if session is None:
        prog.note(f"starting Spark ({'as submitted' if submitted else master or 'local[*]'}) ...")
        session = build_spark(
            master,
            conf=conf,
            driver_memory=driver_memory,
            debug=debug,
            input_size=size,
        )
        if submitted:
            prog.note(f"Spark master: {session.sparkContext.master}")
        asked = [*(conf or {}), *(["spark.driver.memory"] if driver_memory else [])]
        if asked:
            spark_conf = session.sparkContext.getConf()
            prog.note(
                "Spark settings: " + ", ".join(f"{k}={spark_conf.get(k)}" for k in sorted(asked))
            )
    # A process that exits next, on a JVM of its own: a signal ends the JVM first.
    interrupts = EndOnSignal() if exiting and spark is None and not submitted else None
    try:
        with interrupts or contextlib.nullcontext():
            # Spark fails on a file it cannot read, so that the file is named (and skipped).
            for key in ("ignoreCorruptFiles", "ignoreMissingFiles"):
                session.conf.set(f"spark.sql.files.{key}", "false")
            simple, parsed = inspected.result()
            result = _compute(
                session, paths, skipped, skip_bad_files, options, prog, simple, parsed
            )
            result.report["input"]["skipped_files"] = [
                {"path": b.path, "problem": b.problem} for b in skipped
            ]
            with prog.stage(f"writing reports to {out}") as notes:
                meta = {
                    "generated": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
                    "logs": [logs] if isinstance(logs, str) else list(logs),
                    "files": len(paths),
                    "master": session.sparkContext.master,
                    "elapsed_s": round(time.monotonic() - prog.started, 1),
                }
                written = write_outputs(result, out, meta, session)
                notes.append(", ".join(os.path.basename(p) for p in written))
    finally:
        if spark is None and not exiting:
            session.stop()
    return result.report


JVM_GONE = (
    "Spark's Java process is gone, most often out of memory (a huge line, or a driver "
    "heap too small: --driver-memory)"
)


def _jvm_gone(exc: BaseException) -> bool:
    """py4j lost the JVM, somewhere in the chain of `exc`: it died (its own heap, or the
    OOM killer). Python's only connection in an audit is py4j's, to the JVM."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        if isinstance(at, (ConnectionError, Py4JNetworkError)):
            return True
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return False


def error_line(exc: BaseException) -> str:
    """One line for a failure of Spark or its storage: the Java cause, the file named."""
    if _jvm_gone(exc):
        return JVM_GONE
    text = str(exc).strip()
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.strip().startswith(("at ", "..."))
    ]
    first = lines[0] if lines else repr(exc)
    if first.startswith("An error occurred while calling") and len(lines) > 1:
        first = lines[1].lstrip(": ")  # py4j: the Java exception is on the next line
    first = _JAVA_CLASS.sub("", first, count=1)
    if len(first) > 300:
        first = first[:300] + "..."
    named = _URI.search(text)
    if named is not None and named.group(0) not in first:
        return f"{first} (file {named.group(0)})"
    return first


def follow_audit(
    logs: Sequence[str],
    out: str,
    master: str | None = None,
    *,
    options: Options | None = None,
    interval_s: float = 10.0,
    skip_bad_files: bool = False,
    conf: dict[str, str] | None = None,
    driver_memory: str | None = None,
    progress: bool = True,
    debug: bool = False,
) -> dict[str, Any]:
    """``--follow``: :func:`follow.follow` on a session of its own, local only (the
    chunks of new lines are written on this machine)."""
    from .follow import FollowSettings, StopSignals, follow

    if master is not None and local_cores(master) is None:
        raise AuditInputError(f"--follow runs in local mode only, not on --master {master}")
    if "://" in out and not out.startswith("file://"):
        raise AuditInputError("--follow writes its reports to a local directory only")
    out = out.removeprefix("file://")
    for item in logs:
        local = os.path.expanduser(item.removeprefix("file://"))
        if is_remote(item) or not (os.path.isdir(local) or os.path.exists(local)):
            raise AuditInputError(f"--follow: no local directory or file {item}")
    if (unusable := check_out(out)) is not None:
        raise AuditInputError(unusable)
    stream = sys.stderr if progress else None
    if stream is not None:
        stream.write(f"starting Spark ({master or 'local[*]'}) ...\n")
    signals = StopSignals()
    with signals as stop:
        session = build_spark(master, conf=conf, driver_memory=driver_memory, debug=debug)
        signals.again()
        for key in ("ignoreCorruptFiles", "ignoreMissingFiles"):
            session.conf.set(f"spark.sql.files.{key}", "false")
        try:
            settings = FollowSettings(
                list(logs), out, interval_s, options or Options(), skip_bad_files
            )
            return follow(session, settings, progress=stream, stop=stop)
        finally:
            session.stop()


def audit_from_args(args: argparse.Namespace, prog: str) -> dict[str, Any] | int:
    """Run the audit for parsed arguments, in a process that exits next: the report, or an
    exit status after one line."""
    if not args.debug:
        # py4j logs a lost JVM's traces on the root logger, which would then configure
        # itself to print them: the one line below says it, the traces come with --debug.
        logging.getLogger().addHandler(logging.NullHandler())
    try:
        check_arguments(args)
        conf = parse_conf(args.conf)
        options = Options(
            sample_size=args.sample,
            stuck_after_ms=round(args.stuck_after * 1000),
            strict=args.strict,
        )
        if args.follow:
            return follow_audit(
                args.logs,
                args.out,
                args.master,
                options=options,
                interval_s=args.interval,
                skip_bad_files=args.skip_bad_files,
                conf=conf,
                driver_memory=args.driver_memory,
                progress=not args.quiet,
                debug=args.debug,
            )
        return run_audit(
            args.logs,
            args.out,
            args.master,
            options=options,
            skip_bad_files=args.skip_bad_files,
            conf=conf,
            driver_memory=args.driver_memory,
            progress=not args.quiet,
            debug=args.debug,
            exiting=True,
        )
    except (AuditInputError, ValueError) as exc:
        if args.debug:
            raise
        print(f"{prog}: {exc}", file=sys.stderr)
        return 3 if isinstance(exc, BadLinesError) else 2
    except Exception as exc:  # Spark, Java, storage: one line, the trace with --debug
        if args.debug:
            raise
        print(f"{prog}: failed: {error_line(exc)} (--debug for details)", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """``spark-submit spark/audit.py`` / ``python -m skmq.audit_job.audit``."""
    parser = argparse.ArgumentParser(prog="audit", description="Audit SKMQ delivery logs.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    report = audit_from_args(args, "audit")
    if isinstance(report, int):
        return report
    totals = report["totals"]
    print(
        f"{totals['messages']} messages: {totals['acked']} acked, "
        f"{totals['dead_lettered']} dead-lettered, {totals['dropped']} dropped, "
        f"{totals['unresolved']} unresolved; "
        f"{report['input']['bad_lines']['total']} bad lines; report in {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
