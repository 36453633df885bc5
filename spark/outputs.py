"""The audit's output files, written to a local directory or any URI Spark can write.

A plain path is written with Python; any URI (``hdfs://``, ``s3a://``, ``abfs://``,
``file://``, ...) through the Hadoop FileSystem of the Spark driver, with
the session's configuration (credentials, endpoints), so ``--conf`` settings apply.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

from pyspark.sql import SparkSession

__all__ = [
    "BY_APP_FIELDS",
    "BY_RECIPIENT_FIELDS",
    "check_out",
    "join_uri",
    "render_files",
    "write_files",
]

BY_APP_FIELDS = (
    "appid",
    "messages",
    "acked",
    "dead_lettered",
    "dropped",
    "unresolved",
    "dead_letter_entries",
    "p99_ms",
)
BY_RECIPIENT_FIELDS = ("appid", "recipient", "pushes", "acked", "rejected", "errored", "timeouts")


def _is_local(out: str) -> bool:
    return "://" not in out


def join_uri(out: str, name: str) -> str:
    if _is_local(out):
        return os.path.join(out, name)
    return out.rstrip("/") + "/" + name


def _csv(fields: tuple[str, ...], rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(fields)
    for row in rows:
        writer.writerow(["" if row[f] is None else row[f] for f in fields])
    return buffer.getvalue()


def render_files(report: dict[str, Any], html: Callable[[], str]) -> dict[str, str]:
    """File name -> text of every output file."""
    return {
        "report.json": json.dumps(report, indent=2, ensure_ascii=False, allow_nan=False) + "\n",
        "report.html": html(),
        "by_app.csv": _csv(BY_APP_FIELDS, report["by_app"]),
        "by_recipient.csv": _csv(BY_RECIPIENT_FIELDS, report["by_recipient"]),
    }


def check_out(out: str) -> str | None:
    """Why the reports cannot go to the local directory ``out`` (created if missing), or
    None: told before Spark reads a line, not after the whole job."""
    if not _is_local(out):
        return None
    if os.path.exists(out) and not os.path.isdir(out):
        return f"--out {out}: not a directory"
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        return f"--out {out}: {exc.strerror or exc}"
    if not os.access(out, os.W_OK | os.X_OK):
        return f"--out {out}: not writable"
    return None


def _write_hadoop(spark: SparkSession, files: dict[str, str], out: str) -> list[str]:
    """Each file written as ``.<name>.tmp`` and renamed over the old one when all are.

    Through py4j and PySpark's private ``_jvm`` and ``_jsc`` (the audit's only use of
    them): PySpark has no public way to the driver's Hadoop FileSystem.  Its writers
    (DataFrameWriter, RDD.saveAs*File) write a directory of part files through an output
    committer, never one named file, and rename nothing; pyarrow's or fsspec's file
    systems would not take the session's Hadoop settings (``--conf spark.hadoop.*``,
    credentials) nor know ``s3a://`` or ``abfs://``.
    """
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    staged = []
    for name, text in files.items():
        path = jvm.org.apache.hadoop.fs.Path(join_uri(out, name))
        temp = jvm.org.apache.hadoop.fs.Path(join_uri(out, f".{name}.tmp"))
        fs = path.getFileSystem(conf)
        stream = fs.create(temp, True)
        try:
            stream.write(bytearray(text.encode("utf-8")))
        finally:
            stream.close()
        staged.append((fs, temp, path))
    for fs, temp, path in staged:
        fs.delete(path, False)
        if not fs.rename(temp, path):
            raise OSError(f"cannot rename {temp} to {path}")
    return [join_uri(out, name) for name in files]


def _write_local(files: dict[str, str], out: str) -> list[str]:
    """Each file written to a temporary file in ``out`` and renamed over the old one
    when all are written: a full disk leaves the old reports (or none), never a cut
    one, and no temporary file."""
    os.makedirs(out, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    staged: list[tuple[str, str]] = []
    try:
        for name, text in files.items():
            handle, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=out)
            staged.append((temp, os.path.join(out, name)))
            os.fchmod(handle, 0o666 & ~umask)  # as open() would create it, not 0600
            with open(handle, "w", encoding="utf-8", newline="") as stream:
                stream.write(text)
        for temp, target in staged:
            os.replace(temp, target)
    finally:
        for temp, _ in staged:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
    return [target for _, target in staged]


def write_files(files: dict[str, str], out: str, spark: SparkSession | None) -> list[str]:
    """Write ``files`` into the directory or URI ``out``; returns what was written."""
    if _is_local(out):
        return _write_local(files, out)
    if spark is None:
        raise ValueError(f"writing to {out} needs a Spark session")
    return _write_hadoop(spark, files, out)
