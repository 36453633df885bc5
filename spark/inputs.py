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
import time
import unicodedata
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import BinaryIO
from urllib.parse import quote, unquote

import pyarrow as pa
import pyarrow.json as pa_json
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
    "ArrowLines",
    "AuditInputError",
    "BadFile",
    "BadLine",
    "BadLinesError",
    "VanishedFile",
    "all_simple",
    "arrow_lines",
    "check_files",
    "file_uri",
    "is_remote",
    "parse_lines",
    "read_arrow_lines",
    "read_events",
    "resolve_log_paths",
    "same_file",
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
_PARSE_SCHEMA = StructType([*LOG_SCHEMA.fields, StructField(_CORRUPT, StringType(), True)])
# Strict JSON: Spark's parser takes 'single quotes' and NaN unless told not to.
_PARSE_OPTIONS = {
    "allowSingleQuotes": "false",
    "allowNonNumericNumbers": "false",
    "columnNameOfCorruptRecord": _CORRUPT,
}
# Spark's JSON file reader takes a string field given as another JSON value as the
# line's bytes there; from_json (and the reader with this off) as the value written again.
_EXACT_STRINGS = "spark.sql.json.enableExactStringParsing"
_BOM = "\ufeff"
_JSON_BLANKS = " \t\r\n"
LOG_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.bz2")
_GLOB_CHARS = re.compile(r"[*?\[]")
# ts is unix milliseconds: from 1973-03-03 (10**11; a ts in seconds is below) to 2109.
MIN_TS = 10**11
MAX_TS = 1 << 42
# A ts later than the audit's own clock by more than this is a line from the future (a
# broker's clock gone wrong): counted as bad, it must not decide the log's end (as_of).
FUTURE_MS = 24 * 3600 * 1000
SAMPLE_CHARS = 300
_CHUNK = 1 << 20
_SCAN_BYTES = 16 << 20


class AuditInputError(Exception):
    """Nothing to audit, or input the user asked to be strict about: one line to show."""


class VanishedFile(AuditInputError):
    """A file listed for the audit was gone when Spark came to read it (a live log
    directory: its broker compressed it meanwhile, `.jsonl` to `.jsonl.gz`)."""

    def __init__(self, message: str, named: str) -> None:
        super().__init__(message)
        self.named = named  # as Spark names it (a URI)


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
    TS_IN_THE_FUTURE = "ts_in_the_future"  # over FUTURE_MS past the audit's clock
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


# A path in a URI as Hadoop's Path makes it (java.net.URI's multi-argument constructors):
# these ASCII characters as they are (RFC 2396's unreserved and punctuation characters,
# "/" and "@"), the other ASCII ones %-quoted, and of the rest only the control and
# space characters (Java's isISOControl, isSpaceChar), as %-quoted UTF-8.
_URI_PATH_CHARS = "/@,;:$&+=-_.!~*'()"
_QUOTED_CATEGORIES = frozenset({"Cc", "Zs", "Zl", "Zp"})


def file_uri(path: str) -> str:
    """Spark's name of the local file ``path`` (absolute, normalised), as its
    ``input_file_name()`` gives it: Hadoop's qualified path, ``toUri().toString()``."""
    return "file://" + "".join(
        quote(char, safe=_URI_PATH_CHARS)
        if char.isascii() or unicodedata.category(char) in _QUOTED_CATEGORIES
        else char
        for char in path
    )


def same_file(named: str, path: str) -> bool:
    """Spark's name of a file (a URI, %-quoted) is ``path`` (as resolve_log_paths gave it)."""
    if named == path:
        return True
    if is_remote(path) or is_remote(named):
        return named.rstrip("/") == path.rstrip("/")
    local = unquote(re.sub(r"^file:(?://)?", "", named))
    return os.path.realpath(local) == os.path.realpath(path.removeprefix("file://"))


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


def _count_of(line: Column, char: str) -> Column:
    """How many times the one-byte ``char`` occurs in ``line`` (byte lengths: no scan
    but the replace's)."""
    return F.octet_length(line) - F.octet_length(F.replace(line, F.lit(char), F.lit("")))


