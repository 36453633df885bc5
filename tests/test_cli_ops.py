"""The operator's first hour (issue 13.5, 13.6): every bad setting, file or address is
one line and status 2; operational failures one line and status 1; no traceback unless
--debug; `dlq` says what it did and fails on unknown ids; `consume --exec` under both
event loops."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import uvloop

from skmq import __version__
from skmq.broker import Broker
from skmq.cli.consume import exec_handler
from skmq.client import Message, Reject
from skmq.embedded import EmbeddedRedis
from skmq.store import connect_redis
from tests.conftest import BrokerFactory, BrokerProcess, eventually, free_port
from tests.peers import FakeRecipient, RawClient

SKMQ = [sys.executable, "-m", "skmq.cli"]


def skmq(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[int, str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    base["SKMQ_HTTP_PORT"] = "0"  # the gateway's default port may be taken by another test
    done = subprocess.run(
        [*SKMQ, *args], env={**base, **(env or {})}, cwd=cwd,
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return done.returncode, done.stdout, done.stderr


def one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    bad = tmp_path / "bad.toml"
    bad.write_text("port = \n")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("prot = 1800\n")
    good = tmp_path / "good.toml"
    good.write_text("port = 0\n")
    (tmp_path / "etc" / "redis").mkdir(parents=True)  # a directory like /etc: not SKMQ's
    return {"bad": bad, "unknown": unknown, "good": good, "dir": tmp_path}


BAD_SETTINGS: list[tuple[str, Callable[[dict[str, Path]], list[str]], dict[str, str], str]] = [
    (
        "replay into no app",
        lambda f: ["dlq", "replay", "--app", "a", "--to-app", "", "m1"],
        {},
        "skmq dlq: --to-app required",
    ),
    (
        "replay into a bad app",
        lambda f: ["dlq", "replay", "--app", "a", "--to-app", "bad\x01", "m1"],
        {},
        "skmq dlq: --to-app holds a control character",
    ),
    (
        "missing config",
        lambda f: ["serve", "--config", str(f["dir"] / "nope.toml")],
        {},
        "skmq serve: config file {dir}/nope.toml: no such file",
    ),
    (
        "bad toml",
        lambda f: ["serve", "--config", str(f["bad"])],
        {},
        "skmq serve: config file {dir}/bad.toml: not valid TOML "
        "(Invalid value (at line 1, column 8))",
    ),
    (
        "unknown key",
        lambda f: ["serve", "--config", str(f["unknown"])],
        {},
        "skmq serve: config file {dir}/unknown.toml: unknown setting 'prot' (did you mean 'port'?)",
    ),
    (
        "log level",
        lambda f: ["serve", "--log-level", "loud"],
        {},
        "skmq serve: invalid setting LOG_LEVEL='loud': not a log level "
        "(one of debug, info, warning, error, critical)",
    ),
    (
        "redis scheme",
        lambda f: ["serve"],
        {"SKMQ_REDIS_URL": "http://127.0.0.1:1/0"},
        "skmq serve: invalid setting REDIS_URL='http://127.0.0.1:1/0': needs a scheme of "
        "redis://, rediss://, unix://, redis+sentinel://, redis+cluster://",
    ),
    (
        "redis port",
        lambda f: ["serve"],
        {"SKMQ_REDIS_URL": "redis://127.0.0.1:notaport"},
        "skmq serve: invalid setting REDIS_URL='redis://127.0.0.1:notaport': "
        "'127.0.0.1:notaport' has no valid port (0-65535)",
    ),
    (
        "redis without host",  # not quietly localhost:6379
        lambda f: ["status"],
        {"SKMQ_REDIS_URL": "redis://"},
        "skmq status: invalid setting REDIS_URL='redis://': needs a host: redis://HOST[:PORT][/DB]",
    ),
    (
        "redis password never shown",
        lambda f: ["dlq", "list", "--redis-url", "redis://:s3cret@/0"],
        {},
        "skmq dlq: invalid setting REDIS_URL='redis://***@/0': needs a host: "
        "redis://HOST[:PORT][/DB]",
    ),
    (
        "sentinel without service",
        lambda f: ["serve"],
        {"SKMQ_REDIS_URL": "redis+sentinel://127.0.0.1:26379"},
        "skmq serve: invalid setting REDIS_URL='redis+sentinel://127.0.0.1:26379': needs the "
        "service name: redis+sentinel://HOST:PORT,.../SERVICE[/DB]",
    ),
    (
        "recipient networks",  # checked at start, not at the first registration
        lambda f: ["serve"],
        {"SKMQ_RECIPIENT_NETWORKS": "10.0.0.0/8,10.0.0.0/33"},
        "skmq serve: invalid setting RECIPIENT_NETWORKS='10.0.0.0/8,10.0.0.0/33': "
        "'10.0.0.0/33' is not an IP network (like 10.0.0.0/8)",
    ),
    (
        "unknown flag",  # said for the command it was given to
        lambda f: ["dlq", "list", "--since", "x"],
        {},
        "skmq dlq: unrecognized arguments: --since x (see skmq dlq --help)",
    ),
    (
        "broker id",  # it names the delivery log's files
        lambda f: ["serve"],
        {"SKMQ_BROKER_ID": "a b/c"},
        "skmq serve: invalid setting BROKER_ID='a b/c': "
        "at most 64 letters, digits, '_', '.' or '-'",
    ),
    (
        "data dir a file",
        lambda f: ["serve", "--data-dir", str(f["bad"])],
        {},
        "skmq serve: invalid setting DATA_DIR='{dir}/bad.toml': "
        "'{dir}/bad.toml' is not a directory",
    ),
    (
        "port",
        lambda f: ["serve", "--port", "x"],
        {},
        "skmq serve: invalid setting PORT='x': Input should be a valid integer, "
        "unable to parse string as an integer",
    ),
    (
        "send timeout",
        lambda f: ["send", "--timeout", "0", "--app", "a", "x"],
        {},
        "skmq send: argument --timeout: '0': expected seconds above 0 (see skmq send --help)",
    ),
    (
        "send msgid with a CR",
        lambda f: ["send", "--msgid", "a\rb", "--app", "a", "x"],
        {},
        "skmq send: not sent: CR or LF inside a field: 'msgid=a\\rb'",
    ),
    (
        "status without data",
        lambda f: ["status", "--data-dir", str(f["dir"] / "empty")],
        {},
        "skmq status: no broker data in {dir}/empty (set --data-dir or REDIS_URL)",
    ),
    (
        "status in another program's directory",
        lambda f: ["status", "--data-dir", str(f["dir"] / "etc")],
        {},
        "skmq status: no broker data in {dir}/etc (set --data-dir or REDIS_URL)",
    ),
    (
        "host not of this machine",
        lambda f: [
            "serve",
            "--host",
            "192.0.2.1",
            "--allow-unauthenticated",
            "true",
            "--data-dir",
            str(f["dir"] / "d"),
            "--log-level",
            "error",
        ],
        {},
        "skmq serve: cannot listen on 192.0.2.1:1734 (HOST/PORT): not an address of this machine",
    ),
    (
        "send port",
        lambda f: ["send", "--port", "99999", "--app", "a", "x"],
        {},
        "skmq send: argument --port: '99999' is not a port (0-65535) (see skmq send --help)",
    ),
    (
        "unknown command",
        lambda f: ["sned"],
        {},
        "skmq: argument COMMAND: invalid choice: 'sned' (choose from 'serve', 'config', 'send', "
        "'consume', 'status', 'apps', 'peek', 'purge', 'dlq', 'groups', 'recipients', "
        "'connections', 'audit') (see skmq --help)",
    ),
    (
        "HTTP_PORT equal to PORT",
        lambda f: ["serve", "--port", "1800", "--http-port", "1800", "--data-dir", str(f["dir"])],
        {},
        "skmq serve: invalid setting HTTP_PORT=1800 is PORT's too (each listener needs its own)",
    ),
    (
        "METRICS_PORT equal to HTTP_PORT on every address",
        lambda f: ["serve", "--metrics-host", "0.0.0.0", "--data-dir", str(f["dir"])],
        {"SKMQ_HTTP_PORT": "1801", "SKMQ_METRICS_PORT": "1801"},
        "skmq serve: invalid setting METRICS_PORT=1801 is HTTP_PORT's too "
        "(each listener needs its own)",
    ),
    (
        "dlq without selection",
        lambda f: ["dlq", "purge", "--data-dir", str(f["dir"])],
        {},
        "skmq dlq: say which: --all, --app A, or MSGID ...",
    ),
]


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [case[1:] for case in BAD_SETTINGS],
    ids=[case[0] for case in BAD_SETTINGS],
)
def test_a_bad_setting_is_one_line_and_status_2(
    files: dict[str, Path],
    args: Callable[[dict[str, Path]], list[str]],
    env: dict[str, str],
    expected: str,
) -> None:
    code, _, err = skmq(*args(files), env=env)
    assert code == 2, err
    assert one_line(err) == expected.format(dir=files["dir"])


def test_consume_on_a_port_in_use_names_its_own_port_not_the_brokers() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = skmq("consume", "--app", "x", "--id", "y", "--port", str(port))
    assert (code, one_line(err)) == (
        2,
        f"skmq consume: cannot listen on 127.0.0.1:{port} (--host/--port): address already in use",
    )


def test_an_operational_failure_is_one_line_and_status_1(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        code, _, err = skmq(
            "serve", "--port", str(port), "--data-dir", str(tmp_path / "d"), "--log-level", "error"
        )
        assert code == 1
        assert one_line(err) == (
            f"skmq serve: cannot listen on 127.0.0.1:{port} (HOST/PORT): address already in use"
        )
        code, _, err = skmq(
            "serve", "--port", "0", "--metrics-port", str(port), "--data-dir",
            str(tmp_path / "d"), "--log-level", "error",
        )  # fmt: skip
        assert code == 1
        assert one_line(err) == (
            f"skmq serve: cannot listen on 127.0.0.1:{port} (METRICS_HOST/METRICS_PORT): "
            "address already in use"
        )
    finally:
        taken.close()

    def serve_with(redis_url: str, *more: str) -> tuple[int, str]:
        code, _, err = skmq(
            "serve", "--redis-url", redis_url, "--redis-wait", "0.3", "--log-level", "error",
            "--data-dir", str(tmp_path / "d"), *more,
        )  # fmt: skip
        return code, err

    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    code, err = serve_with(nowhere)
    assert code == 1
    assert one_line(err).startswith(f"skmq serve: cannot reach Redis at {nowhere} within 0.3s")

    # A server that accepts and never answers: REDIS_WAIT bounds the wait (each ping at
    # least STORE_TIMEOUT), not a socket timeout and its retries (12 s before)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        quiet = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        started = time.monotonic()
        code, err = serve_with(quiet, "--store-timeout", "1")
    assert (code, one_line(err)) == (
        1,
        f"skmq serve: cannot reach Redis at {quiet} within 0.3s (REDIS_WAIT): no answer",
    )
    assert time.monotonic() - started < 8

    (tmp_path / "file").write_text("")
    code, _, err = skmq("serve", "--data-dir", str(tmp_path / "file" / "data"))
    assert code == 1
    assert one_line(err) == f"skmq serve: Not a directory: {tmp_path / 'file' / 'data'}"

    code, _, err = skmq("status", "--redis-url", nowhere)
    assert code == 1
    assert one_line(err).startswith("skmq status: Redis: Error 111 connecting to"), err

    # No Sentinel there: the reason, not redis-py's repr of each client it tried (1.5 KB).
    port = free_port()
    sentinel = f"redis+sentinel://127.0.0.1:{port}/mymaster"
    # (a wait a first attempt ends within on a busy machine: its reason, not "no answer")
    code, err = serve_with(sentinel, "--redis-wait", "3")
    assert code == 1
    line = one_line(err)
    assert line.startswith(f"skmq serve: cannot reach Redis at {sentinel} within 3s"), line
    assert f"No master found for 'mymaster' (Sentinel 127.0.0.1:{port}: " in line, line
    assert "<redis." not in line and len(line) < 300, line


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("redis", ["refusing", "silent"])
def test_a_stop_while_serve_waits_for_redis_is_a_quiet_stop(
    tmp_path: Path, sig: signal.Signals, redis: str
) -> None:
    """Ctrl-C or SIGTERM while `skmq serve` waits (REDIS_WAIT) for a Redis that refuses
    connections or never answers: a stop (status 0, at once), not "cannot reach Redis"."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1] if redis == "silent" else free_port()
        log = tmp_path / "serve.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*SKMQ, "serve", "--redis-url", f"redis://127.0.0.1:{port}/0",
                 "--redis-wait", "60", "--http-port", "0", "--port", "0",
                 "--data-dir", str(tmp_path / "d")],
                stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                env={k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")},
            )  # fmt: skip
        try:
            if redis == "silent":  # the broker's ping is on its way, never to be answered
                silent.settimeout(20)
                silent.accept()[0].close()
            else:
                deadline = time.monotonic() + 20
                while "redis unreachable, retrying" not in log.read_text():
                    assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
                    time.sleep(0.02)
            stopped_at = time.monotonic()
            proc.send_signal(sig)
            assert proc.wait(15) == 0, log.read_text()
            assert time.monotonic() - stopped_at < 5
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert "cannot reach Redis" not in log.read_text()


