"""`skmq consume`, `skmq send` and `skmq dlq` as real processes against a real
`skmq serve`, and the Python `Consumer` end to end against an in-process broker."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from skmq.broker import Broker
from tests.conftest import BrokerProcess
from tests.test_delivery import (
    attempts,
    log_events,
    logged,
    produce,
    settle,
)

pytest.importorskip("skmq.client")
pytest.importorskip("skmq.cli.consume")

from skmq.client import Consumer, Message, Reject

SKMQ = [sys.executable, "-m", "skmq.cli"]
LIMIT = 30.0  # upper bound of a CLI command


async def cli(env: dict[str, str], *args: str, stdin: bytes = b"") -> tuple[int, str, str]:
    # No stdin to give: none at all (under uvloop, feeding a child that already exited
    # raises RuntimeError on its closed pipe).
    proc = await asyncio.create_subprocess_exec(
        *SKMQ, *args, env=env,
        stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin or None), LIMIT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


class ConsumeProcess:
    """One `skmq consume` process; its output lines collected as they come, and
    `changed` set on each (an event several consumers may share)."""

    def __init__(self, proc: asyncio.subprocess.Process, changed: asyncio.Event) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.stderr: list[str] = []
        self.changed = changed
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._read(proc.stdout, self.lines)),
            loop.create_task(self._read(proc.stderr, self.stderr)),
        ]

    @classmethod
    async def start(
        cls, env: dict[str, str], *args: str, changed: asyncio.Event | None = None
    ) -> ConsumeProcess:
        proc = await asyncio.create_subprocess_exec(
            *SKMQ, "consume", *args, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        self = cls(proc, changed or asyncio.Event())

        def ready() -> bool:
            return any("listening" in x for x in self.stderr)

        try:  # listening and registered, or gone (stderr closed)
            await until(self.changed, lambda: ready() or self._tasks[1].done())
        except TimeoutError:
            pass
        if not ready():
            await self.stop()
            raise AssertionError(f"skmq consume did not start: {self.stderr}")
        return self

    async def _read(self, stream: asyncio.StreamReader | None, into: list[str]) -> None:
        assert stream is not None
        while line := await stream.readline():
            into.append(line.decode().rstrip("\n"))
            self.changed.set()
        self.changed.set()

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def until(changed: asyncio.Event, check: Callable[[], bool], timeout: float = LIMIT) -> None:
    """Wait (bounded) until check() holds, re-checking each time `changed` is set."""
    async with asyncio.timeout(timeout):
        while True:
            changed.clear()
            if check():
                return
            await changed.wait()


@pytest.fixture
async def serve(broker_process: BrokerProcess) -> AsyncIterator[BrokerProcess]:
    """A running `skmq serve` (started off the event loop: recipients in this loop must
    keep answering the broker meanwhile)."""
    await asyncio.to_thread(broker_process.start)
    yield broker_process
    if broker_process.proc is not None and broker_process.proc.poll() is None:
        await asyncio.to_thread(broker_process.terminate)


def test_python_dash_m_skmq_cli_runs() -> None:
    """`python -m skmq.cli` (how conftest's broker_process and these tests run it)."""
    done = subprocess.run(
        [sys.executable, "-m", "skmq.cli", "--help"], capture_output=True, timeout=LIMIT
    )
    assert done.returncode == 0, done.stderr.decode()
    assert b"consume" in done.stdout


PUSH = ["consume", "--app", "a", "--id", "r", "--port", "0"]
PULL = ["consume", "--app", "a", "--pull", "--group", "g"]
SEND = ["send", "--app", "a", "x"]
BAD_NUMBERS = [
    (PUSH, "--max-frame-bytes", "0", "'0': expected at least 64"),
    (PUSH, "--concurrency", "0", "'0': expected at least 1"),
    (PUSH, "--exec-timeout", "-1", "'-1': expected seconds above 0"),
    (PUSH, "--exec-timeout", "0", "'0': expected seconds above 0"),
    (PUSH, "--weight", "-1", "'-1': expected at least 0"),
    (PUSH, "--reject-exit-code", "256", "'256': expected 1-255"),
    (PULL, "--visibility", "0", "'0': expected seconds above 0"),
    (PULL, "--batch", "0", "'0': expected at least 1"),
    (SEND, "--delay", "-5", "'-5': expected at least 0"),
    (SEND, "--deliver-at", "x", "'x' is not a whole number"),
    (["status", "--watch"], "--interval", "0", "'0': expected seconds above 0"),
]


@pytest.mark.parametrize(("args", "flag", "value", "said"), BAD_NUMBERS)
def test_a_bad_number_is_a_usage_error_before_anything_starts(
    args: list[str], flag: str, value: str, said: str
) -> None:
    """Refused by the parser (status 2, one line), not by a traceback once a push comes."""
    done = subprocess.run(
        [*SKMQ, *args, flag, value], capture_output=True, text=True, timeout=LIMIT,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    command = args[0]
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr == f"skmq {command}: argument {flag}: {said} (see skmq {command} --help)\n"


async def test_consumers_share_sent_messages_by_weight(
    serve: BrokerProcess, broker_env: dict[str, str]
) -> None:
    env = dict(broker_env)
    app = "cw"
    changed = asyncio.Event()
    light = await ConsumeProcess.start(
        env, "--app", app, "--id", "light", "--port", "0", changed=changed
    )
    heavy = await ConsumeProcess.start(
        env, "--app", app, "--id", "heavy", "--port", "0", "--weight", "3", changed=changed
    )
    try:
        n = 10
        sent = await asyncio.gather(
            *(cli(env, "send", "--app", app, "--msgid", f"s{i}", f"body {i}") for i in range(n))
        )
        for code, out, err in sent:
            assert code == 0, err
            assert json.loads(out)["status"] == "ack"
        await until(changed, lambda: len(light.lines) + len(heavy.lines) >= n)
        got = {}
        for c in (light, heavy):
            for line in c.lines:
                appid, msgid, content = line.split(" ", 2)
                assert appid == app and content == f"body {msgid[1:]}", line
                got[msgid] = c
        assert sorted(got) == sorted(f"s{i}" for i in range(n))
        # shares (w+1)/sum(w+1): 1/5 and 4/5
        assert abs(len(light.lines) - 2) <= 1 and abs(len(heavy.lines) - 8) <= 1, (
            light.lines,
            heavy.lines,
        )
    finally:
        await light.stop()
        await heavy.stop()


async def test_exec_failures_go_to_the_dlq_and_replay_redelivers(
    serve: BrokerProcess, broker_env: dict[str, str], tmp_path: Path
) -> None:
    env = dict(broker_env)
    app = "cx"
    log_dir = Path(env["SKMQ_DATA_DIR"]) / "delivery-log"
    ok, seen = tmp_path / "ok", tmp_path / "seen"
    command = f'cat >/dev/null; echo "$SKMQ_MSGID" >> {seen}; test -f {ok}'
    worker = await ConsumeProcess.start(
        env, "--app", app, "--id", "w", "--port", "0", "--exec", command
    )
    try:
        code, out, err = await cli(env, "send", "--app", app, "--msgid", "job1", "payload one")
        assert code == 0, err
        await logged(log_dir, "dead_lettered", "job1", timeout=LIMIT)
        assert attempts(log_dir, "job1", "errored") == [1, 2, 3]
        assert seen.read_text().split() == ["job1"] * 3
        code, out, err = await cli(env, "dlq", "list", "--app", app, "--json")
        assert code == 0, err
        (letter,) = json.loads(out)
        assert (letter["msgid"], letter["appid"], letter["content"]) == ("job1", app, "payload one")
        assert letter["attempts"] == 3
        assert "exit status 1" in letter["last_error"], letter
        assert len(letter["history"]) == 3
        ok.touch()
        code, out, err = await cli(env, "dlq", "replay", "--all", "--json")
        assert code == 0, err
        assert json.loads(out) == {"replay": 1, "selected": 1}
        await logged(log_dir, "acked", "job1", timeout=LIMIT)
        assert [e["attempt"] for e in log_events(log_dir, "job1", "acked")] == [1]
        assert log_events(log_dir, "job1", "replayed")
        assert seen.read_text().split() == ["job1"] * 4
        code, out, err = await cli(env, "dlq", "list", "--app", app, "--json")
        assert code == 0 and json.loads(out) == [], (out, err)
    finally:
        await worker.stop()


async def test_dlq_purge_removes_dead_letters(
    serve: BrokerProcess, broker_env: dict[str, str]
) -> None:
    env = dict(broker_env)
    app = "cp"
    log_dir = Path(env["SKMQ_DATA_DIR"]) / "delivery-log"
    worker = await ConsumeProcess.start(
        env, "--app", app, "--id", "w", "--port", "0", "--exec", "cat >/dev/null; exit 3",
        "--reject-exit-code", "3",
    )  # fmt: skip
    try:
        code, _, err = await cli(env, "send", "--app", app, "--msgid", "gone1", "x")
        assert code == 0, err
        await logged(log_dir, "dead_lettered", "gone1", timeout=LIMIT)
        assert attempts(log_dir, "gone1", "rejected") == [1, 2, 3]
        code, out, err = await cli(env, "dlq", "purge", "--all", "--app", app, "--json")
        assert code == 0, err
        assert json.loads(out) == {"purge": 1, "selected": 1}
        code, out, err = await cli(env, "dlq", "list", "--app", app, "--json")
        assert code == 0 and json.loads(out) == [], (out, err)
        code, out, err = await cli(env, "status", "--json")
        assert code == 0, err
        (status,) = [a for a in json.loads(out)["apps"] if a["appid"] == app]
        assert (status["pending"], status["in_flight"], status["dead"]) == (0, 0, 0)
        assert [r["id"] for r in status["recipients"]] == ["w"]
        assert status["recipients"][0]["state"] == "alive"
        # `--app A` alone selects all of A's dead letters (as `skmq dlq replay -h` says)
        code, out, err = await cli(env, "dlq", "replay", "--app", app, "--json")
        assert code == 0, err
        assert json.loads(out) == {"replay": 0, "selected": 0}
    finally:
        await worker.stop()


# --------------------------------------------------------------------------- Consumer class


async def test_python_consumer_answers_ack_error_and_reject(
    broker: Broker, redis: aioredis.Redis
) -> None:
    app = "pyc"

    async def handler(msg: Message) -> None:
        text = msg.content.decode()
        if text == "boom":
            raise RuntimeError("boom happened")
        if text == "later":
            raise Reject("not now")

    consumer = Consumer(app, "c1", handler, broker_port=broker.server.port)
    await consumer.start()
    try:
        for m in ("ok", "boom", "later"):
            await produce(broker.server.port, app, [m], content=m.encode())
        await logged(broker, "acked", "ok")
        await logged(broker, "dead_lettered", "boom")
        await logged(broker, "dead_lettered", "later")
        await only_dead_letters_left(broker, app)
    finally:
        await consumer.stop()
    assert attempts(broker, "ok", "acked") == [1]
    errored = log_events(broker, "boom", "errored")
    assert [e["attempt"] for e in errored] == [1, 2, 3]
    assert all("boom happened" in (e["detail"] or "") for e in errored), errored
    assert attempts(broker, "later", "rejected") == [1, 2, 3]
    assert consumer.stats == {"received": 7, "acked": 1, "rejected": 3, "errored": 3}
    dead = {d.msgid: d for d in await broker.store.dead_letters(app)}
    assert sorted(dead) == ["boom", "later"]
    assert "boom happened" in dead["boom"].last_error


async def only_dead_letters_left(broker: Broker, app: str) -> None:
    counts = (await broker.store.counts([app], 0))[app]
    assert (counts.pending, counts.delayed, counts.in_flight, counts.dead) == (0, 0, 0, 2)


async def test_python_consumer_slow_handler_answers_after_ack_wait(
    broker: Broker, redis: aioredis.Redis
) -> None:
    """arrived, then processing longer than ACK_WAIT: the final answer still lands,
    on the push connection or, once the broker closed it, on the consumer's own."""
    app = "pyslow"
    slow = broker.settings.ack_wait + 0.5

    async def handler(msg: Message) -> None:
        await asyncio.sleep(slow)  # the processing itself, longer than ACK_WAIT

    consumer = Consumer(app, "c1", handler, broker_port=broker.server.port, send_arrived=True)
    await consumer.start()
    try:
        await produce(broker.server.port, app, ["slow1", "slow2"])
        await logged(broker, "acked", "slow1")
        await logged(broker, "acked", "slow2")
        await settle(redis, broker, app)
    finally:
        await consumer.stop()
    for m in ("slow1", "slow2"):
        assert attempts(broker, m, "arrived") == [1]
        assert attempts(broker, m, "acked") == [1]
        assert attempts(broker, m, "pushed") == [1]
    assert consumer.stats["acked"] == 2