def _closes_only_at_end(line: Column) -> Column:
    """The JSON value that starts at the line's first character ends at its last one.

    Exact for a line whose first value is valid JSON (it parsed): escapes are removed
    (``\\x`` occurs only in strings), then the string literals, then all but brackets;
    the nesting depth of what is left comes back to 0 only at its end.
    """
    unescaped = F.regexp_replace(line, r"\\.", "")
    brackets = F.regexp_replace(unescaped, r'"[^"]*"|[^\[\]{}"]+', "")

    def step(depth: Column, char: Column) -> Column:
        # -1 for good once the value closed before the end, or at a quote left over.
        closed = (depth <= 0) | (char == '"')
        return F.when(closed, -1).when(char.isin("{", "["), depth + 1).otherwise(depth - 1)

    # From the depth 1 of the first "{", through all but the last bracket: still 1.
    chars = F.split(brackets, "")
    inner = F.slice(chars, 2, F.greatest(F.size(chars) - 2, F.lit(0)))
    return (F.aggregate(inner, F.lit(1), step) == 1) & F.endswith(brackets, F.lit("}"))


def _field_types(recheck: Column) -> Column:
    """The JSON type of each field of LOG_FIELDS in the variant ``recheck`` (an array:
    STRING, BIGINT, DECIMAL(20,0), OBJECT<...>, ARRAY<...>, VOID for null; null when
    absent), null when ``recheck`` is."""
    types = [
        F.schema_of_variant(F.try_variant_get(recheck, f"$.{name}", "variant"))
        for name in LOG_FIELDS
    ]
    return F.when(recheck.isNotNull(), F.array(*types))


def _type_reason(line: Column, parsed: Column, recheck: Column, types: Column) -> Column:
    """The reason of a line with a field of the wrong JSON type, null if none.

    ``recheck`` is the line as a variant (``try_parse_json``; null if it is not JSON)
    and ``types`` its fields' JSON types, for the few lines that need it: those Spark
    could not read with the schema, and those with a ``[`` or more than one ``}``, where
    a string field may hold an object or an array (which Spark would read as its JSON
    text).
    """

    def kind(name: str) -> Column:
        return types[LOG_FIELDS.index(name)]

    def given(name: str) -> Column:
        return kind(name).isNotNull() & (kind(name) != "VOID")

    # An integer too large for a long (a decimal or a double to the variant, as 1e12 or
    # 1.5 may be): the line has digits there, no fraction or exponent.
    huge = (kind("ts") != "STRING") & line.rlike(r'"ts"\s*:\s*-?[0-9]+\s*[,}]')
    nested = F.lit(False)
    for name in LOG_FIELDS:
        if name not in _LONG_FIELDS:
            nested = nested | kind(name).startswith("OBJECT") | kind(name).startswith("ARRAY")
    return (
        F.when(recheck.isNull(), F.lit(BadLine.NOT_JSON.value))
        .when(parsed["ts"].isNull() & given("ts") & huge, F.lit(BadLine.TS_OUT_OF_RANGE.value))
        .when(parsed["ts"].isNull() & given("ts"), F.lit(BadLine.BAD_TS_TYPE.value))
        .when(parsed["attempt"].isNull() & given("attempt"), F.lit(BadLine.BAD_ATTEMPT_TYPE.value))
        .when(parsed[_CORRUPT].isNotNull() | nested, F.lit(BadLine.BAD_TYPE.value))
    )


def _reason(columns: dict[str, Column], now_ms: int) -> Column:
    """The BadLine of a (trimmed, non-blank) line, null for a valid event.

    ``parsed`` is the line read with the schema (Spark keeps the fields it could read on
    a line with a field of the wrong type, ``"attempt": "2"`` gives a null attempt, and
    sets the corrupt-record column); ``suspect``: the line was parsed again (``recheck``,
    ``types``) to tell a wrong type; ``one_object``: it is one JSON object, in UTF-8.
    """
    line, parsed, suspect = columns["line"], columns["parsed"], columns["suspect"]
    event_names = [e.value for e in Event]
    recipient_events = [e.value for e in RECIPIENT_EVENTS]
    ts, event = parsed["ts"], parsed["event"]

    def lit(reason: BadLine) -> Column:
        return F.lit(reason.value)

    message_event = ~event.isin(*recipient_events)
    return F.coalesce(
        F.when(~columns["one_object"], lit(BadLine.NOT_JSON)),
        F.when(suspect, _type_reason(line, parsed, columns["recheck"], columns["types"])),
        F.when(ts.isNull(), lit(BadLine.MISSING_TS))
        .when(event.isNull(), lit(BadLine.MISSING_EVENT))
        .when(parsed["appid"].isNull(), lit(BadLine.MISSING_APPID))
        .when((ts >= 10**9) & (ts < MIN_TS), lit(BadLine.TS_IN_SECONDS))
        .when((ts < MIN_TS) | (ts >= MAX_TS), lit(BadLine.TS_OUT_OF_RANGE))
        .when(ts > now_ms + FUTURE_MS, lit(BadLine.TS_IN_THE_FUTURE))
        .when(~event.isin(*event_names), lit(BadLine.UNKNOWN_EVENT))
        .when(
            message_event & (parsed["msgid"].isNull() | (parsed["msgid"] == "")),
            lit(BadLine.MISSING_MSGID),
        )
        .when(
            message_event
            & ~F.coalesce(parsed["kind"].isin(Kind.QUEUE.value, Kind.TOPIC.value), F.lit(False)),
            lit(BadLine.BAD_KIND),
        )
        .when(parsed["attempt"] < 1, lit(BadLine.BAD_ATTEMPT)),
    )


