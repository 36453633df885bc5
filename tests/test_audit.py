"""The Spark delivery-log audit (spark/audit.py, skmq audit) against logs of known truth.

One session-scoped SparkSession (local[2]) serves the in-process tests; the CLI test
runs ``skmq audit`` as a subprocess (its own JVM).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import importlib
import importlib.util
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from audit_truth import (
    BAD_LINES,
    BASE_TS,
    OUTCOME_GROUPS,
    STUCK_AFTER_MS,
    LogBuilder,
    Truth,
    build,
    percentile_linear,
)

pytest.importorskip("pyspark")

REPO = Path(__file__).resolve().parents[1]


def _have_java() -> bool:
    home = os.environ.get("JAVA_HOME")
    return bool(home and os.access(os.path.join(home, "bin", "java"), os.X_OK)) or bool(
        shutil.which("java")
    )


needs_java = pytest.mark.skipif(not _have_java(), reason="Spark needs Java 17 or 21")

import skmq.audit_job.inputs as inputs_module  # noqa: E402
from py4j.protocol import Py4JError, Py4JNetworkError  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from skmq.audit_job.arguments import add_arguments, check_arguments  # noqa: E402
from skmq.audit_job.audit import (  # noqa: E402
    JVM_GONE,
    REPORT_KEYS,
    STAGES,
    AuditInputError,
    Options,
    Progress,
    _compute,
    compute_report,
    error_line,
    resolve_log_paths,
    run_audit,
)
from skmq.audit_job.deliveries import (  # noqa: E402
    OUTCOMES,
    PRECEDENCE,
    delivery_table,
    message_table,
)
from skmq.audit_job.inputs import (  # noqa: E402
    LOG_SCHEMA,
    BadFile,
    BadLinesError,
    _simple,
    all_simple,
    arrow_lines,
    check_files,
    file_uri,
    read_arrow_lines,
    read_events,
)
from skmq.audit_job.report import fill_buckets  # noqa: E402
from skmq.audit_job.report_html import COLORS  # noqa: E402
from skmq.audit_job.session import (  # noqa: E402
    CDS_ENV,
    _cds_options,
    cds_archive,
    driver_address,
    input_bytes,
    local_cores,
    parse_conf,
)

from skmq.clock import now_ms  # noqa: E402
from skmq.events import RECOVERED_ACK, Event  # noqa: E402
from skmq.pull.consumer import PullConsumer  # noqa: E402
from tests.conftest import BrokerFactory, eventually  # noqa: E402
from tests.test_delivery import log_events, produce  # noqa: E402

SEED = 20251121
N_MESSAGES = 1500


# ----------------------------------------------------------------------------- fixtures


STUCK_AFTER_S = STUCK_AFTER_MS / 1000
Audited = tuple[Truth, dict[str, Any], Path, Path]


@pytest.fixture(scope="session")
def audited(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Audited:
    base = tmp_path_factory.mktemp("audit")
    logs, out = base / "logs", base / "out"
    truth = build(SEED, N_MESSAGES, logs)
    options = Options(stuck_after_ms=STUCK_AFTER_MS)
    report = run_audit(str(logs), str(out), spark=spark, options=options, progress=False)
    return truth, report, logs, out


def _refs(items: list[dict[str, Any]]) -> list[tuple[str, str, str | None]]:
    return [(i["appid"], i["msgid"], i["recipient"]) for i in items]


# ----------------------------------------------------------------- the report vs truth


@needs_java
def test_totals_exact(audited: Audited) -> None:
    truth, report, _, _ = audited
    assert report["totals"] == truth.totals
    totals = report["totals"]
    groups = ("acked", "dead_lettered", "dropped", "unresolved")
    assert totals["messages"] == sum(totals[g] for g in groups)
    # a topic copy dead for some recipients: more dead-letter entries than messages
    assert totals["dead_letter_entries"] + totals["purged_dead_letters"] > totals["dead_lettered"]
    assert min(totals.values()) > 0  # the generated log exercises every outcome


@needs_java
def test_every_outcome_exact_and_adding_up(audited: Audited) -> None:
    """One row an outcome, each counted exactly (messages and deliveries), every one
    present in the generated log, and the rows add up to the messages stored."""
    truth, report, _, _ = audited
    outcomes = report["outcomes"]
    assert [r["outcome"] for r in outcomes["rows"]] == list(OUTCOMES) == list(OUTCOME_GROUPS)
    assert outcomes["rows"] == truth.outcomes
    assert all(r["messages"] > 0 and r["deliveries"] > 0 for r in outcomes["rows"])
    totals = report["totals"]
    assert outcomes["holds"] is True
    assert sum(r["messages"] for r in outcomes["rows"]) == totals["messages"]
    assert sum(r["deliveries"] for r in outcomes["rows"]) == totals["deliveries"]
    for group in ("acked", "dead_lettered", "dropped", "unresolved"):
        in_group = [r for r in outcomes["rows"] if r["group"] == group]
        assert sum(r["messages"] for r in in_group) == totals[group], group
    dead = [r for r in outcomes["rows"] if r["outcome"].startswith("dead_lettered_")]
    assert sum(r["deliveries"] for r in dead) == totals["dead_letter_entries"]
    assert "messages =" in outcomes["invariant"]


@needs_java
def test_each_delivery_and_message_outcome_push_and_pull(spark: SparkSession) -> None:
    """The definitions (delivery_table, message_table) on the generated events: every
    delivery's and every message's outcome is the truth's, pushed or pulled; the pulls
    end every way a pull can (a lease that runs out on its last attempt among them)."""
    builder = LogBuilder(SEED)
    builder.generate(N_MESSAGES)
    truth = builder.truth()
    events = spark.createDataFrame(builder.events, LOG_SCHEMA)
    as_of = max(e["ts"] for e in builder.events)
    deliveries = delivery_table(events, as_of, STUCK_AFTER_MS).cache()
    got = {
        (r["appid"], r["msgid"], r["recipient"]): r["outcome"]
        for r in deliveries.where("stored").collect()
    }
    assert got == truth.delivery_outcomes
    messages = message_table(deliveries).where("stored").collect()
    assert {(r["appid"], r["msgid"]): r["outcome"] for r in messages} == truth.message_outcomes
    assert all(r["status"] == OUTCOME_GROUPS[r["outcome"]] for r in messages)
    pulled = {o for (_, _, rid), o in got.items() if (rid or "").startswith("group:")}
    pushed = {o for (_, _, rid), o in got.items() if not (rid or "").startswith("group:")}
    assert set(OUTCOMES) == pushed  # every outcome, over pushes
    # over pulls, every one a pull can have (no undeliverable content, no move of a
    # group's dead letter, no wait for a recipient: a pull is its first event)
    assert pulled >= {
        "acked",
        "dead_lettered_attempts",  # nacked, or its lease ran out, on its last attempt
        "dead_lettered_expired",
        "dead_letter_purged",
        "expired_dropped",
        "stuck",
    }
    # (a group's dead letter is never moved; a pull is a delivery's first event)
    assert not pulled & {
        "dead_lettered_undeliverable",
        "dead_letter_moved",
        "waiting_for_recipient",
    }
    assert got[("pulls", "lease-1", "group:ga")] == "dead_lettered_attempts"
    assert list(PRECEDENCE)[-1] == "acked" and set(PRECEDENCE) == set(OUTCOMES)


@needs_java
def test_attempts_count_replays_as_new_attempts(audited: Audited) -> None:
    truth, report, _, _ = audited
    assert report["attempts"] == truth.attempts
    assert list(report["attempts"]) == sorted(report["attempts"], key=int)
    # acked after a replay: the 5 attempts before the dead letter count, so 6 and more
    assert any(int(k) > 5 for k in report["attempts"])
    totals, unresolved = report["totals"], report["unresolved"]
    states = ("not_yet_due", "waiting_for_recipient", "in_flight", "stuck")
    open_deliveries = sum(unresolved[s] for s in states)
    dropped = sum(r["deliveries"] for r in report["outcomes"]["rows"] if r["group"] == "dropped")
    closed = totals["dead_letter_entries"] + totals["purged_dead_letters"] + open_deliveries
    acked_deliveries = totals["deliveries"] - closed - dropped
    assert sum(report["attempts"].values()) == acked_deliveries


@needs_java
def test_by_app_exact(audited: Audited) -> None:
    truth, report, _, _ = audited
    assert [a["appid"] for a in report["by_app"]] == [a["appid"] for a in truth.by_app]
    for got, want in zip(report["by_app"], truth.by_app, strict=True):
        assert list(got) == list(want)
        assert {k: v for k, v in got.items() if k != "p99_ms"} == {
            k: v for k, v in want.items() if k != "p99_ms"
        }
        assert got["p99_ms"] == pytest.approx(want["p99_ms"], abs=0.0011)


def _assert_percentiles(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == ["p50", "p95", "p99", "max"]
    assert got["max"] == want["max"]
    for key in ("p50", "p95", "p99"):
        assert want[key] is not None
        assert got[key] == pytest.approx(want[key], abs=0.0011), key


@needs_java
def test_latency_from_due_time_without_dead_letter_time(audited: Audited) -> None:
    truth, report, _, _ = audited
    _assert_percentiles(report["latency_ms"], truth.latency_ms)


@needs_java
def test_first_push_latency_from_due_time(audited: Audited) -> None:
    truth, report, _, _ = audited
    _assert_percentiles(report["first_push_ms"], truth.first_push_ms)
    # delayed messages are pushed after their due time, not 1-20 s after stored
    assert report["first_push_ms"]["max"] < 1000


@needs_java
def test_unresolved_split(audited: Audited) -> None:
    truth, report, _, _ = audited
    unresolved = report["unresolved"]
    states = ("not_yet_due", "waiting_for_recipient", "in_flight", "stuck")
    assert {s: unresolved[s] for s in states} == truth.unresolved
    assert min(truth.unresolved.values()) > 0
    assert unresolved["stuck_after_ms"] == STUCK_AFTER_MS
    stuck = set(_refs(unresolved["stuck_sample"]))
    assert stuck and stuck <= set(truth.unresolved_refs)


@needs_java
def test_dead_letter_queue(audited: Audited) -> None:
    truth, report, _, _ = audited
    dead = report["dead_letters"]
    want = truth.dead_letters
    for key in ("entries", "messages", "by_app_reason"):
        assert dead[key] == want[key], key
    for key in ("oldest", "most_tried"):
        got = [{k: v for k, v in e.items() if k != "history"} for e in dead[key]]
        assert got == want[key], key
    top = next(e for e in dead["most_tried"] if e["msgid"] == "special-1")
    assert (top["appid"], top["recipient"], top["attempts"], top["reason"]) == (
        "notify",
        "n1",
        10,
        "timeout",
    )
    events = [h["event"] for h in top["history"]]
    assert events.count("dead_lettered") == 2 and events.count("replayed") == 1
    assert all(h["recipient"] in ("n1", None) for h in top["history"])
    assert [h["ts"] for h in top["history"]] == sorted(h["ts"] for h in top["history"])
    assert "stored" in events  # the message-wide events belong to each copy's history
    # the last recipient of each entry pushed: a queue message's named by its pushes
    entries = dead["oldest"] + dead["most_tried"]
    assert all(e["last_recipient"] is not None for e in entries if e["attempts"] > 0)
    assert any(e["recipient"] is None and e["last_recipient"] for e in entries)


@needs_java
def test_by_recipient_exact(audited: Audited) -> None:
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
def test_anomalies(audited: Audited) -> None:
    truth, report, _, _ = audited
    anomalies = report["anomalies"]
    for key, value in truth.anomalies.items():
        assert anomalies[key] == value, key
    assert anomalies["acked_before_stored"] == 0
    for key in ("acked_more_than_once", "pushed_after_ack", "acked_after_dead_letter"):
        assert anomalies[key] > 0
        assert _refs(anomalies["samples"][key]) == truth.flagged[key][:20], key


@needs_java
def test_bad_lines_counted_per_reason_totals_unchanged(audited: Audited) -> None:
    truth, report, _, out = audited
    bad = report["input"]["bad_lines"]
    assert bad["total"] == 37
    assert bad["by_reason"] == dict(sorted(truth.bad_lines.items()))
    assert {s["reason"] for s in bad["samples"]} == set(truth.bad_lines)
    assert all(s["file"].endswith(".jsonl") and s["line"] for s in bad["samples"])
    assert report["input"]["events"] == truth.events
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "Bad lines" in page and "attempt_not_an_integer" in page


# ------------------------------------------------------------------------ the outputs


@needs_java
def test_report_json_file(audited: Audited) -> None:
    _, report, _, out = audited
    on_disk = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert list(on_disk) == list(REPORT_KEYS)
    assert on_disk == report
    apps = [a["appid"] for a in on_disk["by_app"]]
    assert apps == sorted(apps)
    pairs = [(r["appid"], r["recipient"]) for r in on_disk["by_recipient"]]
    assert pairs == sorted(pairs)


@needs_java
def test_report_html(audited: Audited) -> None:
    _, report, _, out = audited
    page = (out / "report.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert page.count("<svg") >= 4  # throughput, latency, attempts, per app
    assert "Dead-letter queue" in page and "special-1" in page  # the DLQ, with its entries
    assert "stuck" in page and "not yet due" in page
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
def test_csv_files(audited: Audited) -> None:
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


def _group_change(ts: int, app: str, group: str, start: int | None, generation: str = "") -> str:
    """A line of a consumer group's making or reset, getting the messages stored from
    `start` (None: its deletion), as the broker logs it (skmq/pull/groups.py)."""
    who = {"kind": None, "recipient": f"group:{group}"}
    if start is None:
        return _line(ts, "recipient_removed", "", app, detail="consumer group deleted", **who)
    detail = f"consumer group made at latest; stored from {start}"
    if generation:
        detail += f"; generation {generation}"
    return _line(ts, "recipient_registered", "", app, detail=detail, **who)


def _audit(spark: SparkSession, logs: Path, out: Path, **options: Any) -> dict[str, Any]:
    return run_audit(str(logs), str(out), spark=spark, options=Options(**options), progress=False)


@needs_java
def test_definitions_on_a_small_log(spark: SparkSession, tmp_path: Path) -> None:
    t = BASE_TS
    topic = {"kind": "topic"}
    dead = {"attempt": 5, "detail": "after 5 attempts; last: rejected"}
    lines = [
        # q1: delayed by 10 s; pushed 5 ms and acked 25 ms after it was due
        _line(t, "stored", "q1", "a", detail=f"deliver_at={t + 10_000}"),
        _line(t + 10_005, "pushed", "q1", "a", recipient="r", attempt=1),
        _line(t + 10_025, "acked", "q1", "a", recipient="r", attempt=1),
        # q2: dead after 5 attempts at +100, replayed at +60100, acked on the broker's
        # attempt 2 at +60140: latency 140 - 60000 in the DLQ = 140 ms, attempt 5 + 2 = 7
        _line(t, "stored", "q2", "a"),
        _line(t + 10, "pushed", "q2", "a", recipient="r", attempt=1),
        _line(t + 100, "dead_lettered", "q2", "a", recipient="r", **dead),
        _line(t + 60_100, "replayed", "q2", "a", recipient="r"),
        _line(t + 60_140, "acked", "q2", "a", recipient="r", attempt=2),
        # t1: a topic message dead for 2 of its 3 recipients: 1 message, 2 entries
        _line(t, "stored", "t1", "c", **topic),
        _line(t + 5, "acked", "t1", "c", recipient="x", attempt=1, **topic),
        _line(t + 6, "dead_lettered", "t1", "c", recipient="y", **dead, **topic),
        _line(t + 7, "dead_lettered", "t1", "c", recipient="z", **dead, **topic),
        # p1: dead, then purged by an operator: a dead-lettered message, no entry
        _line(t, "stored", "p1", "e"),
        _line(t + 8, "dead_lettered", "p1", "e", recipient="r", **dead),
        _line(t + 9, "purged", "p1", "e", recipient="r"),
        # u1: waiting for a retry due after the log ends: not yet due
        _line(t, "stored", "u1", "d"),
        _line(t + 10, "pushed", "u1", "d", recipient="r", attempt=1),
        _line(t + 20, "rejected", "u1", "d", recipient="r", attempt=1),
        _line(
            t + 21, "retry_scheduled", "u1", "d", recipient="r", attempt=1,
            detail=f"next attempt at {t + 999_999}",
        ),
        # u2: pushed at +1000, nothing since: in flight 59 s before the log ends
        _line(t, "stored", "u2", "d"),
        _line(t + 1000, "pushed", "u2", "d", recipient="r", attempt=1),
        # u3: pushed, no event for the last 60 s: stuck
        _line(t - 500, "stored", "u3", "d"),
        _line(t - 400, "pushed", "u3", "d", recipient="r", attempt=1),
        _line(t + 60_140, "recipient_alive", "", "d", recipient="r", kind=None),
        "",
    ]  # fmt: skip
    (tmp_path / "delivery-b1-0.jsonl").write_text("\n".join(reversed(lines)), encoding="utf-8")
    report = _audit(spark, tmp_path, tmp_path / "out", stuck_after_ms=59_500)
    assert report["totals"] == {
        "messages": 7,
        "acked": 2,
        "dead_lettered": 2,
        "dropped": 0,
        "unresolved": 3,
        "deliveries": 9,
        "dead_letter_entries": 2,
        "purged_dead_letters": 1,
        "duplicates": 0,
        "pushes": 5,
    }
    latencies = [25, 140, 5]  # q1, q2, t1/x
    assert report["latency_ms"] == {
        "p50": 25.0,
        "p95": pytest.approx(percentile_linear(latencies, 0.95)),
        "p99": pytest.approx(percentile_linear(latencies, 0.99)),
        "max": 140,
    }
    assert report["first_push_ms"]["max"] == 1000 and report["first_push_ms"]["p50"] == 10
    assert report["attempts"] == {"1": 2, "7": 1}
    unresolved = report["unresolved"]
    assert (unresolved["not_yet_due"], unresolved["in_flight"], unresolved["stuck"]) == (1, 1, 1)
    assert _refs(unresolved["stuck_sample"]) == [("d", "u3", None)]
    dlq = report["dead_letters"]
    assert (dlq["entries"], dlq["messages"]) == (2, 1)
    assert dlq["by_app_reason"] == [{"appid": "c", "reason": "rejected", "entries": 2}]
    assert [(e["recipient"], e["attempts"]) for e in dlq["oldest"]] == [("y", 5), ("z", 5)]
    assert [h["event"] for h in dlq["oldest"][0]["history"]] == ["stored", "dead_lettered"]
    by_app = {a["appid"]: a for a in report["by_app"]}
    assert by_app["c"]["dead_letter_entries"] == 2 and by_app["c"]["dead_lettered"] == 1
    assert by_app["e"]["dead_letter_entries"] == 0 and by_app["e"]["dead_lettered"] == 1
    assert report["anomalies"]["acked_after_dead_letter"] == 0  # acked after its replay
    assert report["input"]["bad_lines"]["total"] == 0  # a blank line is not bad


def _rows(report: dict[str, Any], key: str) -> dict[str, int]:
    return {r["outcome"]: r[key] for r in report["outcomes"]["rows"] if r[key]}


@needs_java
def test_every_outcome_on_a_small_log(spark: SparkSession, tmp_path: Path) -> None:
    """Each way a message ends or waits, one message (or copy) each, as the broker logs it."""
    t = BASE_TS
    r1, r2 = {"recipient": "r1"}, {"recipient": "r2"}
    topic = {"kind": "topic"}
    ga = {"recipient": "group:a"}
    after = "after 1 attempts; last: "
    lines = [
        _line(t, "stored", "a1", "o"),
        _line(t + 10, "pushed", "a1", "o", attempt=1, **r1),
        _line(t + 20, "acked", "a1", "o", attempt=1, **r1),
        # dead after its attempts (the dead letter names no recipient: its pushes do)
        _line(t, "stored", "d1", "o"),
        _line(t + 10, "pushed", "d1", "o", attempt=1, **r1),
        _line(t + 20, "timeout", "d1", "o", attempt=1, **r1),
        _line(t + 21, "dead_lettered", "d1", "o", attempt=1, detail=after + "timeout"),
        # dead, the last attempt rejected
        _line(t, "stored", "d2", "o"),
        _line(t + 10, "pushed", "d2", "o", attempt=1, **r2),
        _line(t + 20, "rejected", "d2", "o", attempt=1, **r2),
        _line(t + 21, "dead_lettered", "d2", "o", attempt=1, detail=after + "rejected", **r2),
        # undeliverable: dead-lettered by the claim, never pushed, no attempt
        _line(t, "stored", "d3", "o"),
        _line(t + 5, "dead_lettered", "d3", "o",
              detail="undeliverable: content holds CR or LF and no recipient declared the length"),
        # its TTL ran out: dead-lettered
        _line(t, "stored", "d4", "o"),
        _line(t + 5, "expired", "d4", "o", detail="dead-lettered"),
        _line(t + 5, "dead_lettered", "d4", "o", detail="expired"),
        # dead-lettered, no reason named
        _line(t, "stored", "d5", "o"),
        _line(t + 5, "dead_lettered", "d5", "o", attempt=3),
        # dead, then purged by an operator
        _line(t, "stored", "p1", "o"),
        _line(t + 10, "pushed", "p1", "o", attempt=1, **r1),
        _line(t + 20, "dead_lettered", "p1", "o", attempt=1, detail=after + "errored", **r1),
        _line(t + 30, "purged", "p1", "o", detail="dead letter purged by an operator", **r1),
        # dead, then moved to app "other" (dlq replay --to-app), acked there
        _line(t, "stored", "m1", "o"),
        _line(t + 10, "pushed", "m1", "o", attempt=1, **r1),
        _line(t + 20, "dead_lettered", "m1", "o", attempt=1, detail=after + "errored", **r1),
        _line(t + 30, "purged", "m1", "o", detail="dead letter moved to app other", **r1),
        _line(t + 30, "stored", "m1", "other", detail="moved from the dead letters of app o"),
        _line(t + 40, "pushed", "m1", "other", attempt=1, **r1),
        _line(t + 50, "acked", "m1", "other", attempt=1, **r1),
        # its TTL ran out with EXPIRED=drop
        _line(t, "stored", "x1", "o"),
        _line(t + 5, "expired", "x1", "o", detail="dropped (EXPIRED=drop)"),
        # purged while pending (skmq purge): no recipient
        _line(t, "stored", "pp1", "o"),
        _line(t + 5, "purged", "pp1", "o", detail="pending message purged by an operator"),
        # a topic message purged while pending: its acked copy stays acked, the other ends
        _line(t, "stored", "tp", "o", **topic),
        _line(t + 10, "pushed", "tp", "o", attempt=1, **r1, **topic),
        _line(t + 20, "acked", "tp", "o", attempt=1, **r1, **topic),
        _line(t + 10, "pushed", "tp", "o", attempt=1, **r2, **topic),
        _line(t + 30, "purged", "tp", "o", detail="pending message purged by an operator",
              **topic),
        # a topic message: c1 acked, c2's copy purged while pending (alone), c3 in flight
        _line(t, "stored", "tc", "o", **topic),
        _line(t + 10, "pushed", "tc", "o", attempt=1, recipient="c1", **topic),
        _line(t + 20, "acked", "tc", "o", attempt=1, recipient="c1", **topic),
        _line(t + 30, "purged", "tc", "o", recipient="c2",
              detail="pending message purged by an operator (user ops)", **topic),
        _line(t + 95_000, "pushed", "tc", "o", attempt=1, recipient="c3", **topic),
        # a topic message acked by n1, dropped for n2, in flight for n3: dropped
        _line(t, "stored", "tm", "o", **topic),
        _line(t + 10, "pushed", "tm", "o", attempt=1, recipient="n1", **topic),
        _line(t + 20, "acked", "tm", "o", attempt=1, recipient="n1", **topic),
        _line(t + 20, "expired", "tm", "o", recipient="n2", detail="dropped (EXPIRED=drop)",
              **topic),
        _line(t + 90_000, "pushed", "tm", "o", attempt=1, recipient="n3", **topic),
        # open: delayed past the end of the log; never pushed; in flight; stuck
        _line(t, "stored", "nd", "o", detail=f"deliver_at={t + 10**6}"),
        _line(t + 10, "stored", "w1", "o"),
        _line(t, "stored", "f1", "o"),
        _line(t + 95_000, "pushed", "f1", "o", attempt=1, **r1),
        _line(t, "stored", "s1", "o"),
        _line(t + 100, "pushed", "s1", "o", attempt=1, **r1),
        # pulled by group a: its lease runs out on its last attempt (as the broker logs it)
        _line(t, "stored", "g1", "o"),
        _line(t + 10, "pushed", "g1", "o", attempt=1, detail="pulled by alice; receipt e.1",
              **ga),
        _line(t + 40, "timeout", "g1", "o", attempt=1, detail="lease ran out; receipt e.1",
              **ga),
        _line(t + 40, "dead_lettered", "g1", "o", attempt=1,
              detail=after + "timeout; receipt e.1", **ga),
        _line(t + 100_000, "recipient_alive", "", "o", recipient="r1", kind=None),
    ]  # fmt: skip
    (tmp_path / "delivery-b1-0.jsonl").write_text("\n".join(lines), encoding="utf-8")
    report = _audit(spark, tmp_path, tmp_path / "out", stuck_after_ms=60_000)
    assert report["input"]["bad_lines"]["total"] == 0
    every = dict.fromkeys(OUTCOMES, 1)
    assert _rows(report, "messages") == every | {
        "acked": 2,  # a1, m1 in app other
        "dead_lettered_attempts": 2,  # d1, g1
        "expired_dropped": 2,  # x1, tm
        "purged_pending": 3,  # pp1, tp, tc
    }
    assert _rows(report, "deliveries") == every | {
        "acked": 5,  # a1, other/m1, tp/r1, tm/n1, tc/c1
        "dead_lettered_attempts": 2,
        "expired_dropped": 2,  # x1, tm/n2
        "purged_pending": 3,  # pp1, tp/r2, tc/c2 (its copy alone)
        "in_flight": 3,  # f1, tm/n3, tc/c3
    }
    totals = report["totals"]
    assert (totals["messages"], totals["deliveries"]) == (19, 24)
    assert [totals[g] for g in ("acked", "dead_lettered", "dropped", "unresolved")] == [2, 8, 5, 4]
    assert (totals["dead_letter_entries"], totals["purged_dead_letters"]) == (6, 2)
    assert report["outcomes"]["holds"] is True
    unresolved = report["unresolved"]
    assert [unresolved[s] for s in ("not_yet_due", "waiting_for_recipient")] == [1, 1]
    assert [unresolved[s] for s in ("in_flight", "stuck")] == [3, 1]  # (tc/c3 too)
    assert _refs(unresolved["stuck_sample"]) == [("o", "s1", None)]
    dlq = report["dead_letters"]
    assert dlq["by_app_reason"] == [
        {"appid": "o", "reason": r, "entries": n}
        for r, n in (("expired", 1), ("rejected", 1), ("timeout", 2), ("undeliverable", 1),
                     ("unknown", 1))
    ]  # fmt: skip
    last = {e["msgid"]: e["last_recipient"] for e in dlq["oldest"]}
    assert last == {
        "d1": "r1", "d2": "r2", "d3": None, "d4": None, "d5": None, "g1": "group:a/alice"
    }  # fmt: skip
    page = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    assert "Outcomes: how every message ended" in page and "holds" in page
    assert ">group:a/alice<" in page and ">r1<" in page
    assert "purged while pending" in page and "waiting for a recipient" in page


@needs_java
def test_pulled_deliveries_are_one_copy_a_group(spark: SparkSession, tmp_path: Path) -> None:
    """Deliveries pulled by consumer groups (recipient `group:<name>`): each group's copy
    is a delivery of its own, as a topic recipient's is, beside the message's pushes."""
    t = BASE_TS
    a, b = {"recipient": "group:a"}, {"recipient": "group:b"}
    lines = [
        # p1: group a acks attempt 1; group b nacks attempt 1 and acks attempt 2
        _line(t, "stored", "p1", "g"),
        _line(t + 10, "pushed", "p1", "g", attempt=1, detail="pulled", **a),
        _line(t + 20, "acked", "p1", "g", attempt=1, **a),
        _line(t + 11, "pushed", "p1", "g", attempt=1, detail="pulled", **b),
        _line(t + 21, "errored", "p1", "g", attempt=1, detail="nack", **b),
        _line(t + 22, "retry_scheduled", "p1", "g", attempt=1,
              detail=f"next attempt at {t + 30}", **b),
        _line(t + 31, "pushed", "p1", "g", attempt=2, detail="pulled", **b),
        _line(t + 40, "acked", "p1", "g", attempt=2, **b),
        # p2: dead for group a
        _line(t, "stored", "p2", "g"),
        _line(t + 10, "pushed", "p2", "g", attempt=1, detail="pulled", **a),
        _line(t + 20, "dead_lettered", "p2", "g", attempt=1,
              detail="after 1 attempts; last: errored", **a),
        # p3: pushed to a recipient and acked, and pulled and acked by group a
        _line(t, "stored", "p3", "g"),
        _line(t + 5, "pushed", "p3", "g", recipient="r", attempt=1),
        _line(t + 6, "acked", "p3", "g", recipient="r", attempt=1),
        _line(t + 10, "pushed", "p3", "g", attempt=1, detail="pulled", **a),
        _line(t + 50, "acked", "p3", "g", attempt=1, **a),
        # p4: stored, nobody took it yet
        _line(t + 59_000, "stored", "p4", "g"),
    ]  # fmt: skip
    (tmp_path / "delivery-b1-0.jsonl").write_text("\n".join(lines), encoding="utf-8")
    report = _audit(spark, tmp_path, tmp_path / "out", stuck_after_ms=60_000)
    assert report["totals"] == {
        "messages": 4,
        "acked": 2,
        "dead_lettered": 1,
        "dropped": 0,
        "unresolved": 1,
        "deliveries": 6,
        "dead_letter_entries": 1,
        "purged_dead_letters": 0,
        "duplicates": 0,
        "pushes": 6,
    }
    assert report["attempts"] == {"1": 3, "2": 1}
    assert report["anomalies"]["acked_more_than_once"] == 0
    assert report["anomalies"]["pushed_after_ack"] == 0
    dlq = report["dead_letters"]
    assert [(e["msgid"], e["recipient"]) for e in dlq["oldest"]] == [("p2", "group:a")]
    assert dlq["oldest"][0]["last_recipient"] == "group:a"  # its pull names no consumer
    assert [h["event"] for h in dlq["oldest"][0]["history"]] == [
        "stored", "pushed", "dead_lettered"
    ]  # fmt: skip


@needs_java
async def test_a_pulled_lease_that_runs_out_on_its_last_attempt_is_dead_in_a_real_log(
    make_broker: BrokerFactory, spark: SparkSession, tmp_path: Path
) -> None:
    """A real broker: a group pulls a message and lets its lease run out on each of its
    two attempts (RETRY_TIMES=2): the broker logs the timeouts, the retry and the dead
    letter, and the audit of its log counts it dead (not unresolved), the consumer named.
    A message whose TTL ran out before the group pulled it is dead-lettered with no
    attempt (a line the audit reads), and counted dead as expired."""
    broker = await make_broker(data_dir=tmp_path / "data", retry_times=2, retry_backoff=[0.05])
    where = f"tcp://127.0.0.1:{broker.server.port}"
    port = broker.server.port
    async with PullConsumer(where, "leases", "g", wait=1, batch=10, visibility=0.2) as group:
        await produce(port, "leases", ["old"], ttl="20")
        stored_by = now_ms()

        async def expired() -> bool:
            return now_ms() > stored_by + 20

        await eventually(expired)
        await produce(port, "leases", ["m1", "k1"])
        attempts: dict[str, list[int]] = {"m1": [], "k1": []}

        async def pulled(msgid: str, attempt: int) -> bool:
            for msg in await group.receive():
                attempts[msg.msgid].append(msg.attempt)
                if msg.msgid == "k1":
                    assert await msg.ack()
            return attempt in attempts[msgid]

        await eventually(lambda: pulled("m1", 1))
        await eventually(lambda: pulled("m1", 2))  # its first lease ran out: retried

        async def dead() -> bool:  # the next receive finds its last lease run out
            await group.receive()
            return bool(log_events(broker, "m1", "dead_lettered"))

        await eventually(dead)
    assert attempts == {"m1": [1, 2], "k1": [1]}
    broker.stopping.set()
    await broker.stop()  # flushes the delivery log
    (last,) = log_events(broker.settings.delivery_log_dir, "m1", "dead_lettered")
    assert (last["recipient"], last["attempt"]) == ("group:g", 2)
    assert last["detail"].startswith("after 2 attempts; last: timeout; receipt ")
    timeouts = log_events(broker.settings.delivery_log_dir, "m1", "timeout")
    assert [e["attempt"] for e in timeouts] == [1, 2]

    report = _audit(spark, broker.settings.delivery_log_dir, tmp_path / "out")
    assert report["input"]["bad_lines"]["total"] == 0
    totals = report["totals"]
    assert (totals["messages"], totals["acked"], totals["dead_lettered"]) == (3, 1, 2)
    assert totals["unresolved"] == 0
    assert _rows(report, "messages") == {
        "acked": 1,
        "dead_lettered_attempts": 1,
        "dead_lettered_expired": 1,
    }
    assert report["outcomes"]["holds"] is True
    entries = {e["msgid"]: e for e in report["dead_letters"]["oldest"]}
    assert (entries["m1"]["reason"], entries["m1"]["attempts"]) == ("timeout", 2)
    assert entries["m1"]["last_recipient"].startswith("group:g/")  # the consumer named
    assert entries["old"]["reason"] == "expired"


@needs_java
def test_a_group_that_has_not_received_yet_holds_its_copies(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A consumer group's making logs from when it gets the messages stored (`stored
    from <ms>`): each message stored from then on has a copy for it, waiting for it until
    it pulls, though the group has no event of it; not one stored before, nor one of a
    group deleted since, nor one stored before its last reset's start. A pending purge
    (the push queue's) leaves the groups' copies waiting."""
    t = BASE_TS

    def change(ts: int, group: str, start: int | None) -> str:
        return _group_change(ts, "g", group, start)

    def acked(ts: int, msgid: str, *groups: str) -> list[str]:
        lines = [_line(ts, "stored", msgid, "g")]
        for i, group in enumerate(groups):
            who = {"recipient": f"group:{group}", "attempt": 1}
            lines += [_line(ts + 1 + i, "pushed", msgid, "g", detail="pulled", **who),
                      _line(ts + 2 + i, "acked", msgid, "g", **who)]  # fmt: skip
        return lines

    lines = [
        change(t, "a", t + 1), change(t, "b", t + 1), change(t, "d", t + 1),
        change(t + 20, "c", t + 21), change(t + 30, "c", None),  # c: deleted
        change(t + 40, "d", t + 45),  # d: reset, from t + 45
        change(t + 55, "e", t + 56), change(t + 60, "e", None), change(t + 60, "e", t + 61),
        # p0: stored before any group, pushed and acked
        *acked(t - 5, "p0"),
        _line(t - 4, "pushed", "p0", "g", recipient="r", attempt=1),
        _line(t - 3, "acked", "p0", "g", recipient="r", attempt=1),
        *acked(t + 10, "p1", "a"),  # b and d have not received it: waiting (d's: reset)
        *acked(t + 10, "p2", "a", "b"),  # d reset past it before it received it
        *acked(t + 25, "p3", "a", "b"),  # c, deleted, never received it
        *acked(t + 41, "p4", "a", "b"),  # before d's new start
        *acked(t + 50, "p5", "a", "b", "d"),
        *acked(t + 50, "p6", "a", "b"),  # d has not received it
        *acked(t + 70, "p7", "a", "b", "d"),  # e (made again) has not received it
        # p8: a pending purge (of the push queue) leaves the group log: b, d, e wait
        *acked(t + 75, "p8", "a"),
        _line(t + 80, "purged", "p8", "g", detail="pending message purged by an operator"),
    ]  # fmt: skip
    (tmp_path / "delivery-b1-0.jsonl").write_text("\n".join(lines), encoding="utf-8")
    report = _audit(spark, tmp_path, tmp_path / "out")
    totals = report["totals"]
    assert (totals["messages"], totals["acked"], totals["unresolved"]) == (9, 5, 3)
    # p8: its push queue's copy purged (dropped outranks waiting)
    assert _rows(report, "messages") == {
        "acked": 5, "waiting_for_recipient": 3, "purged_pending": 1
    }  # fmt: skip
    # p0 1, p1 a b, p2 a b, p3 a b, p4 a b, p5 a b d, p6 a b d, p7 a b d e, p8 own a b d e
    assert _rows(report, "deliveries") == {
        "acked": 17, "waiting_for_recipient": 6, "purged_pending": 1
    }  # fmt: skip
    assert report["unresolved"]["waiting_for_recipient"] == 6
    assert report["outcomes"]["holds"] is True


