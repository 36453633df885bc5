"""The audit's output files, written to a local directory or any URI Spark can write.

A plain path is written with Python; any URI (``hdfs://``, ``s3a://``, ``abfs://``,
``file://``, ...) through the Hadoop FileSystem of the Spark driver, with
the session's configuration (credentials, endpoints), so ``--conf`` settings apply.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable
from typing import Any

from pyspark.sql import SparkSession

__all__ = ["BY_APP_FIELDS", "BY_RECIPIENT_FIELDS", "join_uri", "render_files", "write_files"]

BY_APP_FIELDS = (
    "appid",
    "messages",
    "acked",
    "dead_lettered",
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


def _write_hadoop(spark: SparkSession, uri: str, text: str) -> None:
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    path = jvm.org.apache.hadoop.fs.Path(uri)
    fs = path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    stream = fs.create(path, True)
    try:
        stream.write(bytearray(text.encode("utf-8")))
    finally:
        stream.close()


def write_files(files: dict[str, str], out: str, spark: SparkSession | None) -> list[str]:
    """Write ``files`` into the directory or URI ``out``; returns what was written."""
    written: list[str] = []
    if _is_local(out):
        os.makedirs(out, exist_ok=True)
    for name, text in files.items():
        target = join_uri(out, name)
        if _is_local(out):
            with open(target, "w", encoding="utf-8", newline="") as handle:
                handle.write(text)
        else:
            if spark is None:
                raise ValueError(f"writing to {out} needs a Spark session")
            _write_hadoop(spark, target, text)
        written.append(target)
    return written