_PATH_NOT_FOUND = re.compile(r"\[PATH_NOT_FOUND\] Path does not exist: (\S+?)\.?(?: SQLSTATE|$)")


def _simple(data: bytes) -> bool:
    """Every line of ``data`` is one JSON-like object without a nested value: it starts
    with ``{`` and ends with its only ``}``, and nothing else is there (no ``[``, no blank
    line, no carriage return, no NUL byte, no byte order mark, valid UTF-8)."""
    if not data:
        return True
    if b"[" in data or b"\r" in data or b"\x00" in data:
        return False
    ends = data.count(b"\n")
    final = data.endswith(b"\n")
    if not (data.startswith(b"{") and data.endswith(b"}\n" if final else b"}")):
        return False
    # Each line end but the last is between a "}" and a "{" (so no line is blank), and
    # the "}" ending each line is its only one: no copy of the data, and no search of
    # "\n\n", which costs more than any other (1.6 GB of lines: 3.9 s of checks, 2.5 without).
    if data.count(b"}") != ends + (not final) or data.count(b"}\n{") != ends - final:
        return False
    if not data.isascii():
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return False
    return True


def all_simple(paths: Sequence[str]) -> bool:
    """Every file of ``paths`` is local, uncompressed, and every line of it simple (one
    JSON-like object with no nested value, :func:`_simple`), as a broker writes them:
    Spark's JSON file reader reads such lines as ``from_json`` would (one row a line,
    in the same order, the same fields, the same corrupt-record text), and faster (it
    parses a line's bytes where ``from_json`` decodes them to characters first)."""
    for path in paths:
        if is_remote(path) or not path.endswith(".jsonl"):
            return False
        try:
            if not _simple_file(path.removeprefix("file://")):
                return False
        except OSError:
            return False
    return True


def _simple_file(path: str) -> bool:
    """:func:`_simple` of the file's text, read a block of whole lines at a time."""
    with open(path, "rb") as handle:
        rest = b""
        while block := handle.read(_SCAN_BYTES):
            data = rest + block
            cut = data.rfind(b"\n") + 1
            if cut and not _simple(data[:cut]):
                return False
            rest = data[cut:]
        return _simple(rest)


_ARROW_SCHEMA = pa.schema(
    [(name, pa.int64() if name in _LONG_FIELDS else pa.string()) for name in LOG_FIELDS]
)
_ARROW_OPTIONS = pa_json.ParseOptions(
    explicit_schema=_ARROW_SCHEMA, unexpected_field_behavior="ignore"
)
_FILE = "file_index"


@dataclass(frozen=True)
class ArrowLines:
    """Lines parsed by Arrow (:func:`arrow_lines`), with ``file_index``, and whether
    some of them have every field equal (``repeats``)."""

    table: pa.Table
    repeats: bool


