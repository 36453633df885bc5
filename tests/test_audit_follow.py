"""``skmq audit --follow``: the tail of a live log directory (lines taken once, through
rotation and compression), and the streaming audit of a real broker with traffic,
stopped with SIGTERM, whose final report equals a batch audit of the same logs."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from skmq.audit_job.audit import Options, run_audit
from skmq.audit_job.inputs import file_uri
from skmq.audit_job.tail import CHUNK_NAME, LogTail

from tests.conftest import BrokerFactory, eventually
from tests.peers import FakeRecipient, RawClient

needs_java = pytest.mark.skipif(
    shutil.which("java") is None and not os.environ.get("JAVA_HOME"), reason="no Java"
)


def _chunks(tail: LogTail) -> list[Path]:
    return sorted(p for p in tail.chunks.iterdir() if CHUNK_NAME.search(p.name))


def _lines(paths: list[Path]) -> list[str]:
    found: list[str] = []
    for path in paths:
        data = path.read_bytes()
        if path.name.endswith(".gz"):
            data = gzip.decompress(data)
        found += data.decode().splitlines()
    return found


def test_tail_takes_complete_lines_once_through_compression(tmp_path: Path) -> None:
    logs, chunks = tmp_path / "logs", tmp_path / "out" / ".follow" / "chunks"
    logs.mkdir()
    tail = LogTail([str(logs)], chunks)
    assert tail.poll() == 0  # nothing written yet: no error
    log = logs / "delivery-b1-000000.jsonl"
    with log.open("w") as f:
        f.write('{"n":1}\n{"n":2}\n{"n":')  # the third line is being written
    assert tail.poll() == 1
    assert _lines(_chunks(tail)) == ['{"n":1}', '{"n":2}']
    assert tail.poll() == 0  # nothing new
    with log.open("a") as f:
        f.write('3}\n{"n":4}\n')
    assert tail.poll() == 1
    assert _lines(_chunks(tail)) == ['{"n":1}', '{"n":2}', '{"n":3}', '{"n":4}']
    # rotated: more lines, then compressed (as skmq/logarchive.py: .gz, then unlink)
    with log.open("a") as f:
        f.write('{"n":5}\n{"n":6}')  # a last line without its newline
    packed = logs / "delivery-b1-000000.jsonl.gz"
    packed.write_bytes(gzip.compress(log.read_bytes()))
    # the .jsonl is still there (compressed this very moment): its new line, not the .gz
    assert tail.poll() == 1
    assert _lines(_chunks(tail)) == [f'{{"n":{n}}}' for n in range(1, 6)]
    log.unlink()
    assert tail.poll() == 1  # the rest of the open file, not the .gz again
    assert _lines(_chunks(tail)) == [f'{{"n":{n}}}' for n in range(1, 7)]
    assert tail.files() == [str(packed)]
    # a compressed file that is no followed file: taken whole, once
    other = logs / "delivery-b2-000003.jsonl.gz"
    other.write_bytes(gzip.compress(b'{"n":7}\n'))
    assert tail.poll() == 1 and tail.poll() == 0
    assert _lines(_chunks(tail))[-1] == '{"n":7}'
    assert sorted(tail.files()) == sorted([str(packed), str(other)])
    # a file removed (pruned): its lines are left out of the report
    other.unlink()
    tail.poll()
    assert tail.files() == [str(packed)] and len(tail.gone()) == 1
    tail.close()


def test_tail_final_takes_a_last_line_without_newline(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "delivery-b1-000000.jsonl").write_text('{"n":1}\n{"n":2}')
    tail = LogTail([str(logs)], tmp_path / "chunks")
    tail.poll()
    assert _lines(_chunks(tail)) == ['{"n":1}']
    tail.poll(final=True)
    assert _lines(_chunks(tail)) == ['{"n":1}', '{"n":2}']
    tail.close()


def _without_follow(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k != "follow"}


def _read_report(out: Path) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = json.loads((out / "report.json").read_text())
    except (OSError, ValueError):
        return None
    return found


async def _final_report(
    proc: asyncio.subprocess.Process, signum: int, out: Path, stderr: Path
) -> dict[str, Any]:
    """Stop a follow with `signum`: its final report (status 0, its staging directory
    removed)."""
    proc.send_signal(signum)
    async with asyncio.timeout(300):
        code = await proc.wait()
    assert code == 0, stderr.read_text()[-3000:]
    final = _read_report(out)
    assert final is not None and final["follow"]["final"] is True
    assert not (out / ".follow").exists()
    return final


@needs_java
@pytest.mark.timeout(900)
async def test_follow_a_real_broker_then_sigterm_equals_a_batch_audit(
    make_broker: BrokerFactory, spark: Any, tmp_path: Path
) -> None:
    """A broker with traffic (acked, dead-lettered, one message pushed and never
    answered, one with no recipient) rotating and compressing small files; `skmq audit
    --follow` watches it in a subprocess, reports as traffic goes on, prints the stuck
    delivery once; after SIGTERM its final report equals a batch audit of the same
    directory (and of a file of awkward name with a bad line, named alike in both)."""
    # (a lease longer than the test: the unanswered push stays in flight, stuck)
    broker = await make_broker(data_dir=tmp_path / "data", log_rotate_bytes=4096, ack_timeout=600.0)
    log_dir = broker.settings.delivery_log_dir
    good = await FakeRecipient("shop", "r1").start()
    bad = await FakeRecipient("bad", "r9", lambda frame: "reject").start()
    silent = await FakeRecipient("hold", "r5", lambda frame: "silent").start()
    for rec in (good, bad, silent):
        assert (await rec.register(broker.server.port))["status"] == "ack"
    more = tmp_path / "more é %41 #x"
    more.mkdir()
    awkward = more / "delivery-z a%20b#?é\u00a0.jsonl"
    awkward.write_text("not an event\n", encoding="utf-8")
    logs = [str(log_dir), str(more)]
    out = tmp_path / "follow"
    stdout, stderr = tmp_path / "follow.out", tmp_path / "follow.err"
    with stdout.open("wb") as so, stderr.open("wb") as se:
        proc = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "skmq.cli", "audit", "--follow"],
            *["--logs", *logs, "--out", str(out), "--master", "local[2]"],
            *["--interval", "1", "--stuck-after", "1", "--driver-memory", "700m"],
            stdout=so,
            stderr=se,
            stdin=asyncio.subprocess.DEVNULL,
        )
    try:
        client = await RawClient.connect(broker.server.port)
        answers = await client.produce("shop", [f"a{i}" for i in range(30)])
        answers += await client.produce("bad", [f"d{i}" for i in range(3)])
        answers += await client.produce("hold", ["held"])  # pushed, never answered: stuck
        answers += await client.produce("nobody", ["lost"])  # no recipient: waiting
        assert {a["status"] for a in answers} == {"ack"}

        async def reported(acked: int, dead: int) -> bool:
            assert proc.returncode is None, stderr.read_text()[-2000:]
            report = _read_report(out)
            return (
                report is not None
                and report["totals"]["acked"] >= acked
                and report["totals"]["dead_lettered"] >= dead
            )

        await eventually(lambda: reported(30, 3), 400)  # a JVM start on a busy machine
        first = _read_report(out)
        assert first is not None and first["follow"]["final"] is False
        # more traffic, 1.5 s on: the held push is past --stuck-after by the log's clock
        await asyncio.sleep(1.5)
        answers = await client.produce("shop", [f"b{i}" for i in range(30)])
        assert {a["status"] for a in answers} == {"ack"}
        await eventually(lambda: reported(60, 3), 300)
        await client.close()
        for rec in (good, bad):
            await rec.stop()
        broker.stopping.set()
        await broker.stop()  # flushes and compresses the log
        await silent.stop()  # (after the broker: a connection lost would be an answer)
        assert any(p.name.endswith(".jsonl.gz") for p in log_dir.iterdir())
        final = await _final_report(proc, signal.SIGTERM, out, stderr)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    same = Options(stuck_after_ms=1000)  # as --stuck-after 1
    batch = run_audit(logs, str(tmp_path / "batch"), spark=spark, options=same, progress=False)
    assert _without_follow(final) == json.loads(json.dumps(batch))
    (sample,) = final["input"]["bad_lines"]["samples"]
    assert sample["file"] == file_uri(str(awkward))
    totals = final["totals"]
    assert (totals["acked"], totals["dead_lettered"]) == (60, 3)
    assert final["unresolved"]["stuck"] >= 1
    assert final["unresolved"]["waiting_for_recipient"] >= 1  # never pushed: not stuck
    # each stuck delivery once, on stdout and in the report
    printed = [line for line in stdout.read_text().splitlines() if line.startswith("stuck: ")]
    assert len(printed) == len(set(printed)) == final["follow"]["stuck_reported"]
    assert any(line.startswith("stuck: hold held") for line in printed)
    assert not any(line.startswith("stuck: nobody") for line in printed)
    assert {(s["appid"], s["msgid"]) for s in final["follow"]["stuck"]} >= {("hold", "held")}


@needs_java
def test_follow_bad_arguments_are_one_line(tmp_path: Path) -> None:
    """Told before Spark starts, in one line, status 2."""
    base = [sys.executable, "-m", "skmq.cli", "audit", "--follow", "--out", str(tmp_path / "o")]
    (tmp_path / "logs").mkdir()
    cases = {
        "--interval 0: expected": ["--logs", str(tmp_path / "logs"), "--interval", "0"],
        "no local directory or file": ["--logs", str(tmp_path / "missing")],
        "local mode only": ["--logs", str(tmp_path / "logs"), "--master", "spark://h:7077"],
    }
    for told, args in cases.items():
        done = subprocess.run(
            [*base, *args], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 2, done.stderr
        assert told in done.stderr and done.stderr.count("\n") == 1, done.stderr


@needs_java
@pytest.mark.timeout(600)
async def test_follow_ends_on_sigint_with_a_final_report(tmp_path: Path) -> None:
    """Ctrl-C ends a follow as SIGTERM does: a final report, status 0, the staging
    directory gone (PySpark's own SIGINT handler, set as Spark starts, is taken back)."""
    logs, out = tmp_path / "logs", tmp_path / "out"
    logs.mkdir()
    event = {"ts": 1_760_000_000_000, "event": "stored", "msgid": "m1", "appid": "a"}
    event |= {"kind": "queue", "recipient": None, "attempt": None, "broker": "b", "detail": None}
    (logs / "delivery-b-000000.jsonl").write_text(json.dumps(event) + "\n", encoding="utf-8")
    stderr = tmp_path / "follow.err"
    with stderr.open("wb") as se:
        proc = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "skmq.cli", "audit", "--follow", "--logs", str(logs)],
            *["--out", str(out), "--master", "local[1]", "--interval", "1"],
            *["--driver-memory", "600m"],
            stdout=asyncio.subprocess.DEVNULL,
            stderr=se,
            stdin=asyncio.subprocess.DEVNULL,
        )
    try:

        async def reported() -> bool:
            assert proc.returncode is None, stderr.read_text()[-2000:]
            return _read_report(out) is not None

        await eventually(reported, 400)
        final = await _final_report(proc, signal.SIGINT, out, stderr)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert final["totals"]["messages"] == 1
