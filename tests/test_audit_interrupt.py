"""`skmq audit` stopped by Ctrl-C or SIGTERM in the middle of its Spark stages: it ends
soon, with status 128 + the signal's number, quietly (no trace, no py4j error), and its
JVM gone.
(PySpark's own SIGINT handler cancelled the jobs and raised: a query thread stuck in
`collect()` then held the exit for ever, and a py4j call cut in the middle ended with
"Gateway must be connected to send cancel cmd" and status 1.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench.audit_bench import generate
from tests.test_audit import needs_java

EVENTS = 300_000


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("interrupt-logs")
    generate(directory, EVENTS, seed=7)
    return directory


def _wait_for_line(err_path: Path, proc: subprocess.Popen[bytes], marker: str) -> None:
    """Until the audit's progress on stderr shows `marker` (it runs meanwhile)."""
    deadline = time.monotonic() + 300
    while marker not in err_path.read_text(errors="replace"):
        assert proc.poll() is None, err_path.read_text()[-3000:]
        assert time.monotonic() < deadline, err_path.read_text()[-3000:]
        time.sleep(0.05)  # (polling a file another process writes: nothing to await)


@needs_java
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("signum", "stage"),
    [
        (signal.SIGINT, "[2/7] grouping events"),
        (signal.SIGINT, "[4/7] dead-letter queue"),
        (signal.SIGTERM, "[2/7] grouping events"),
    ],
)
def test_an_interrupted_audit_ends_quietly_with_its_jvm(
    logs: Path, tmp_path: Path, signum: int, stage: str
) -> None:
    err_path, out = tmp_path / "audit.err", str(tmp_path / "out")
    with err_path.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "skmq.cli", "audit", "--logs", str(logs), "--out", out],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "SKMQ_AUDIT_CDS": "off"},
        )
    try:
        _wait_for_line(err_path, proc, stage)
        jvms = psutil.Process(proc.pid).children(recursive=True)
        assert jvms, "the audit's JVM runs"
        proc.send_signal(signum)
        code = proc.wait(timeout=60)
        told = err_path.read_text(errors="replace")
        assert code == 128 + signum, told[-3000:]
        assert "Traceback" not in told and "Gateway" not in told, told[-3000:]
        _, alive = psutil.wait_procs(jvms, timeout=10)
        assert not alive, f"left running: {[p.cmdline()[:3] for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