def arrow_lines(paths: Sequence[str]) -> ArrowLines | None:
    """The lines of ``paths``, simple files (:func:`all_simple`), parsed by Arrow's JSON
    reader (C++, on every core), with ``file_index`` (the line's file in ``paths``);
    None unless Arrow reads every line with the schema.  Arrow's parser is
    stricter than Spark's: it refuses a file with a line of another type in a field
    (``"ts": 1e12``, ``"attempt": "2"``), an integer beyond a long, a name given twice,
    a control character or a lone surrogate in a string; those go to Spark's readers,
    which name each bad line.  What it reads, it reads as they do (a missing field
    null, an unknown one ignored: tests/test_audit.py compares them line by line).

    ``repeats`` is found by Arrow's hash aggregation of the lines' fields, here where the
    audit waits for its JVM: with none, Spark's check of repeated events (a shuffle of
    every event's hash, about 1 s of a 1M audit's 14) has nothing to find."""
    tables = []
    for index, path in enumerate(paths):
        local = path.removeprefix("file://")
        try:
            if os.path.getsize(local) == 0:  # a broker's new file (Arrow refuses it)
                continue
            table = pa_json.read_json(local, parse_options=_ARROW_OPTIONS)
        except (pa.ArrowException, OSError):
            return None
        files = pa.repeat(pa.scalar(index, pa.int32()), table.num_rows)
        tables.append(table.append_column(_FILE, files))
    if not tables:
        return None
    # One chunk: PySpark sends a chunk (or a slice of one) a partition.
    lines = pa.concat_tables(tables).combine_chunks()
    fields = list(LOG_FIELDS)
    distinct = lines.select(fields).group_by(fields, use_threads=False).aggregate([])
    return ArrowLines(lines, repeats=distinct.num_rows < lines.num_rows)


