"""The audit's input: which files to read, which of them cannot be read, and the lines.

``resolve_log_paths`` turns ``--logs`` arguments into paths; ``check_files`` finds the
local files Spark would fail on or misread (unreadable, a truncated gzip, compressed
data under a ``.jsonl`` name); ``read_events`` parses the lines with Spark's JSON reader
and an explicit schema and gives each line that is not a valid event the reason why
(``BadLine``).  Only Spark SQL expressions are used: no Python runs per line.
"""

from __future__ import annotations

import bz2
import glob
import os
import re
import stat
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import BinaryIO

from pyspark.errors import AnalysisException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    LongType,
    StringType,
    StructField,
    StructType,
)

from skmq.events import LOG_FIELDS, RECIPIENT_EVENTS, Event, Kind

__all__ = [
    "LOG_SCHEMA",
    "LOG_SUFFIXES",
    "AuditInputError",
    "BadFile",
    "BadLine",
    "BadLinesError",
    "check_files",
    "is_remote",
    "read_events",
    "resolve_log_paths",
]

_LONG_FIELDS = frozenset({"ts", "attempt"})
LOG_SCHEMA = StructType(
    [
        StructField(name, LongType() if name in _LONG_FIELDS else StringType(), True)
        for name in LOG_FIELDS
    ]
)
# The fields the audit reads (``broker`` is only parsed, for a bad line's text).
KEPT_FIELDS = tuple(name for name in LOG_FIELDS if name != "broker")
_CORRUPT = "_corrupt_record"
_NOT_JSON = "_not_json"
# The same fields all as text: tells a line that is not JSON from one with a bad type.
_TEXT_SCHEMA = StructType(
    [
        *(StructField(name, StringType(), True) for name in LOG_FIELDS),
        StructField(_NOT_JSON, StringType(), True),
    ]
)
LOG_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.bz2")
_GLOB_CHARS = re.compile(r"[*?\[]")
# ts is unix milliseconds: from 1973-03-03 (10**11; a ts in seconds is below) to 2109.
MIN_TS = 10**11
MAX_TS = 1 << 42
SAMPLE_CHARS = 300
_CHUNK = 1 << 20


class AuditInputError(Exception):
    """Nothing to audit, or input the user asked to be strict about: one line to show."""


class BadLinesError(AuditInputError):
    """Bad lines under ``--strict``."""


class BadLine(str, Enum):  # noqa: UP042 (3.10, as skmq.events)
    """Why a line is not counted (``input.bad_lines.by_reason`` keys)."""

    NOT_JSON = "not_json"  # not a JSON object: torn line, binary data, text
    BAD_TS_TYPE = "ts_not_an_integer"  # "ts": "..." or 1.5
    BAD_ATTEMPT_TYPE = "attempt_not_an_integer"  # "attempt": "2" or 2.5
    BAD_TYPE = "field_of_wrong_type"  # any other field of the wrong JSON type
    MISSING_TS = "missing_ts"
    MISSING_EVENT = "missing_event"
    MISSING_APPID = "missing_appid"
    MISSING_MSGID = "missing_msgid"  # a message event without a msgid
    TS_IN_SECONDS = "ts_in_seconds"  # 10**9 <= ts < 10**11: seconds, not milliseconds
    TS_OUT_OF_RANGE = "ts_out_of_range"
    UNKNOWN_EVENT = "unknown_event"  # includes "ACKED": names are case-sensitive
    BAD_KIND = "bad_kind"  # a message event whose kind is not queue or topic
    BAD_ATTEMPT = "attempt_below_1"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class BadFile:
    """A file that cannot be read as a delivery log, and why (one line)."""

    path: str
    problem: str

    def line(self) -> str:
        return f"{self.path}: {self.problem}"


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _log_files_under(directory: str) -> list[str]:
    """The log files under ``directory``, at any depth, links to directories followed
    (each real directory searched once: a link back up is no loop).  A directory that
    cannot be listed is in the list itself, for :func:`check_files` to name."""
    found: list[str] = []
    seen: set[str] = set()
    stack = [directory]
    while stack:
        current = stack.pop()
        real = os.path.realpath(current)
        if real in seen:
            continue
        seen.add(real)
        try:
            with os.scandir(current) as listing:
                entries = list(listing)
        except OSError:
            found.append(current)
            continue
        for entry in entries:
            if entry.name.startswith((".", "_")):
                continue
            try:
                is_dir = entry.is_dir()  # follows a link
            except OSError:
                is_dir = False
            if is_dir:
                stack.append(entry.path)
            elif entry.name.endswith(LOG_SUFFIXES):
                found.append(entry.path)
    return sorted(found)


