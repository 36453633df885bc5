"""The Spark delivery-log audit (spark/audit.py, skmq audit) against logs of known truth.

One session-scoped SparkSession (local[2]) serves the in-process tests; the CLI test
runs ``skmq audit`` as a subprocess (its own JVM).
"""

from __future__ import annotations

import argparse
import csv
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from audit_truth import BASE_TS, Truth, build, percentile_linear

pytest.importorskip("pyspark")

REPO = Path(__file__).resolve().parents[1]


def _have_java() -> bool:
    home = os.environ.get("JAVA_HOME")
    return bool(home and os.access(os.path.join(home, "bin", "java"), os.X_OK)) or bool(
        shutil.which("java")
    )


needs_java = pytest.mark.skipif(not _have_java(), reason="Spark needs Java 17 or 21")

from pyspark.sql import SparkSession  # noqa: E402
from skmq.audit_job.audit import (  # noqa: E402
    REPORT_KEYS,
    AuditInputError,
    resolve_log_paths,
    run_audit,
)

SEED = 20251121
N_MESSAGES = 1500


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def audited(
    spark: SparkSession, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Truth, dict[str, Any], Path, Path]:
    base = tmp_path_factory.mktemp("audit")
    logs, out = base / "logs", base / "out"
    truth = build(SEED, N_MESSAGES, logs)
    report = run_audit(str(logs), str(out), spark=spark, progress=False)
    return truth, report, logs, out


def _refs(items: list[dict[str, Any]]) -> list[tuple[str, str, str | None]]:
    return [(i["appid"], i["msgid"], i["recipient"]) for i in items]


# ----------------------------------------------------------------- the report vs truth


@needs_java
def test_totals_exact(audited: tuple[Truth, dict[str, Any], Path, Path]) -> None:
    truth, report, _, _ = audited
    assert report["totals"] == truth.totals
    totals = report["totals"]
    assert totals["messages"] == totals["acked"] + totals["dead_lettered"] + totals["unresolved"]
    # the generated log exercises every outcome
    assert min(totals.values()) > 0


@needs_java
def test_attempts_exact(audited: tuple[Truth, dict[str, Any], Path, Path]) -> None:
    truth, report, _, _ = audited
    assert report["attempts"] == truth.attempts
    assert list(report["attempts"]) == sorted(report["attempts"], key=int)
    assert sum(report["attempts"].values()) == truth.totals["acked"]


@needs_java
def test_by_app_exact(audited: tuple[Truth, dict[str, Any], Path, Path]) -> None:
    truth, report, _, _ = audited
    assert [a["appid"] for a in report["by_app"]] == [a["appid"] for a in truth.by_app]
    for got, want in zip(report["by_app"], truth.by_app, strict=True):
        assert list(got) == ["appid", "messages", "acked", "dead_lettered", "unresolved", "p99_ms"]
        assert {k: v for k, v in got.items() if k != "p99_ms"} == {
            k: v for k, v in want.items() if k != "p99_ms"
        }
        assert got["p99_ms"] == pytest.approx(want["p99_ms"], abs=0.0011)


@needs_java
def test_latency_exact_percentiles(audited: tuple[Truth, dict[str, Any], Path, Path]) -> None:
    truth, report, _, _ = audited
    latency = report["latency_ms"]
    assert list(latency) == ["p50", "p95", "p99", "max"]
    assert latency["max"] == truth.latency_ms["max"]
    for key in ("p50", "p95", "p99"):
        want = truth.latency_ms[key]
        assert want is not None
        assert latency[key] == pytest.approx(want, abs=0.0011)
        assert latency[key] == pytest.approx(want, rel=0.05)


@needs_java
def test_by_recipient_exact(audited: tuple[Truth, dict[str, Any], Path, Path]) -> None:
    truth, report, _, _ = audited
    assert report["by_recipient"] == truth.by_recipient
    idle = [r for r in report["by_recipient"] if r["recipient"] == "o9-idle"]
    assert idle == [
        {
            "appid": "orders",
            "recipient": "o9-idle",
            "pushes": 0,
            "acked": 0,
            "rejected": 0,
            "errored": 0,
            "timeouts": 0,
        }
    ]