def read_arrow_lines(spark: SparkSession, lines: ArrowLines, paths: Sequence[str]) -> DataFrame:
    """:func:`read_events`'s columns of ``lines`` (:func:`arrow_lines` of ``paths``): a
    DataFrame of Arrow's batches, held in the JVM (a query decodes them, which costs
    less than keeping them as rows); a bad line has no ``bad_text`` (its file is read
    again as text for the sample, as with Spark's JSON reader)."""
    # Two partitions a core (PySpark sends a batch a partition, of at most this many
    # rows; the session's setting, used for nothing else here): fewer tasks to start
    # than one a block of Arrow's reader, and an idle core takes a second's work.
    rows = lines.table.num_rows
    per_batch = max(1, -(-rows // (2 * spark.sparkContext.defaultParallelism)))
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", str(per_batch))
    # Never a local relation (Spark's default under 48 MB of Arrow): the optimizer would
    # evaluate each query's projections and filters over its rows itself, interpreted,
    # on one thread (ConvertToLocalRelation; 300,000 events: 80 s, not 6).
    spark.conf.set("spark.sql.execution.arrow.localRelationThreshold", "0")
    frame = spark.createDataFrame(lines.table)
    names = F.array(*(F.lit(file_uri(path)) for path in paths))
    # Arrow read every line with the schema: no corrupt record, none suspect.
    return parse_simple(
        frame.withColumns(
            {
                _CORRUPT: F.lit(None).cast("string"),
                _FILE: F.element_at(names, F.col(_FILE) + 1),
            }
        ),
        file=_FILE,
    )


def read_events(spark: SparkSession, paths: Sequence[str], simple: bool = False) -> DataFrame:
    """Every non-blank line of ``paths``: the fields of ``LOG_FIELDS``, ``reason`` (a
    :class:`BadLine` value, null for a valid event) and, for bad lines only,
    ``bad_file`` and ``bad_text`` (the line cut to 300 characters).

    The files are read as lines of text (split as Spark's JSON reader splits them) and
    each line parsed with ``from_json`` (:func:`parse_lines`): Spark's JSON reader would
    take a line ``[{...}, {...}]`` for two events and ``[]`` for none, and neither sees
    what follows a line's first value (``{...}{...}``, ``{...} xyz``).  ``simple``: the
    files have no such line (:func:`all_simple`) and are read by Spark's JSON reader
    (:func:`parse_simple`): the same rows in the same order (one scan of the same files,
    split alike), but a bad line that is valid JSON (a missing field, an unknown event)
    has no ``bad_text`` there: its file must be read again as text for the sample.
    """
    try:
        if simple:
            # A number or a boolean given for a string field is read as from_json reads
            # it (12.50 as "12.5"), not as the line's own text: a session setting.
            spark.conf.set(_EXACT_STRINGS, "false")
            reader = spark.read.schema(_PARSE_SCHEMA).options(**_PARSE_OPTIONS)
            return parse_simple(reader.json(list(paths)))
        return parse_lines(spark.read.text(list(paths)))
    except AnalysisException as exc:  # e.g. a path that Spark cannot find
        first = str(exc).splitlines()[0]
        if gone := _PATH_NOT_FOUND.search(first):
            raise VanishedFile(first, gone.group(1)) from exc
        raise AuditInputError(first) from exc


def parse_simple(parsed: DataFrame, file: str | None = None) -> DataFrame:
    """:func:`parse_lines` of simple lines already read by Spark's JSON reader, or by
    Arrow's (the fields of ``_PARSE_SCHEMA``): a line is one object (``one_object``),
    suspect when it could not be read with the schema, and its text is known then only
    (the corrupt record).  ``file``: the column naming each line's file, where Spark's
    ``input_file_name()`` cannot (Arrow's lines)."""
    line = F.col(_CORRUPT)
    fields = [F.col(f.name) for f in _PARSE_SCHEMA.fields]
    checked = parsed.select(
        *LOG_FIELDS,
        line.alias("line"),
        F.struct(*fields).alias("parsed"),
        F.lit(True).alias("one_object"),
        line.isNotNull().alias("suspect"),
        F.when(line.isNotNull(), F.try_parse_json(line)).alias("recheck"),
        *([file] if file is not None else []),
    )
    return _judged(checked, [F.col(name) for name in LOG_FIELDS], file=file)


def _judged(
    checked: DataFrame, fields: Sequence[Column], *keep: str, file: str | None = None
) -> DataFrame:
    """The lines of ``checked`` (``line``, ``parsed``, ``one_object``, ``suspect``,
    ``recheck``, ``keep`` and ``file``) with their event's ``fields``, their ``reason``
    and, for bad lines, ``bad_file`` (the column ``file``, else Spark's file of the line)
    and ``bad_text``: the last steps of every read path."""
    names = ("line", "parsed", "suspect", "one_object", "recheck", "types")
    reason = F.col("reason")
    carried = [file] if file is not None else []
    in_file = F.col(file) if file is not None else F.input_file_name()
    return (
        checked.select("*", _field_types(F.col("recheck")).alias("types"))
        .select(
            "line",
            *keep,
            *carried,
            *fields,
            _reason({name: F.col(name) for name in names}, int(time.time() * 1000)).alias("reason"),
        )
        .select(
            *LOG_FIELDS,
            reason,
            F.when(reason.isNotNull(), in_file).alias("bad_file"),
            F.when(reason.isNotNull(), F.substring("line", 1, SAMPLE_CHARS)).alias("bad_text"),
            *keep,
        )
    )


def parse_lines(raw: DataFrame, *keep: str) -> DataFrame:
    """:func:`read_events` of lines already read: ``raw`` has the line in ``value`` (a
    batch of a stream, too); ``keep`` names other columns of ``raw`` to keep beside.

    The steps are apart so that the cheap ones run as generated code (from_json and a
    lambda are interpreted); ``bad_file`` is the file Spark read the line from.
    """
    value = F.col("value")
    # JSON's white space around the value, and a byte order mark before it (a file's
    # first line, from an editor), are no part of it: trimmed off (a copy) only where
    # the line does not start with "{" and end with "}".
    unmarked = F.when(F.startswith(value, F.lit(_BOM)), F.substring(value, 2, 1 << 30))
    trimmed = F.trim(unmarked.otherwise(value), F.lit(_JSON_BLANKS))
    braced = F.startswith(value, F.lit("{")) & F.endswith(value, F.lit("}"))
    line = F.col("line")
    texts = (
        raw.select(F.when(braced, value).otherwise(trimmed).alias("line"), *keep)
        .where(line != "")
        .select(
            "line",
            *keep,
            _count_of(line, "}").alias("closes"),
            (F.startswith(line, F.lit("{")) & F.endswith(line, F.lit("}"))).alias("braced"),
            F.contains(line, F.lit("[")).alias("bracket"),
            F.is_valid_utf8(line).alias("utf8"),
        )
    )
    closes = F.col("closes")
    one_object = (
        F.col("utf8")
        & F.col("braced")
        & F.when(closes == 1, F.lit(True)).otherwise(_closes_only_at_end(line))
    )
    # Interpreted (not generated code): from_json, and the lambda of the rare check.
    parsed = texts.select(
        "*",
        F.from_json(line, _PARSE_SCHEMA, _PARSE_OPTIONS).alias("parsed"),
        one_object.alias("one_object"),
    )
    suspect = F.col("parsed")[_CORRUPT].isNotNull() | F.col("bracket") | (closes > 1)
    checked = parsed.select(
        "line",
        *keep,
        "parsed",
        "one_object",
        suspect.alias("suspect"),
        F.when(suspect, F.try_parse_json(line)).alias("recheck"),
    )
    return _judged(checked, [F.col("parsed")[name].alias(name) for name in LOG_FIELDS], *keep)