def _expand_local(item: str, local: str, must_exist: bool) -> list[str] | None:
    """The log files at a local argument; None: pass it to Spark as it is."""
    if os.path.isdir(local):
        found = _log_files_under(local)
        if not found:
            suffixes = ", ".join("*" + s for s in LOG_SUFFIXES)
            raise AuditInputError(f"no delivery log files ({suffixes}) under {item}")
        return found
    if os.path.exists(local):  # a file, or something check_files names (a FIFO)
        return [local]
    matches = sorted(glob.glob(local, recursive=True)) if _GLOB_CHARS.search(local) else []
    if matches:
        out: list[str] = []
        for match in matches:
            out.extend(_log_files_under(match) if os.path.isdir(match) else [match])
        return out
    if not must_exist:
        return None
    if _GLOB_CHARS.search(local):
        raise AuditInputError(f"no file matches {item}")
    raise AuditInputError(f"no such file or directory: {item}")


def _distinct_files(files: Sequence[str]) -> dict[object, str]:
    """Each file once, as first named: the same file under two names (a link, a path
    given twice or also found in a directory) would be counted twice."""
    distinct: dict[object, str] = {}
    for name in files:
        try:
            st = os.stat(name)
            key: object = (st.st_dev, st.st_ino)
        except OSError:  # named by check_files
            key = os.path.realpath(name)
        distinct.setdefault(key, os.path.abspath(name))
    return distinct


def resolve_log_paths(logs: str | Sequence[str], *, must_exist: bool = True) -> list[str]:
    """Turn ``--logs`` arguments into the list of paths given to Spark.

    Local directories are searched recursively for ``*.jsonl`` files (also ``.gz`` and
    ``.bz2``; names starting with ``.`` or ``_`` are skipped), local globs are expanded,
    URIs with a scheme (``hdfs://``, ``s3a://``) pass through.  Raises
    :class:`AuditInputError` when a local argument yields no file.  With
    ``must_exist=False`` (a cluster) a path not found here passes through too (Spark
    resolves it on the cluster's default file system) and local files become ``file:``
    URIs.
    """
    items = [logs] if isinstance(logs, str) else list(logs)
    if not items:
        raise AuditInputError("no log path given")
    uris: list[str] = []
    files: list[str] = []
    for item in items:
        if is_remote(item):
            uris.append(item)
            continue
        local = os.path.expanduser(item.removeprefix("file://"))
        found = _expand_local(item, local, must_exist)
        if found is None:
            uris.append(item)
        else:
            files.extend(found)
    if not files and not uris:
        raise AuditInputError(f"no delivery log files in {', '.join(items)}")
    absolute = list(_distinct_files(files).values())
    if not must_exist:
        absolute = [f"file://{f}" for f in absolute]
    return list(dict.fromkeys([*absolute, *uris]))


# Compressed data, told by its first bytes: (magic, format, the suffix Spark reads it by).
_MAGIC = (
    (b"\x1f\x8b", "gzip", ".gz"),
    (b"BZh", "bzip2", ".bz2"),
    (b"\x28\xb5\x2f\xfd", "zstd", ".zst"),
    (b"\xfd7zXZ\x00", "xz", None),
)
_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _gzip_problem(handle: BinaryIO) -> str | None:
    """Why Hadoop's gzip reader would fail on the file, or None.  Members may follow
    each other; anything else after the last one (zero padding, which Python's gzip
    module accepts) fails Hadoop, as a cut member does."""
    decompressor = zlib.decompressobj(wbits=31)
    data = handle.read(_CHUNK)
    if not data:
        return None  # empty: no line
    while True:
        try:
            decompressor.decompress(data, _CHUNK)
            while decompressor.unconsumed_tail:
                decompressor.decompress(decompressor.unconsumed_tail, _CHUNK)
        except zlib.error as exc:
            return f"not a complete gzip file ({exc})"
        if decompressor.eof:
            data = decompressor.unused_data or handle.read(_CHUNK)
            if not data:
                return None
            if not data.startswith(b"\x1f\x8b"):
                return "not a complete gzip file (data after its end)"
            decompressor = zlib.decompressobj(wbits=31)
            continue
        data = handle.read(_CHUNK)
        if not data:
            return "not a complete gzip file (cut short)"


def _bzip2_problem(path: str) -> str | None:
    try:
        with bz2.open(path, "rb") as handle:
            while handle.read(_CHUNK):
                pass
    except (OSError, EOFError, ValueError) as exc:
        return f"not a complete bzip2 file ({exc})"
    return None