@needs_java
def test_anomalies(audited: tuple[Truth, dict[str, Any], Path, Path]) -> None:
    truth, report, _, _ = audited
    anomalies = report["anomalies"]
    for key, value in truth.anomalies.items():
        assert anomalies[key] == value, key
    assert anomalies["acked_before_stored"] == 0
    assert _refs(anomalies["unresolved_sample"]) == truth.unresolved[:20]
    for key in ("acked_more_than_once", "pushed_after_ack", "acked_after_dead_letter"):
        assert anomalies[key] > 0
        assert _refs(anomalies["samples"][key]) == truth.flagged[key][:20], key
    # topic resolution is per recipient: an unresolved copy of an acked topic message
    statuses = {(a["appid"]): a for a in report["by_app"]}
    assert statuses["notify"]["unresolved"] < sum(
        1 for ref in truth.unresolved if ref[0] == "notify"
    )


# ------------------------------------------------------------------------ the outputs


@needs_java
def test_report_json_file(audited: tuple[Truth, dict[str, Any], Path, Path]) -> None:
    _, report, _, out = audited
    on_disk = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert list(on_disk) == list(REPORT_KEYS)
    assert on_disk == report
    apps = [a["appid"] for a in on_disk["by_app"]]
    assert apps == sorted(apps)
    pairs = [(r["appid"], r["recipient"]) for r in on_disk["by_recipient"]]
    assert pairs == sorted(pairs)