@needs_java
def test_a_groups_reset_or_deletion_starts_or_ends_its_copies(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A group reset to a start before a message takes it again (waiting for the group,
    whatever its copy was before); one reset past a message, or deleted, ends its copy
    where it had not ended: a lease or a wait dropped (purged_pending), a dead letter
    dropped (dead_letter_purged); an ack stays. One group an app."""
    t = BASE_TS

    def change(ts: int, group: str, start: int | None, generation: str = "") -> str:
        return _group_change(ts, group, group, start, generation)

    def took(msgid: str, group: str, end: str | None) -> list[str]:
        """Stored at t + 10 in app `group`, pulled by `group`, then acked, dead, or left
        in flight."""
        who = {"recipient": f"group:{group}", "attempt": 1}
        lines = [_line(t + 10, "stored", msgid, group),
                 _line(t + 11, "pushed", msgid, group, detail="pulled", **who)]  # fmt: skip
        if end == "acked":
            lines.append(_line(t + 12, "acked", msgid, group, **who))
        elif end == "dead":
            lines.append(_line(t + 12, "dead_lettered", msgid, group,
                               detail="after 1 attempts; last: errored", **who))  # fmt: skip
        return lines

    lines = [
        change(t, "r", t + 1), change(t, "u", t + 1), change(t, "w", t + 1),
        *took("q1", "r", "acked"), *took("q2", "r", None), *took("q3", "r", "dead"),
        change(t + 20, "r", t + 1),  # r reset to earliest: it gets q1, q2, q3 again
        *took("v1", "u", "acked"), *took("v2", "u", None), *took("v3", "u", "dead"),
        change(t + 30, "u", t + 31),  # u reset to latest: v1-v3 are over for it
        _line(t + 40, "stored", "v4", "u"),  # u's: waiting
        *took("x1", "w", None),
        change(t + 50, "w", None),  # w deleted: x1's lease with it
        # y1: its ack logged in the ms of y's reset, of the generation before (receipts)
        change(t, "y", t + 1, "100"),
        _line(t + 10, "stored", "y1", "y"),
        _line(t + 11, "pushed", "y1", "y", recipient="group:y", attempt=1,
              detail="pulled by c; receipt 1-0.1.100"),
        _line(t + 60, "acked", "y1", "y", recipient="group:y", attempt=1,
              detail="receipt 1-0.1.100"),
        change(t + 60, "y", t + 61, "200"),
    ]  # fmt: skip
    (tmp_path / "delivery-b1-0.jsonl").write_text("\n".join(lines), encoding="utf-8")
    report = _audit(spark, tmp_path, tmp_path / "out")
    want = {
        "waiting_for_recipient": 4,  # q1, q2, q3 (r again), v4 (u)
        "acked": 2,  # v1, y1
        "purged_pending": 2,  # v2, x1
        "dead_letter_purged": 1,  # v3
    }
    assert _rows(report, "messages") == _rows(report, "deliveries") == want
    assert report["outcomes"]["holds"] is True
    assert report["dead_letters"]["oldest"] == []  # (v3's: the reset took it)


@needs_java
async def test_a_real_brokers_group_that_has_not_received_is_waited_for(
    make_broker: BrokerFactory, spark: SparkSession, tmp_path: Path
) -> None:
    """A real broker: groups a and b subscribe, a pulls and acks three messages, b has
    not received yet: the audit of the broker's log has them waiting for b. Once b is
    deleted, they are acked: b will never get them."""
    broker = await make_broker(data_dir=tmp_path / "data")
    where = f"tcp://127.0.0.1:{broker.server.port}"
    async with (
        PullConsumer(where, "subs", "a", wait=0, batch=10) as a,
        PullConsumer(where, "subs", "b", wait=0) as b,
    ):
        assert await a.receive() == [] and await b.receive() == []  # (both made)
        await produce(broker.server.port, "subs", ["m1", "m2", "m3"])
        got: list[str] = []

        async def all_acked() -> bool:
            for msg in await a.receive():
                assert await msg.ack()
                got.append(msg.msgid)
            return len(got) == 3

        await eventually(all_acked)
    logs = broker.settings.delivery_log_dir
    broker.dlog.flush()
    report = _audit(spark, logs, tmp_path / "out1")
    assert _rows(report, "messages") == {"waiting_for_recipient": 3}
    assert _rows(report, "deliveries") == {"acked": 3, "waiting_for_recipient": 3}
    assert await broker.groups.delete("subs", "b")
    broker.dlog.flush()
    report = _audit(spark, logs, tmp_path / "out2")
    assert _rows(report, "messages") == {"acked": 3}


@needs_java
def test_an_ack_logged_again_by_a_new_owner_counts_once(
    spark: SparkSession, tmp_path: Path
) -> None:
    """After a kill -9, the next owner logs again the acks of the journal's tail
    (RECOVERED_ACK): m1's line died with the old owner, m2's did not. Both are acked,
    neither twice, and the recipient is counted one ack each."""
    t = BASE_TS
    r = {"recipient": "r", "attempt": 1}
    again = {**r, "broker": "b2", "detail": RECOVERED_ACK}
    lines = [
        _line(t, "stored", "m1", "a"),
        _line(t + 10, "pushed", "m1", "a", **r),
        _line(t, "stored", "m2", "a"),
        _line(t + 10, "pushed", "m2", "a", **r),
        _line(t + 20, "acked", "m2", "a", **r),
        _line(t + 5_000, "acked", "m1", "a", **again),
        _line(t + 5_000, "acked", "m2", "a", **again),
    ]
    (tmp_path / "delivery-b1-0.jsonl").write_text("\n".join(lines), encoding="utf-8")
    report = _audit(spark, tmp_path, tmp_path / "out")
    assert (report["totals"]["acked"], report["totals"]["unresolved"]) == (2, 0)
    assert report["anomalies"]["acked_more_than_once"] == 0
    assert [(x["recipient"], x["acked"]) for x in report["by_recipient"]] == [("r", 1)]
    assert report["latency_ms"]["max"] == 5_000  # (m1's: as of the line logged again)


@needs_java
def test_nothing_acked(spark: SparkSession, tmp_path: Path) -> None:
    (tmp_path / "delivery-x-0.jsonl").write_text(
        _line(BASE_TS, "stored", "m", "a")
        + "\n"
        + _line(BASE_TS + 5, "dead_lettered", "m", "a", attempt=5),
        encoding="utf-8",
    )
    report = _audit(spark, tmp_path, tmp_path / "out")
    assert report["latency_ms"] == {"p50": None, "p95": None, "p99": None, "max": None}
    assert report["attempts"] == {}
    assert report["totals"]["dead_lettered"] == 1
    assert report["dead_letters"]["by_app_reason"] == [
        {"appid": "a", "reason": "unknown", "entries": 1}
    ]
    assert (tmp_path / "out" / "report.html").read_text(encoding="utf-8").count("<svg") >= 4


@needs_java
def test_throughput_chart_keeps_empty_buckets_as_zeros(spark: SparkSession, tmp_path: Path) -> None:
    # events at 0-1 s and 100-101 s: the 98 seconds between are zeros, not skipped
    lines = [_line(BASE_TS + ms, "stored", f"m{ms}", "a") for ms in (0, 500, 100_000, 100_900)]
    (tmp_path / "delivery-x-0.jsonl").write_text("\n".join(lines), encoding="utf-8")
    out = tmp_path / "out"
    _audit(spark, tmp_path, out)
    assert fill_buckets([{"t": 0, "n": 1}, {"t": 3000, "n": 2}], 1000, ["n"]) == [
        {"t": 0, "n": 1},
        {"t": 1000, "n": 0},
        {"t": 2000, "n": 0},
        {"t": 3000, "n": 2},
    ]
    page = (out / "report.html").read_text(encoding="utf-8")
    stored_line = next(
        part for part in page.split("<polyline")[1:] if COLORS["stored"] in part.split(">")[0]
    )
    points = stored_line.split('points="')[1].split('"')[0].split()
    assert len(points) == 101  # one a second from 0 to 100 s, the empty ones at zero
    assert len({p.split(",")[1] for p in points[2:100]}) == 1


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


def _unprivileged(code: str) -> Any:
    """Run ``code`` in a Python that has dropped root first (root reads any directory),
    with resolve_log_paths and check_files imported; returns the process."""
    drop = "import os; os.setgid(65534); os.setuid(65534)\n" if os.geteuid() == 0 else ""
    prelude = "import json\nfrom skmq.audit_job.inputs import check_files, resolve_log_paths\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + drop + code],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@needs_java
def test_directories_followed_and_odd_files_named(spark: SparkSession) -> None:
    """A link to a directory is followed (a link back up is no loop); a FIFO is named
    before anything opens it (it would block forever), as is a directory that cannot
    be listed; each file once, however many names reach it."""
    base = Path(tempfile.mkdtemp(prefix="skmq-audit-dirs-"))  # not under pytest's 0700
    try:
        base.chmod(0o755)
        logs = base / "logs"
        _log_file(logs / "delivery-a-0.jsonl")
        _log_file(base / "elsewhere" / "delivery-b-0.jsonl")
        (logs / "rotated").symlink_to(base / "elsewhere")
        (logs / "rotated-again").symlink_to(base / "elsewhere")
        (logs / "up").symlink_to(logs)
        found = resolve_log_paths([str(logs), str(logs / "rotated" / "delivery-b-0.jsonl")])
        assert [Path(p).relative_to(logs).as_posix() for p in found] == [
            "delivery-a-0.jsonl",
            "rotated/delivery-b-0.jsonl",
        ]
        fifo = logs / "delivery-c-0.jsonl"
        os.mkfifo(fifo)
        with pytest.raises(AuditInputError) as failed:  # at once: never opened
            _audit(spark, logs, base / "out")
        assert f"{fifo}: cannot be read: a FIFO, not a regular file" in str(failed.value)
        fifo.unlink()
        locked = logs / "locked"
        _log_file(locked / "delivery-d-0.jsonl")
        locked.chmod(0)
        done = _unprivileged(
            f"paths = resolve_log_paths({str(logs)!r})\n"
            "print(json.dumps([b.line() for b in check_files(paths)]))"
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout) == [
            f"{locked}: directory cannot be read (Permission denied)"
        ]
        locked.chmod(0o755)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@needs_java
def test_lines_that_are_not_one_json_object_are_bad(spark: SparkSession, tmp_path: Path) -> None:
    """Spark's JSON reader took ``[{...},{...}]`` for two events, ``[]`` for none, and
    read the first object of ``{...}{...}`` or ``{...} xyz``; each is one bad line.  The
    reasons follow docs/AUDIT.md's table (a ts too large for a long is out of range)."""
    t = BASE_TS

    def good(msgid: str, **more: Any) -> str:
        record = json.loads(_line(t, "stored", msgid, "a")) | more
        return json.dumps(record)

    bad = {
        "not_json": [
            f"[{good('arr1')}, {good('arr2')}]",
            "[]",
            good("two1") + good("two2"),
            good("two3") + ", " + good("two4"),
            good("tail") + " xyz",
            good("tail2")[:-1] + ', "x": 1}"}"}',
            good("quoted").replace('"', "'"),
            good("nan").replace(f'"ts": {t}', '"ts": NaN'),
        ],
        "ts_out_of_range": [good("huge", ts=10**30), good("huge2", ts=-(10**40))],
        # (2100: a broker's clock gone wrong; it would make as_of, the log's end)
        "ts_in_the_future": [good("future", ts=4_102_444_800_000)],
        "ts_not_an_integer": [good("exp", ts=1.76e12), good("text", ts=str(t))],
        "field_of_wrong_type": [good("obj", appid={"a": 1}), good("list", detail=[1, 2])],
        "attempt_not_an_integer": [good("att", attempt=10**20)],
    }
    valid = [
        good("nested", extra={"k": [1, {"j": "}"}]}),
        good("braces", detail='a}b{c]["} \\" {'),
        "  " + good("spaced") + " \t",
        good("number").replace('"msgid": "number"', '"msgid": 12'),
    ]
    text = "\n".join([*valid, *(line for lines in bad.values() for line in lines)]) + "\n"
    data = text.encode() + good("bytes").replace("bytes", "\udcff").encode(
        "utf-8", "surrogateescape"
    )
    (tmp_path / "delivery-a-0.jsonl").write_bytes(data + b"\n")
    report = _audit(spark, tmp_path, tmp_path / "out")
    bad["not_json"].append("invalid UTF-8")
    assert report["input"]["bad_lines"]["by_reason"] == {k: len(v) for k, v in sorted(bad.items())}
    assert report["input"]["events"] == len(valid)
    assert report["totals"]["messages"] == len(valid)
    assert report["unresolved"]["as_of"] == t


def test_simple_files_are_one_object_a_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only files whose every line is one object without a nested value go to Spark's
    JSON reader: anything it would read otherwise than ``from_json`` is not simple."""
    one, two = _line(BASE_TS, "stored", "m", "a"), _line(BASE_TS + 1, "acked", "m", "a")
    simple = [f"{one}\n{two}\n", f"{one}\n{two}", "", "{}", '{"ts": 1, "detail": "é"}\n']
    assert all(_simple(text.encode()) for text in simple)
    not_simple = [
        f"{one}\n\n{two}\n",  # a blank line
        f"{one}\n{two}\n\n",  # a blank last line
        f"\n{one}\n",
        f"{one}\r\n{two}\r\n",
        f"\ufeff{one}\n",  # a byte order mark
        f" {one}\n",
        f"{one} \n",
        f"{one}{two}\n",  # two objects on a line
        f"[{one}, {two}]\n",
        one[:-1] + ', "x": {"y": 1}}\n',  # a nested object
        '{"detail": "a}b"}\n',
        '{"detail": "[x"}\n',
        f"{one}\n" + one[:-1],  # a torn last line
        "not json\n",
    ]
    assert not any(_simple(text.encode()) for text in not_simple)
    assert not _simple(b'{"detail": "\xff"}\n')  # not UTF-8
    assert not _simple(b'{"ts": 1, "x": "\x00"}\n')
    # Files are read a block of whole lines at a time: a blank line or a nested value
    # across two blocks is seen.
    monkeypatch.setattr(inputs_module, "_SCAN_BYTES", 7)
    for i, text in enumerate([*simple, *not_simple]):
        (tmp_path / f"delivery-a-{i}.jsonl").write_text(text, encoding="utf-8")
        assert all_simple([str(tmp_path / f"delivery-a-{i}.jsonl")]) == (i < len(simple))
    (tmp_path / "delivery-b.jsonl.gz").write_bytes(gzip.compress(one.encode()))
    assert not all_simple([str(tmp_path / "delivery-b.jsonl.gz")])


@needs_java
def test_the_json_reader_reads_as_the_text_path(spark: SparkSession, tmp_path: Path) -> None:
    """Files whose lines are all simple are read by Arrow's JSON reader or Spark's,
    others as text with from_json: the same report each way, the bad lines' samples
    included (a valid JSON line that is bad has no text in the JSON readers' rows: its
    file is read again as text for them). One file that is not simple: all read as
    text."""
    builder = LogBuilder(SEED)
    builder.generate(300)
    flat = {
        reason: [line for line in lines if _simple(line.encode())]
        for reason, lines in BAD_LINES.items()
    }
    assert sum(map(len, flat.values())) > 20
    options = Options(stuck_after_ms=STUCK_AFTER_MS)

    def write(logs: Path, bad: list[str]) -> list[str]:
        buckets: list[list[str]] = [[] for _ in range(5)]
        for i, event in enumerate(builder.events):
            buckets[i % 5].append(json.dumps(event))
        for i, line in enumerate(bad):
            buckets[i % 3].append(line)  # files 0-2; files 3 and 4 have no bad line
        logs.mkdir()
        for i, lines in enumerate(buckets):
            text = "\n".join(lines) + "\n"
            (logs / f"delivery-b1-{i}.jsonl").write_text(text, encoding="utf-8")
        (logs / "delivery-b1-5.jsonl").touch()  # a broker's new file
        paths = resolve_log_paths(str(logs))
        assert all_simple(paths)
        return paths

    logs = tmp_path / "logs"
    paths = write(logs, [line for lines in flat.values() for line in lines])
    fast = compute_report(spark, paths, options=options, simple=True)
    text = compute_report(spark, paths, options=options, simple=False)
    assert fast.report == text.report
    assert fast.extras == text.extras
    bad_lines = fast.report["input"]["bad_lines"]
    assert bad_lines["by_reason"] == {k: len(v) for k, v in sorted(flat.items()) if v}
    assert len({s["file"] for s in bad_lines["samples"]}) == 3
    assert all(s["line"] for s in bad_lines["samples"])
    assert fast.report["input"]["events"] == len(builder.events)
    assert arrow_lines(paths) is None  # lines Arrow refuses: Spark reads them

    # The bad lines Arrow reads (a missing field, an unknown event, a ts out of range...).
    taken: dict[str, list[str]] = {}
    for i, (reason, line) in enumerate((r, ln) for r, lines in flat.items() for ln in lines):
        alone = tmp_path / f"alone-{i}.jsonl"
        alone.write_text(line + "\n", encoding="utf-8")
        if arrow_lines([str(alone)]) is not None:
            taken.setdefault(reason, []).append(line)
    assert len(taken) > 5
    paths = write(tmp_path / "arrow", [line for lines in taken.values() for line in lines])
    parsed = arrow_lines(paths)
    assert parsed is not None
    arrow = compute_report(spark, paths, options=options, parsed=parsed)
    text = compute_report(spark, paths, options=options, simple=False)
    assert arrow.report == text.report
    assert arrow.extras == text.extras
    bad_lines = arrow.report["input"]["bad_lines"]
    assert bad_lines["by_reason"] == {k: len(v) for k, v in sorted(taken.items())}
    assert all(s["line"] for s in bad_lines["samples"])
    (logs / "delivery-b1-9.jsonl").write_text("[]\n", encoding="utf-8")
    assert not all_simple(resolve_log_paths(str(logs)))


@needs_java
def test_the_report_is_the_same_whatever_order_the_lines_come_in(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The same lines in one file, the other way round, and in three files: the same
    report, the dead-letter histories' events of one millisecond included (a broker
    logs several a millisecond), as the last dead letter's attempts and failure of a
    delivery that has two in one millisecond."""
    builder = LogBuilder(SEED)
    builder.generate(300)
    lines = [json.dumps(event) for event in builder.events]
    t = BASE_TS
    for attempt, failure in ((40, "timeout"), (41, "rejected")):
        dead = {
            "recipient": "r",
            "attempt": attempt,
            "detail": f"after {attempt} attempts; last: {failure}",
        }
        lines.append(_line(t, "dead_lettered", "twice", "a", **dead))
    lines.insert(0, _line(t - 1, "stored", "twice", "a"))
    reports = []
    for name, ordered, files in (("a", lines, 1), ("b", lines[::-1], 1), ("c", lines, 3)):
        logs = tmp_path / name
        logs.mkdir()
        for i in range(files):
            text = "\n".join(ordered[i::files]) + "\n"
            (logs / f"delivery-{name}-{i}.jsonl").write_text(text, encoding="utf-8")
        paths = resolve_log_paths(str(logs))
        report = compute_report(spark, paths, options=Options(stuck_after_ms=STUCK_AFTER_MS))
        reports.append(report.report | {"input": report.report["input"] | {"files": None}})
    listed = [*reports[0]["dead_letters"]["oldest"], *reports[0]["dead_letters"]["most_tried"]]
    same_ms = [
        (a, b)
        for entry in listed
        for a, b in itertools.pairwise(entry["history"])
        if a["ts"] == b["ts"]
    ]
    assert same_ms  # the histories have events of one millisecond to order
    assert reports[0] == reports[1] == reports[2]
    twice = [e for e in reports[0]["dead_letters"]["most_tried"] if e["msgid"] == "twice"]
    assert twice and twice[0]["reason"] == "rejected"  # of the later attempt


@needs_java
def test_the_json_reader_reads_each_simple_line_as_from_json(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Line by line, the JSON reader's rows are the text path's (a bad line's text
    aside, which the JSON reader keeps only for a line it could not read)."""
    event = '"event": "acked", "msgid": "m", "appid": "a", "kind": "queue", "attempt": 1'
    lines = [
        '{"ts": 1760000000000, ' + event + "}",
        '{"TS": 1760000000000, ' + event + "}",
        '{"ts": true, ' + event + "}",
        '{"ts": 1e12, ' + event + "}",
        '{"ts": 1760000000000.0, ' + event + "}",
        '{"ts": 01760000000000, ' + event + "}",
        '{"ts": 9999999999999999999999, ' + event + "}",
        '{"ts": NaN, ' + event + "}",
        "{'ts': 1760000000000}",
        '{"ts": 1760000000000, ' + event + ', "ts": 1760000000001}',
        '{"ts": 1760000000000, ' + event + ",}",
        '{"ts": 1760000000000, ' + event + ', "attempt": 2.0}',
        '{"ts": 1760000000000, ' + event + ', "attempt": 99999999999999999999}',
        *(
            '{"ts": 1760000000000, ' + event + f', "msgid": {value}, "detail": {value}}}'
            for value in ("12.50", "1E2", "-0", "1.0e+3", "false", "null", '"\\u00e9\\"x"')
        ),
        '{"ts": 1760000000000, ' + event + ', "detail": "é 漢字 😀\\ud800"}',
        '{"ts": 1760000000000, ' + event + ', "x": 1.5, "y": true}',
        "{}",
    ]
    path = tmp_path / "delivery-a-0.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert all_simple([str(path)])
    fast = read_events(spark, [str(path)], simple=True).collect()
    text = read_events(spark, [str(path)], simple=False).collect()
    assert len(fast) == len(text) == len(lines)
    for a, b in zip(fast, text, strict=True):
        untold = a["bad_text"] is None and a["reason"] is not None and a["reason"] != "not_json"
        assert a.asDict() == b.asDict() | ({"bad_text": None} if untold else {})
    # Arrow refuses a file with any line it would read otherwise (then Spark reads it):
    # each line alone, it reads those it takes as Spark does.
    taken = 0
    for i, (line, row) in enumerate(zip(lines, text, strict=True)):
        alone = tmp_path / f"delivery-b-{i}.jsonl"
        alone.write_text(line + "\n", encoding="utf-8")
        parsed = arrow_lines([str(alone)])
        if parsed is None:
            continue
        taken += 1
        (arrow,) = read_arrow_lines(spark, parsed, [str(alone)]).collect()
        expected = row.asDict() | {"bad_file": row["bad_file"] and file_uri(str(alone))}
        assert arrow.asDict() == expected | ({"bad_text": None} if row["reason"] else {})
    assert taken == 4  # the valid line, "TS", an unknown field and {}
    assert arrow_lines([str(path)]) is None


@needs_java
def test_arrow_lines_are_read_by_tasks_not_held_in_the_plan(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A small log's Arrow batches are scanned by tasks. As a local relation (Spark's
    choice under 48 MB of Arrow) every query's filters and projections ran in the
    optimizer, over its rows, interpreted, on one thread: 300,000 events took 80 s, not
    6."""
    event = {"ts": 1_760_000_000_000, "event": "stored", "msgid": "m1", "appid": "a"}
    event |= {"kind": "queue", "recipient": None, "attempt": None, "broker": "b", "detail": None}
    path = tmp_path / "delivery-b-0.jsonl"
    path.write_text(json.dumps(event) + "\n", encoding="utf-8")
    parsed = arrow_lines([str(path)])
    assert parsed is not None
    read_arrow_lines(spark, parsed, [str(path)]).where("reason IS NULL").explain()
    plan = capsys.readouterr().out
    assert "Scan ExistingRDD" in plan and "LocalTableScan" not in plan, plan


@needs_java
def test_the_same_lines_twice_count_once(spark: SparkSession, tmp_path: Path) -> None:
    """A rotated file both as .jsonl and .jsonl.gz (a crash of the compression between
    its rename and its unlink), and a file named twice (a link): pushes, acks and the
    time in the dead-letter queue as if each line were read once."""
    t = BASE_TS
    dead = {"recipient": "r", "attempt": 5, "detail": "after 5 attempts; last: timeout"}
    lines = [
        _line(t, "stored", "m", "a"),
        _line(t + 10, "pushed", "m", "a", recipient="r", attempt=1),
        _line(t + 100, "dead_lettered", "m", "a", **dead),
        _line(t + 60_100, "replayed", "m", "a", recipient="r"),
        _line(t + 60_110, "pushed", "m", "a", recipient="r", attempt=1),
        _line(t + 60_140, "acked", "m", "a", recipient="r", attempt=1),
    ]
    text = "\n".join(lines) + "\n"
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "delivery-b1-000000.jsonl").write_text(text, encoding="utf-8")
    (logs / "delivery-b1-000000.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "link.jsonl").symlink_to(logs / "delivery-b1-000000.jsonl")
    report = run_audit(
        [str(logs), str(tmp_path / "link.jsonl")], str(tmp_path / "out"), spark=spark,
        progress=False,
    )  # fmt: skip
    assert report["input"]["files"] == 2  # the link is the .jsonl
    assert (report["input"]["events"], report["input"]["repeated_lines"]) == (6, 6)
    assert report["totals"]["pushes"] == 2 and report["totals"]["acked"] == 1
    assert report["anomalies"]["acked_more_than_once"] == 0
    assert report["latency_ms"]["max"] == 140  # 60,140 ms less 60,000 in the queue
    assert report["attempts"] == {"6": 1}


def test_lines_arrow_reads_twice_count_once(spark: SparkSession, tmp_path: Path) -> None:
    """A log file and its copy, both plain: Arrow reads them, finds the repeated lines,
    and Spark counts each once; a file alone has no repeats, and no check runs."""
    t = BASE_TS
    lines = [
        _line(t, "stored", "m", "a"),
        _line(t, "pushed", "m", "a", recipient="r", attempt=1),
        _line(t, "pushed", "m", "a", recipient="q", attempt=1),
        _line(t + 40, "acked", "m", "a", recipient="r", attempt=1),
    ]
    one, copy = tmp_path / "delivery-b1-000000.jsonl", tmp_path / "copy.jsonl"
    one.write_text("\n".join(lines) + "\n", encoding="utf-8")
    copy.write_bytes(one.read_bytes())
    alone = arrow_lines([str(one)])
    assert alone is not None and not alone.repeats
    both = arrow_lines([str(one), str(copy)])
    assert both is not None and both.repeats
    report = compute_report(spark, [str(one), str(copy)], parsed=both).report
    assert (report["input"]["events"], report["input"]["repeated_lines"]) == (4, 4)
    assert report["totals"]["pushes"] == 2 and report["totals"]["acked"] == 1


# ----------------------------------------------------------------------- bad input


def _log_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        _line(BASE_TS, "stored", "m", "a") + "\n" + _line(BASE_TS + 3, "acked", "m", "a"),
        encoding="utf-8",
    )
    return path


def _bad_files(base: Path) -> tuple[Path, Path]:
    """A truncated .gz and gzip data named .jsonl, beside a good file."""
    _log_file(base / "good" / "delivery-a-0.jsonl")
    data = gzip.compress((_line(BASE_TS, "stored", "z", "a") + "\n").encode() * 500)
    truncated = base / "delivery-b-0.jsonl.gz"
    truncated.write_bytes(data[: len(data) // 2])
    misnamed = base / "delivery-c-0.jsonl"
    misnamed.write_bytes(data)
    return truncated, misnamed


@needs_java
def test_unreadable_files_named_in_one_line(spark: SparkSession, tmp_path: Path) -> None:
    truncated, misnamed = _bad_files(tmp_path)
    with pytest.raises(AuditInputError) as failed:
        _audit(spark, tmp_path, tmp_path / "out")
    message = str(failed.value)
    assert "\n" not in message and "cannot read 2 file(s)" in message
    assert f"{truncated}: not a complete gzip file" in message
    assert f"{misnamed}: gzip data in a file not named .gz" in message
    assert not (tmp_path / "out").exists()
    report = run_audit(
        str(tmp_path), str(tmp_path / "out"), spark=spark, skip_bad_files=True, progress=False
    )
    skipped = {f["path"] for f in report["input"]["skipped_files"]}
    assert skipped == {str(truncated), str(misnamed)}
    assert report["totals"]["messages"] == 1 and report["totals"]["acked"] == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_permission(tmp_path: Path) -> None:
    path = _log_file(tmp_path / "delivery-a-0.jsonl")
    path.chmod(0)
    assert [b.line() for b in check_files([str(path)])] == [
        f"{path}: cannot be read (Permission denied)"
    ]


def test_compressed_data_told_by_its_first_bytes(tmp_path: Path) -> None:
    """zstd and xz data under a .jsonl name, and a .gz with zeros after its end (which
    Python's gzip module reads and Hadoop's does not) are named before Spark starts."""
    zstd, xz = tmp_path / "delivery-a-0.jsonl", tmp_path / "delivery-b-0.jsonl"
    zstd.write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(64))
    xz.write_bytes(b"\xfd7zXZ\x00" + os.urandom(64))
    padded = tmp_path / "delivery-c-0.jsonl.gz"
    padded.write_bytes(gzip.compress(b"{}\n") + bytes(10))
    two = tmp_path / "delivery-d-0.jsonl.gz"  # two members, as `cat a.gz b.gz`: fine
    two.write_bytes(gzip.compress(b"{}\n") + gzip.compress(b"{}\n"))
    assert [b.line() for b in check_files([str(p) for p in (zstd, xz, padded, two)])] == [
        f"{zstd}: zstd data in a file not named .zst (rename it to .jsonl.zst)",
        f"{xz}: xz data, which Spark cannot read (decompress it)",
        f"{padded}: not a complete gzip file (data after its end)",
    ]


@needs_java
def test_a_file_spark_fails_on_is_named_and_skipped(spark: SparkSession, tmp_path: Path) -> None:
    """A file the checks let pass and Spark cannot read (a cut .zst): one line naming it
    (status 2); with skip_bad_files it is listed in skipped_files, the others audited."""
    good = _log_file(tmp_path / "delivery-a-0.jsonl")
    cut = tmp_path / "delivery-b-0.jsonl.zst"
    cut.write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(200))
    logs = [str(good), str(cut)]
    with pytest.raises(AuditInputError) as failed:
        run_audit(logs, str(tmp_path / "out"), spark=spark, progress=False)
    message = str(failed.value)
    assert (
        "\n" not in message and f"cannot read 1 file(s): {cut}: Spark cannot read it (" in message
    )
    report = run_audit(
        logs, str(tmp_path / "out"), spark=spark, skip_bad_files=True, progress=False
    )
    assert [f["path"] for f in report["input"]["skipped_files"]] == [str(cut)]
    assert report["totals"]["acked"] == 1 and report["input"]["files"] == 1


@needs_java
def test_a_log_file_compressed_or_gone_while_the_audit_runs(
    spark: SparkSession, tmp_path: Path
) -> None:
    """On a live log directory a file listed for the audit may be compressed by its broker
    (`.jsonl` to `.jsonl.gz`) or removed before Spark reads it: the compressed one is
    read instead; a gone one stops the audit with one line, or is skipped."""
    listed = _log_file(tmp_path / "delivery-a-000001.jsonl")
    with listed.open("rb") as src, gzip.open(f"{listed}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    listed.unlink()
    gone = tmp_path / "delivery-b-000001.jsonl"
    prog = Progress(STAGES, None)
    report = _compute(spark, [str(listed)], [], False, None, prog)
    assert report.report["totals"]["acked"] == 1
    with pytest.raises(AuditInputError, match=f"cannot read 1 file.s.: {gone}: gone while"):
        _compute(spark, [str(listed), str(gone)], [], False, None, prog)
    skipped: list[BadFile] = []
    report = _compute(spark, [str(listed), str(gone)], skipped, True, None, prog)
    assert report.report["totals"]["acked"] == 1
    assert [b.path for b in skipped] == [str(gone)]


def test_reports_are_replaced_whole(tmp_path: Path) -> None:
    """Writing the reports fails (a full disk; here the file size limit): the old ones
    stay as they were, no temporary file is left."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text('{"old": true}\n')
    code = (
        "import resource, signal, sys\n"
        "from skmq.audit_job.outputs import write_files\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (5000, 5000))\n"
        "files = {'report.json': 'x' * 4000, 'report.html': 'y' * 9000}\n"
        f"write_files(files, {str(out)!r}, None)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0 and "File too large" in done.stderr
    assert [p.name for p in out.iterdir()] == ["report.json"]
    assert (out / "report.json").read_text() == '{"old": true}\n'


def test_bad_numbers_are_bad_arguments(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for value in ("inf", "nan", "0", "-5", "1e300"):
        args = parser.parse_args(["--logs", "x", "--out", "y", "--stuck-after", value])
        with pytest.raises(ValueError, match="--stuck-after"):
            check_arguments(args)
    check_arguments(parser.parse_args(["--logs", "x", "--out", "y", "--stuck-after", "0.5"]))


@needs_java
def test_empty_and_missing_input(spark: SparkSession, tmp_path: Path) -> None:
    (tmp_path / "delivery-a-0.jsonl").write_text("\n\n", encoding="utf-8")
    with pytest.raises(AuditInputError, match="no valid events"):
        _audit(spark, tmp_path, tmp_path / "out")
    with pytest.raises(AuditInputError, match="no such file or directory"):
        _audit(spark, tmp_path / "missing", tmp_path / "out")
    (tmp_path / "delivery-a-0.jsonl").write_text("garbage\n", encoding="utf-8")
    with pytest.raises(AuditInputError, match=r"no valid events .*1 bad line"):
        _audit(spark, tmp_path, tmp_path / "out")


@needs_java
def test_strict_makes_a_bad_line_an_error(spark: SparkSession, tmp_path: Path) -> None:
    log = _log_file(tmp_path / "delivery-a-0.jsonl")
    log.write_text(log.read_text() + '\n{"ts": "1760000000000", "event": "acked"}\n')
    assert _audit(spark, tmp_path, tmp_path / "out")["input"]["bad_lines"]["total"] == 1
    with pytest.raises(BadLinesError, match=r"1 bad line\(s\) \(ts_not_an_integer: 1\)"):
        _audit(spark, tmp_path, tmp_path / "out2", strict=True)


# Names Spark reads as they are (not "[", "{", "\\": glob characters to it; not ":",
# which its checksum file's name cannot take): quoted, kept and %-quoted UTF-8.
AWKWARD_NAMES = (
    "a b%41%zz#frag?q;c,=+&$@!~*'().jsonl",
    'quote"<>|^`\t\n\x7f.jsonl',
    "é日本語😀-e\u0301\u200d\ufeff.jsonl",
    "nbsp\u00a0emsp\u2003ls\u2028ctl\u0085.jsonl",
)


@needs_java
def test_file_uri_is_sparks_input_file_name(spark: SparkSession, tmp_path: Path) -> None:
    """--follow names a file as a batch audit's input_file_name() does, computed in
    Python: a bad line's file is the same in both reports."""
    directory = tmp_path / "dir é %25 #x"
    directory.mkdir()
    paths = [str(directory / name) for name in AWKWARD_NAMES]
    for path in paths:
        Path(path).write_text('{"x": 1}\n', encoding="utf-8")
    names = spark.read.text(paths).select(F.input_file_name().alias("file")).collect()
    assert sorted(row.file for row in names) == sorted(file_uri(path) for path in paths)
    assert file_uri("/a b/é%#\u00a0") == "file:///a%20b/é%25%23%C2%A0"


@needs_java
def test_output_to_a_uri(spark: SparkSession, tmp_path: Path) -> None:
    _log_file(tmp_path / "logs" / "delivery-a-0.jsonl")
    target = tmp_path / "written-by-hadoop"
    run_audit(str(tmp_path / "logs"), f"file://{target}", spark=spark, progress=False)
    assert json.loads((target / "report.json").read_text())["totals"]["acked"] == 1
    assert sorted(p.name for p in target.iterdir() if not p.name.startswith(".")) == [
        "by_app.csv",
        "by_recipient.csv",
        "report.html",
        "report.json",
    ]


def test_error_line_names_the_file_without_the_trace() -> None:
    failure = RuntimeError(
        "An error occurred while calling o123.collectToPython.\n"
        ": org.apache.spark.SparkException: Job aborted due to stage failure: "
        "java.io.EOFException: Unexpected end of input stream\n"
        "\tat org.apache.hadoop.io.compress.DecompressorStream.decompress(...)\n"
        "Caused by: reading file hdfs://nn:8020/logs/delivery-b-3.jsonl.gz\n"
    )
    line = error_line(failure)
    assert line == (
        "SparkException: Job aborted due to stage failure: java.io.EOFException: Unexpected "
        "end of input stream (file hdfs://nn:8020/logs/delivery-b-3.jsonl.gz)"
    )


def test_a_jvm_gone_is_told_as_such() -> None:
    """A JVM that died (its heap, the OOM killer) leaves py4j nothing to connect to: the
    line says so, not "[Errno 111] Connection refused"."""
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError as exc:
            raise RuntimeError("calling o42.collectToPython") from exc
    except RuntimeError as failure:
        assert error_line(failure) == JVM_GONE
    try:  # as a JVM out of heap went: a call fails, then the next finds nobody
        try:
            raise Py4JNetworkError("Error while sending or receiving")
        except Py4JNetworkError:
            raise Py4JError("SparkSession does not exist in the JVM") from None
    except Py4JError as failure:
        assert error_line(failure) == JVM_GONE
    assert error_line(RuntimeError("Job aborted")) == "Job aborted"


def test_spark_settings_and_driver_address() -> None:
    assert parse_conf(["spark.a=1", "spark.b=x=y"]) == {"spark.a": "1", "spark.b": "x=y"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_conf(["spark.a"])
    # the driver advertises the address on the route to the master, never 127.0.0.1
    # unless the master is there
    assert driver_address("spark://127.0.0.1:7077") == "127.0.0.1"
    assert driver_address("k8s://https://127.0.0.1:6443") == "127.0.0.1"
    assert driver_address("yarn") is None
    assert local_cores("local[3]") == 3 and local_cores("spark://h:7077") is None


def test_class_archive_of_the_driver_jvm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The JVM maps the archive of its Spark and Java once there is one (an archive of
    another Spark or Java has another name); SKMQ_AUDIT_CDS=off: none."""
    monkeypatch.setenv("SKMQ_AUDIT_CDS_DIR", str(tmp_path))
    archive = cds_archive()
    assert archive is not None and os.path.dirname(archive) == str(tmp_path)
    assert re.fullmatch(r"spark-[0-9a-f]{16}\.jsa", os.path.basename(archive))
    Path(archive).write_bytes(b"archive")
    assert _cds_options(archive)[0] == f"-XX:SharedArchiveFile={archive}"
    monkeypatch.setenv(CDS_ENV, "off")
    assert cds_archive() is None and _cds_options(None) == []


# Two sessions in one process, as the audit builds them for a small local input.
_TWO_SESSIONS = """
from skmq.audit_job.session import _pyspark_jvm, build_spark
assert _pyspark_jvm() is None
first = build_spark("local[1]", input_size=1)
jvm = _pyspark_jvm()
assert jvm is not None and "-XX:TieredStopAtLevel=1" in jvm.cmdline()
print(*(o for o in jvm.cmdline() if o.startswith(("-XX:SharedArchive", "-XX:ArchiveClasses"))))
first.stop()
again = build_spark("local[1]", input_size=1)  # on the same JVM: its options are kept
assert _pyspark_jvm().pid == jvm.pid
assert "TieredStopAtLevel" not in again.conf.get("spark.driver.extraJavaOptions")
print(*(m.path for m in jvm.memory_maps() if m.path.endswith(".jsa")))
"""


@needs_java
@pytest.mark.timeout(600)
def test_the_first_jvm_writes_the_class_archive_the_next_maps(tmp_path: Path) -> None:
    """The first audit's JVM writes the archive as the audit exits (ended by it, waited
    for, the archive moved into place whole); the next audit's JVM maps it.  A second
    session in a process whose JVM runs already gets no options of a JVM start."""
    env = {**os.environ, "SKMQ_AUDIT_CDS_DIR": str(tmp_path / "skmq")}
    runs = [
        subprocess.run(
            [sys.executable, "-c", _TWO_SESSIONS],
            env=env,
            capture_output=True,
            text=True,
            timeout=280,
            check=False,
        )
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    (archive,) = (tmp_path / "skmq").iterdir()  # no partial archive left
    assert re.fullmatch(r"spark-[0-9a-f]{16}\.jsa", archive.name)
    first, second = (run.stdout.split("\n") for run in runs)
    assert first[0].startswith(f"-XX:ArchiveClassesAtExit={archive}.")
    assert str(archive) not in first[1].split()
    assert second[0] == f"-XX:SharedArchiveFile={archive}" and str(archive) in second[1].split()


def test_input_bytes_count_compressed_files_as_their_text(tmp_path: Path) -> None:
    """The size that decides a small audit (quick compiler, uncompressed cache)."""
    (tmp_path / "a.jsonl").write_bytes(b"x" * 100)
    (tmp_path / "b.jsonl.gz").write_bytes(b"x" * 10)
    files = [str(tmp_path / "a.jsonl"), f"file://{tmp_path / 'b.jsonl.gz'}"]
    assert input_bytes(files) == 100 + 10 * 8
    assert input_bytes([*files, "s3a://bucket/logs/c.jsonl"]) is None


def test_events_enum_names_every_event_the_broker_writes() -> None:
    """The broker writes events as `Event` members (DeliveryLog.event takes an Event, so
    mypy checks every call): no bare string is left, and each member it names exists."""
    used, bare = set(), set()
    for path in (REPO / "skmq").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        used |= set(re.findall(r"\bEvent\.([A-Z_]+)\b", text))
        bare |= set(re.findall(r"\.event\(\s*\"([a-z_]+)\"", text))
    assert used, "no event found in the broker's sources"
    assert bare == set()
    assert used <= {e.name for e in Event}
    spec = set(re.findall(r"`([a-z_]+)`", (REPO / "docs" / "AUDIT.md").read_text()))
    assert {e.value for e in Event} <= spec


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


def _job_args(logs: Path, out: Path) -> list[str]:
    return ["--logs", str(logs), "--out", str(out), "--stuck-after", str(STUCK_AFTER_MS / 1000)]


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> Any:
    return subprocess.run(
        args, capture_output=True, text=True, timeout=600, cwd=cwd, env=env, check=False
    )


@needs_java
def test_cli_end_to_end(audited: Audited, tmp_path: Path) -> None:
    truth, _, logs, in_process = audited
    out = tmp_path / "out"
    done = _run(
        [
            *_skmq_command(),
            "audit",
            *_job_args(logs, out),
            "--driver-memory",
            "700m",
            "--conf",
            "spark.sql.shuffle.partitions=3",
        ],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[1/7] reading logs" in done.stderr and "[7/7] writing reports" in done.stderr
    # the settings reached the JVM (read back from it)
    assert "spark.driver.memory=700m, spark.sql.shuffle.partitions=3" in done.stderr
    assert f"{truth.totals['messages']:,} messages" in done.stdout
    assert "bad lines skipped: 37" in done.stdout
    # the same job in another process and JVM (local[*]) gives the same bytes
    for name in ("report.json", "by_app.csv", "by_recipient.csv"):
        assert (out / name).read_bytes() == (in_process / name).read_bytes(), name
    assert (out / "report.html").exists()


@needs_java
def test_cli_failures_are_one_line(tmp_path: Path) -> None:
    truncated, _ = _bad_files(tmp_path)
    done = _run([*_skmq_command(), "audit", "--logs", str(tmp_path), "--out", "o"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and str(truncated) in done.stderr
    assert "Traceback" not in done.stderr
    args = [*_skmq_command(), "audit", "--logs", str(tmp_path / "good"), "--out", "o"]
    done = _run([*args, "--stuck-after", "inf"], tmp_path)
    assert (done.returncode, done.stderr.count("\n")) == (2, 1) and "--stuck-after" in done.stderr
    # --out a file: told at once, before Spark starts (no progress line of Spark's)
    (tmp_path / "a-file").write_text("")
    done = _run([*args[:-1], str(tmp_path / "a-file")], tmp_path)
    assert (done.returncode, done.stderr) == (
        2,
        f"skmq audit: --out {tmp_path / 'a-file'}: not a directory\n",
    )
    # a storage Spark cannot reach: one line, exit 1; the trace only with --debug
    args = [*_skmq_command(), "audit", "--logs", "s3a://no-such-bucket/logs", "--out", "o"]
    done = _run([*args, "--quiet"], tmp_path)
    assert done.returncode == 1, done.stderr[-2000:]
    lines = [x for x in done.stderr.splitlines() if x.startswith("skmq audit:")]
    assert len(lines) == 1 and "s3a" in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "\tat " not in done.stderr
    # a file Spark fails on in a task: one line naming it, nothing of Spark's own log
    # (its traces, Java's warnings) without --debug
    cut = tmp_path / "delivery-z-0.jsonl.zst"
    cut.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(range(200)))
    args = [*_skmq_command(), "audit", "--logs", str(tmp_path / "good"), str(cut), "--out", "o"]
    done = _run([*args, "--quiet"], tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and str(cut) in done.stderr, done.stderr[-2000:]


@needs_java
def test_the_same_job_through_spark_submit(audited: Audited, tmp_path: Path) -> None:
    _, report, logs, _ = audited
    submit = Path(sys.executable).parent / "spark-submit"
    if not submit.exists():
        pytest.skip("no spark-submit beside the Python")
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    out = tmp_path / "out"
    done = _run(
        [
            str(submit),
            "--master",
            "local[2]",
            "--driver-memory",
            "700m",
            str(REPO / "spark" / "audit.py"),
            *_job_args(logs, out),
        ],
        tmp_path,
        env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "report.json").read_text(encoding="utf-8")) == report
    said = done.stdout + done.stderr  # (its progress lines, beside Spark's own)
    assert "starting Spark (as submitted)" in said and "Spark master: local[2]" in said


def _cli_args(tmp_path: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--logs", str(tmp_path), "--out", str(tmp_path / "out"), "--quiet"])


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


@pytest.mark.parametrize("missing", ["pyspark", "psutil", "pyarrow"])
def test_cli_without_the_audit_extra(
    missing: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cli = _cli_module()
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name == missing else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert cli.run(_cli_args(tmp_path)) == 2
    assert "pip install 'skmq[audit]'" in capsys.readouterr().err


@needs_java
def test_cli_register_and_missing_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli = _cli_module()
    parser = argparse.ArgumentParser(prog="skmq")
    cli.configure(parser.add_subparsers(dest="command", required=True).add_parser("audit"))
    args = parser.parse_args(
        ["audit", "--logs", str(tmp_path / "none"), "--out", str(tmp_path / "o")]
    )
    assert args.func is cli.run and args.master is None
    assert args.func(args) == 2  # fails before starting Spark
    assert "no such file or directory" in capsys.readouterr().err