def _problem(path: str) -> str | None:
    """Why Spark could not read the local file ``path`` as a log, or None."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # a FIFO would block the audit forever
            kind = next((k for test, k in _FILE_KINDS if test(mode)), "not a regular file")
            if stat.S_ISDIR(mode):
                os.listdir(path)  # resolve_log_paths lists only the unreadable ones
            return f"cannot be read: {kind}, not a regular file"
        with open(path, "rb") as handle:
            head = handle.read(6)
            if path.endswith(".gz"):
                handle.seek(0)
                return _gzip_problem(handle)
    except OSError as exc:
        what = "directory cannot be read" if os.path.isdir(path) else "cannot be read"
        return f"{what} ({exc.strerror or exc})"
    if path.endswith(".bz2"):
        return _bzip2_problem(path)
    for magic, name, suffix in _MAGIC:
        if path.endswith(".zst") and name == "zstd":
            return None if not head or head.startswith(magic) else "not zstd data"
        if head.startswith(magic):
            if suffix is None:
                return f"{name} data, which Spark cannot read (decompress it)"
            return f"{name} data in a file not named {suffix} (rename it to .jsonl{suffix})"
    return None


def check_files(paths: Sequence[str]) -> list[BadFile]:
    """The local files among ``paths`` that Spark would fail on or misread.

    Remote paths are left to Spark (its errors are turned into one line by the caller).
    Compressed files are read through once, which finds a truncated one.
    """
    bad: list[BadFile] = []
    for path in paths:
        if is_remote(path):
            continue
        problem = _problem(path.removeprefix("file://"))
        if problem is not None:
            bad.append(BadFile(path, problem))
    return bad


def _reason(text: Column, corrupt: Column) -> Column:
    """The BadLine of a line (a string), null for a valid event.

    Spark keeps the fields it could parse on a corrupt line (``"attempt": "2"`` gives
    a null attempt, the rest as read); ``text`` is the line parsed with every field as
    text, so a field null in the first and set in the second had the wrong type.
    """
    event_names = [e.value for e in Event]
    recipient_events = [e.value for e in RECIPIENT_EVENTS]
    ts, event = F.col("ts"), F.col("event")

    def lit(reason: BadLine) -> Column:
        return F.lit(reason.value)

    message_event = ~event.isin(*recipient_events)
    return (
        F.when(text[_NOT_JSON].isNotNull(), lit(BadLine.NOT_JSON))
        .when(ts.isNull() & text["ts"].isNotNull(), lit(BadLine.BAD_TS_TYPE))
        .when(
            F.col("attempt").isNull() & text["attempt"].isNotNull(),
            lit(BadLine.BAD_ATTEMPT_TYPE),
        )
        .when(corrupt.isNotNull(), lit(BadLine.BAD_TYPE))
        .when(ts.isNull(), lit(BadLine.MISSING_TS))
        .when(event.isNull(), lit(BadLine.MISSING_EVENT))
        .when(F.col("appid").isNull(), lit(BadLine.MISSING_APPID))
        .when((ts >= 10**9) & (ts < MIN_TS), lit(BadLine.TS_IN_SECONDS))
        .when((ts < MIN_TS) | (ts >= MAX_TS), lit(BadLine.TS_OUT_OF_RANGE))
        .when(~event.isin(*event_names), lit(BadLine.UNKNOWN_EVENT))
        .when(
            message_event & (F.col("msgid").isNull() | (F.col("msgid") == "")),
            lit(BadLine.MISSING_MSGID),
        )
        .when(
            message_event
            & ~F.coalesce(F.col("kind").isin(Kind.QUEUE.value, Kind.TOPIC.value), F.lit(False)),
            lit(BadLine.BAD_KIND),
        )
        .when(F.col("attempt") < 1, lit(BadLine.BAD_ATTEMPT))
    )


def read_events(spark: SparkSession, paths: Sequence[str]) -> DataFrame:
    """Every non-blank line of ``paths``: the fields the audit uses plus ``reason``
    (a :class:`BadLine` value, null for a valid event) and, for bad lines only,
    ``bad_file`` and ``bad_text`` (the line, or its fields as JSON, cut to 300 chars).
    """
    schema = StructType([*LOG_SCHEMA.fields, StructField(_CORRUPT, StringType(), True)])
    try:
        raw = (
            spark.read.schema(schema)
            .option("mode", "PERMISSIVE")
            .option("columnNameOfCorruptRecord", _CORRUPT)
            .json(list(paths))
        )
    except AnalysisException as exc:  # e.g. a path that Spark cannot find
        raise AuditInputError(str(exc).splitlines()[0]) from exc
    corrupt = F.col(_CORRUPT)
    # Only corrupt lines (few) are parsed a second time, to tell why.
    text = F.from_json(corrupt, _TEXT_SCHEMA, {"columnNameOfCorruptRecord": _NOT_JSON})
    reason = _reason(text, corrupt)
    fields = [F.col(name) for name in LOG_FIELDS]
    line = F.coalesce(corrupt, F.to_json(F.struct(*fields)))
    return raw.select(
        *(f for name, f in zip(LOG_FIELDS, fields, strict=True) if name in KEPT_FIELDS),
        reason.alias("reason"),
        F.when(reason.isNotNull(), F.input_file_name()).alias("bad_file"),
        F.when(reason.isNotNull(), F.substring(line, 1, SAMPLE_CHARS)).alias("bad_text"),
    )