async def test_status_and_dlq_wait_while_a_stopped_brokers_redis_loads_its_aof(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    with EmbeddedRedis(data) as server:  # a stopped broker's DATA_DIR with an AOF of ~5 MB
        redis = connect_redis(server.url)
        for chunk in range(50):
            fill = redis.pipeline(transaction=False)
            for i in range(1000):
                fill.set(f"fill:{chunk}:{i}", b"x" * 64)
            await fill.execute()
        await redis.aclose()
    assert sum(f.stat().st_size for f in (data / "redis").rglob("*.aof")) > 4 << 20
    # Each command starts the server itself, which answers LOADING for a while.
    for command in (["status", "--json"], ["dlq", "list", "--json"]):
        code, out, err = await asyncio.to_thread(skmq, *command, "--data-dir", str(data))
        assert (code, err) == (0, ""), err
        assert json.loads(out) is not None


def test_an_unknown_environment_setting_is_reported_with_the_closest_name(
    broker_process: BrokerProcess, broker_env: dict[str, str]
) -> None:
    broker_env["SKMQ_PROT"] = "1800"
    broker_process.start()
    assert broker_process.terminate() == 0
    log = broker_process.log_path.read_text()
    assert "environment variable names no setting" in log
    assert "SKMQ_PROT (did you mean SKMQ_PORT?)" in log


def test_a_redis_with_large_listpacks_gets_a_warning(
    broker_process: BrokerProcess, broker_env: dict[str, str], tmp_path: Path
) -> None:
    """The embedded Redis keeps hashes and sorted sets of more than 32 entries out of
    listpacks (skmq/embedded.py); a Redis of REDIS_URL with Redis's default for hashes
    (512) gets a warning naming the setting, and the broker runs."""
    with EmbeddedRedis(tmp_path / "own") as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("*-max-listpack-entries") == {
            "hash-max-listpack-entries": "32", "set-max-listpack-entries": "128",
            "zset-max-listpack-entries": "32",
        }  # fmt: skip
        client.config_set("hash-max-listpack-entries", 512)
        client.close()
        broker_env["SKMQ_REDIS_URL"] = server.url
        broker_process.start()
        assert broker_process.terminate() == 0
    log = broker_process.log_path.read_text()
    assert "Redis hash-max-listpack-entries is 512: each delivery" in log
    assert "set hash-max-listpack-entries 32" in log
    assert "zset-max-listpack-entries is" not in log


def test_debug_shows_the_traceback_and_version_answers(tmp_path: Path) -> None:
    code, _, err = skmq("--debug", "status", "--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    assert code == 1 and "Traceback" in err
    # A failure the command says itself (send, consume): the traceback, then the same line.
    port = str(free_port())
    for args in (
        ["send", "--app", "a", "--port", port, "x"],
        ["consume", "--app", "a", "--id", "r", "--port", "0", "--broker-port", port],
    ):
        code, _, quiet = skmq(*args)
        code_debug, _, err = skmq("--debug", *args)
        assert code == code_debug == 2, err
        assert "Traceback" in err and "ConnectionRefusedError" in err, err
        assert err.splitlines()[-1] == one_line(quiet)
    code, out, _ = skmq("--version")
    assert (code, out.strip()) == (0, f"skmq {__version__}")


def test_client_commands_start_fast() -> None:
    """`skmq send` imports neither the broker nor pydantic-settings nor Spark (what makes
    a CLI start slow; its time is measured outside the tests, not asserted here: a
    busy machine made the bound fail)."""
    probe = (
        "import sys, skmq.cli as c; c.build_parser(['send', '--app', 'a']); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('pydantic_settings', 'pyspark', 'redis', 'rich') or m == 'skmq.broker'))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    helped = subprocess.run([*SKMQ, "send", "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--app" in helped.stdout, helped.stderr


# -- dlq -------------------------------------------------------------------------------


async def dead_letter(broker: Broker, app: str, msgid: str, content: bytes) -> None:
    rec = await FakeRecipient(app, "r", lambda f: "reject").start()
    assert (await rec.register(broker.server.port))["status"] == "ack"
    client = await RawClient.connect(broker.server.port)
    assert (await client.request("queue", content, appid=app, msgid=msgid))["status"] == "ack"
    await client.close()

    async def dead() -> bool:
        return [d.msgid for d in await broker.store.dead_letters(app, None)] == [msgid]

    await eventually(dead, 20)
    await rec.stop()


async def test_dlq_reports_fails_on_unknown_ids_and_logs_operator_actions(
    make_broker: BrokerFactory, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    broker = await make_broker()
    await dead_letter(broker, "ops", "m1", b"line one\r\nline two \xff")
    env = {"SKMQ_REDIS_URL": redis_url, "SKMQ_KEY_PREFIX": prefix,
           "SKMQ_DATA_DIR": str(tmp_path / "cli")}  # fmt: skip

    async def run(*args: str) -> tuple[int, str, str]:
        return await asyncio.to_thread(skmq, "dlq", *args, env=env)

    code, out, err = await run("list", "--app", "ops")
    assert code == 0, err
    assert "b'" not in out and 'b"' not in out, out
    assert "content=line one\\r\\nline two \ufffd" in out, out

    code, out, err = await run("replay", "m1", "nope", "--app", "ops")
    assert code == 1
    assert one_line(err) == "skmq dlq: no dead letter with msgid 'nope' in app 'ops': nothing done"
    assert [d.msgid for d in await broker.store.dead_letters("ops", None)] == ["m1"]

    code, out, err = await run("purge", "m1", "--app", "ops")
    assert (code, out.strip()) == (0, "purge: 1 of 1 dead letter(s)"), err
    assert "operator action" in err and "action='dlq purge'" in err and "m1" in err, err
    assert await broker.store.dead_letters("ops", None) == []


# -- consume --exec --------------------------------------------------------------------


def message(content: bytes) -> Message:
    return Message(appid="a", msgid="m", content=content, fields={})


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_exec_handler_outcomes_under_both_loops(loop: str) -> None:
    run = uvloop.run if loop == "uvloop" else asyncio.run
    big = b"x" * (1 << 20)

    async def outcome(command: str, content: bytes = big, timeout: float = 10) -> str:
        handle = exec_handler(command, 3, timeout)
        try:
            await handle(message(content))
        except Reject as exc:
            return f"reject: {exc}"
        except RuntimeError as exc:
            return f"error: {exc}"
        return "ack"

    async def cases() -> list[str]:
        return [
            await outcome("exit 0"),  # exits without reading its stdin
            await outcome("cat > /dev/null"),
            await outcome('test "$(cat)" = hello', b"hello"),
            await outcome("exit 3"),
            await outcome("exit 5"),
            await outcome("sleep 30", timeout=0.5),
        ]

    for _ in range(3):  # the broken pipe is a race: try it more than once
        assert run(cases()) == [
            "ack",
            "ack",
            "ack",
            "reject: exit status 3",
            "error: exit status 5",
            "error: handler timed out after 0.5s",
        ]


def test_operator_commands_do_not_import_the_broker() -> None:
    """`skmq status`, `peek`, `dlq`... start without the broker's modules (its server, its
    HTTP gateway, its workers): about 0.4 s of imports an operator's command waited for."""
    modules = ("apps", "dlq", "groups", "peek", "purge", "recipients", "status")
    code = (
        "import sys\n"
        f"for name in {modules!r}: __import__('skmq.cli.' + name)\n"
        "print(sorted(m for m in ('skmq.broker', 'skmq.handler', 'skmq.server', "
        "'skmq.http.gateway') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip() == "[]"