@needs_java
def test_report_html(audited: tuple[Truth, dict[str, Any], Path, Path]) -> None:
    _, report, _, out = audited
    page = (out / "report.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert page.count("<svg") >= 4  # throughput, latency, attempts, per app
    assert "Throughput over time" in page and "Latency distribution" in page
    assert page.count("<table") >= 4
    for app in report["by_app"]:
        assert f">{app['appid']}<" in page
    for recipient in report["by_recipient"]:
        assert f">{recipient['recipient']}<" in page
    # self-contained: no script, no external stylesheet, image or font
    lowered = page.lower()
    for needle in ("<script", "<link", "src=", "href=", "@import", "url(", "http://", "https://"):
        assert needle not in lowered, needle


@needs_java
def test_csv_files(audited: tuple[Truth, dict[str, Any], Path, Path]) -> None:
    _, report, _, out = audited
    with open(out / "by_app.csv", encoding="utf-8", newline="") as handle:
        apps = list(csv.DictReader(handle))
    assert [{k: (None if v == "" else v) for k, v in row.items()} for row in apps] == [
        {k: (None if v is None else str(v)) for k, v in row.items()} for row in report["by_app"]
    ]
    with open(out / "by_recipient.csv", encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert rows == [{k: str(v) for k, v in row.items()} for row in report["by_recipient"]]
    assert sorted(p.name for p in out.iterdir()) == [
        "by_app.csv",
        "by_recipient.csv",
        "report.html",
        "report.json",
    ]


# ----------------------------------------------------------- definitions on small cases


def _line(ts: int, event: str, msgid: str, appid: str, **more: Any) -> str:
    record = {"ts": ts, "event": event, "msgid": msgid, "appid": appid, "kind": "queue"}
    record |= {"recipient": None, "attempt": None, "broker": "b1", "detail": None} | more
    return json.dumps(record)


@needs_java
def test_definitions_on_a_small_log(spark: SparkSession, tmp_path: Path) -> None:
    t = BASE_TS
    lines = []
    # app "a": four acked messages, latencies 10, 20, 30, 40 ms, acked on attempts 1,1,2,3
    for i, (latency, attempt) in enumerate(((10, 1), (20, 1), (30, 2), (40, 3))):
        msgid = f"m{i}"
        lines.append(_line(t + 1000 * i, "stored", msgid, "a"))
        lines.append(
            _line(t + 1000 * i + latency, "acked", msgid, "a", recipient="r", attempt=attempt)
        )
    # app "b": the same msgid as in "a" (another message), never delivered
    lines.append(_line(t, "stored", "m0", "b"))
    # app "c": a topic message; both copies acked at the same ms: the lower attempt wins;
    # recipient y is pushed after x's ack (normal) and after its own ack (anomaly)
    topic = {"kind": "topic"}
    lines += [
        _line(t, "stored", "t1", "c", **topic),
        _line(t + 5, "pushed", "t1", "c", recipient="x", attempt=1, **topic),
        _line(t + 7, "acked", "t1", "c", recipient="x", attempt=2, **topic),
        _line(t + 6, "pushed", "t1", "c", recipient="y", attempt=1, **topic),
        _line(t + 7, "acked", "t1", "c", recipient="y", attempt=1, **topic),
        _line(t + 9, "pushed", "t1", "c", recipient="y", attempt=2, **topic),
        _line(t + 9, "recipient_lost", "", "c", recipient="z"),
        "",
    ]
    (tmp_path / "delivery-b1-0.jsonl").write_text("\n".join(reversed(lines)), encoding="utf-8")
    report = run_audit(str(tmp_path), str(tmp_path / "out"), spark=spark, progress=False)
    assert report["totals"] == {
        "messages": 6,
        "duplicates": 0,
        "acked": 5,
        "dead_lettered": 0,
        "unresolved": 1,
        "pushes": 3,
    }
    values = [10, 20, 30, 40, 7]
    assert report["latency_ms"] == {
        "p50": 20.0,
        "p95": pytest.approx(percentile_linear(values, 0.95)),
        "p99": pytest.approx(percentile_linear(values, 0.99)),
        "max": 40,
    }
    assert report["latency_ms"]["p95"] == pytest.approx(38.0)  # 30 + 0.8 * (40 - 30)
    assert report["attempts"] == {"1": 3, "2": 1, "3": 1}
    by_app = {a["appid"]: a for a in report["by_app"]}
    assert by_app["a"]["p99_ms"] == pytest.approx(39.7)
    assert by_app["b"] == {
        "appid": "b",
        "messages": 1,
        "acked": 0,
        "dead_lettered": 0,
        "unresolved": 1,
        "p99_ms": None,
    }
    anomalies = report["anomalies"]
    assert anomalies["pushed_after_ack"] == 1
    assert _refs(anomalies["samples"]["pushed_after_ack"]) == [("c", "t1", "y")]
    assert anomalies["acked_more_than_once"] == 0
    assert _refs(anomalies["unresolved_sample"]) == [("b", "m0", None)]
    assert anomalies["invalid_lines"] == 0  # a blank line is not an event, nor invalid
    recipients = {(r["appid"], r["recipient"]): r for r in report["by_recipient"]}
    assert recipients[("c", "z")]["pushes"] == 0
    assert recipients[("c", "y")]["pushes"] == 2


@needs_java
def test_nothing_acked(spark: SparkSession, tmp_path: Path) -> None:
    (tmp_path / "delivery-x-0.jsonl").write_text(
        _line(BASE_TS, "stored", "m", "a") + "\n" + _line(BASE_TS + 5, "dead_lettered", "m", "a"),
        encoding="utf-8",
    )
    report = run_audit(str(tmp_path), str(tmp_path / "out"), spark=spark, progress=False)
    assert report["latency_ms"] == {"p50": None, "p95": None, "p99": None, "max": None}
    assert report["attempts"] == {}
    assert report["totals"]["dead_lettered"] == 1
    assert (tmp_path / "out" / "report.html").read_text(encoding="utf-8").count("<svg") >= 4


@needs_java
def test_resolve_log_paths(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for name in ("delivery-a-0.jsonl", "sub/delivery-b-1.jsonl", "sub/delivery-b-2.jsonl.gz"):
        (tmp_path / name).write_text("", encoding="utf-8")
    (tmp_path / "notes.txt").write_text("", encoding="utf-8")
    (tmp_path / ".hidden.jsonl").write_text("", encoding="utf-8")
    found = resolve_log_paths(str(tmp_path))
    assert [Path(p).relative_to(tmp_path).as_posix() for p in found] == [
        "delivery-a-0.jsonl",
        "sub/delivery-b-1.jsonl",
        "sub/delivery-b-2.jsonl.gz",
    ]
    assert resolve_log_paths(str(tmp_path / "sub" / "*.jsonl")) == [
        str(tmp_path / "sub" / "delivery-b-1.jsonl")
    ]
    assert resolve_log_paths(["hdfs://nn/logs/"]) == ["hdfs://nn/logs/"]
    # for a cluster: what is not here is left to Spark, local files become file: URIs
    assert resolve_log_paths(
        [str(tmp_path / "delivery-a-0.jsonl"), "/on/hdfs"], must_exist=False
    ) == [f"file://{tmp_path / 'delivery-a-0.jsonl'}", "/on/hdfs"]
    with pytest.raises(AuditInputError):
        resolve_log_paths(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(AuditInputError):
        resolve_log_paths(str(tmp_path / "empty"))
    with pytest.raises(AuditInputError):
        resolve_log_paths(str(tmp_path / "nothing-*.jsonl"))


# ------------------------------------------------------------------------------ the CLI


def _cli_module() -> ModuleType:
    """skmq.cli.audit, loaded from its file if the dispatcher's package does not import."""
    try:
        return importlib.import_module("skmq.cli.audit")
    except ImportError:
        path = REPO / "skmq" / "cli" / "audit.py"
        spec = importlib.util.spec_from_file_location("skmq_cli_audit_standalone", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


# Runs `audit` through the module's register()/run() when the `skmq` dispatcher cannot
# be imported yet (its other subcommand modules missing in a partial checkout).
_STANDALONE = """
import argparse, importlib.util, sys
spec = importlib.util.spec_from_file_location("skmq_cli_audit", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
parser = argparse.ArgumentParser(prog="skmq")
module.register(parser.add_subparsers(dest="command", required=True))
args = parser.parse_args(sys.argv[2:])
sys.exit(args.func(args))
"""


def _skmq_command() -> list[str]:
    try:
        importlib.import_module("skmq.cli")
    except ImportError:
        return [sys.executable, "-c", _STANDALONE, str(REPO / "skmq" / "cli" / "audit.py")]
    script = Path(sys.executable).parent / "skmq"
    return [str(script)] if script.exists() else [sys.executable, "-m", "skmq.cli"]


@needs_java
def test_cli_end_to_end(audited: tuple[Truth, dict[str, Any], Path, Path], tmp_path: Path) -> None:
    truth, _, logs, in_process = audited
    out = tmp_path / "out"
    done = subprocess.run(
        [*_skmq_command(), "audit", "--logs", str(logs), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[1/6] reading logs" in done.stderr and "[6/6] writing reports" in done.stderr
    assert f"{truth.totals['messages']:,} messages" in done.stdout
    # the same job in another process and JVM (local[*]) gives the same bytes
    for name in ("report.json", "by_app.csv", "by_recipient.csv"):
        assert (out / name).read_bytes() == (in_process / name).read_bytes(), name
    assert (out / "report.html").exists()


def _cli_args(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(
        logs=[str(tmp_path)], out=str(tmp_path / "out"), master=None, sample=20, quiet=True
    )


def test_cli_without_java(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cli = _cli_module()
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cli.run(_cli_args(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "Java 17 or 21" in err and "openjdk-17" in err


def test_cli_with_a_bad_java_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cli = _cli_module()
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-jdk"))
    assert cli.run(_cli_args(tmp_path)) == 2
    assert "JAVA_HOME" in capsys.readouterr().err


def test_cli_without_pyspark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cli = _cli_module()
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name == "pyspark" else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert cli.run(_cli_args(tmp_path)) == 2
    assert "pip install 'skmq[audit]'" in capsys.readouterr().err


@needs_java
def test_cli_register_and_missing_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli = _cli_module()
    parser = argparse.ArgumentParser(prog="skmq")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["audit", "--logs", str(tmp_path / "none"), "--out", str(tmp_path / "o")]
    )
    assert args.func is cli.run and args.master is None
    assert args.func(args) == 2  # fails before starting Spark
    assert "no such file or directory" in capsys.readouterr().err
