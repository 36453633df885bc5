"""The pull loops of docs/HTTP.md, in Node and in the shell (curl and jq), run as they
are printed against a real broker's gateway: each receives a batch, acks it in one
request, and stops with the broker's error (no crash of its own) on a refusal. Each
test is skipped where its interpreter is not installed."""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from skmq.broker import Broker
from tests.conftest import BrokerFactory, eventually, free_port
from tests.test_pull_batch import requests_of
from tests.test_pull_client import gateway, produce

HTTP_MD = Path(__file__).resolve().parent.parent / "docs" / "HTTP.md"
DOCS_GATEWAY = "http://127.0.0.1:1735"
NODE, CURL, JQ = shutil.which("node"), shutil.which("curl"), shutil.which("jq")


def example(language: str, holding: str) -> str:
    """The one code block of docs/HTTP.md in `language` that holds `holding`."""
    blocks = re.findall(rf"^```{language}\n(.*?)^```$", HTTP_MD.read_text(), re.M | re.S)
    (block,) = [b for b in blocks if holding in b]
    return str(block)


def node_loop(url: str, tmp_path: Path) -> list[str]:
    script = tmp_path / "pull.mjs"
    script.write_text(example("js", 'post("ack"').replace(DOCS_GATEWAY, url))
    assert NODE is not None
    return [NODE, str(script)]


def shell_loop(url: str, tmp_path: Path) -> list[str]:
    script = tmp_path / "pull.sh"
    script.write_text(example("sh", "while :; do").replace(DOCS_GATEWAY, url))
    return ["bash", str(script)]


Loop = Callable[[str, Path], list[str]]  # the gateway's URL, a directory: its command
LOOPS = [
    pytest.param(node_loop, marks=pytest.mark.skipif(NODE is None, reason="no node")),
    pytest.param(
        shell_loop,
        marks=pytest.mark.skipif(CURL is None or JQ is None, reason="no curl or jq"),
    ),
]


async def create_group(url: str, app: str, group: str) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/apps/{app}/groups", json={"group": group}) as r,
    ):
        assert r.status == 201


async def all_acked(broker: Broker) -> bool:
    (info,) = await broker.groups.describe("orders")
    return (info.backlog, info.in_flight) == (0, 0)


@pytest.mark.parametrize("loop", LOOPS)
async def test_the_pull_loop_acks_each_batch_in_one_request(
    make_broker: BrokerFactory, tmp_path: Path, loop: Loop
) -> None:
    broker, url = await gateway(make_broker)
    acks = requests_of(broker, "ack")
    await create_group(url, "orders", "billing")
    msgids = [f"n{i:03}" for i in range(150)]
    await produce(url, "orders", *msgids)
    proc = await asyncio.create_subprocess_exec(
        *loop(url, tmp_path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(60):
            lines = [(await proc.stdout.readline()).decode() for _ in msgids]
        await eventually(lambda: all_acked(broker), timeout=30)
    finally:
        proc.kill()
        _, err = await proc.communicate()
    assert lines == [f"{m} body {m}\n" for m in msgids], err
    assert [len(body["receipts"]) for body in acks] == [100, 50]  # a batch: one request


@pytest.mark.parametrize("loop", LOOPS)
async def test_the_pull_loop_stops_with_the_brokers_error(
    make_broker: BrokerFactory, tmp_path: Path, loop: Loop
) -> None:
    """No group `billing`: the receive is refused (404), and the loop says so and stops."""
    _, url = await gateway(make_broker)
    proc = await asyncio.create_subprocess_exec(
        *loop(url, tmp_path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(30):
        out, err = await proc.communicate()
    said = err.decode()
    assert (proc.returncode, out) == (1, b""), said
    assert said.endswith("{\"error\": \"no group 'billing' for app 'orders'\"}\n"), said
    assert "404" in said and "    at " not in said, said  # the status; no stack trace


@pytest.mark.skipif(NODE is None, reason="no node")
async def test_the_node_loop_waits_for_a_broker_out_of_reach(tmp_path: Path) -> None:
    """Nothing listens there: one line a try (no stack trace), and it goes on trying."""
    proc = await asyncio.create_subprocess_exec(
        *node_loop(f"http://127.0.0.1:{free_port()}", tmp_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(30):
            tries = [await proc.stderr.readline(), await proc.stderr.readline()]
        assert proc.returncode is None  # still trying
    finally:
        proc.kill()
        await proc.communicate()
    for said in tries:
        assert said.startswith(b"receive: 0 ") and b"ECONNREFUSED" in said, said
