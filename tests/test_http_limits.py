"""Hostile HTTP clients against a real gateway (docs/HTTP.md, docs/SECURITY.md): deep
JSON, bodies cut short or never finished, slow headers, too many connections, app ids
that are not text; each answered with a JSON error, none with a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
import time
import zlib
from typing import Any

import aiohttp
import yarl

from tests.conftest import BrokerFactory, BrokerProcess, eventually, free_port
from tests.peers import RawClient
from tests.test_http import gateway

JSON_ROUTES = [
    "/v1/apps/h1/messages",
    "/v1/apps/h1/groups",
    "/v1/apps/h1/groups/g/receive",
    "/v1/apps/h1/groups/g/ack",
    "/v1/apps/h1/groups/g/reset",
    "/v1/apps/h1/dlq/replay",
    "/v1/apps/h1/dlq/purge",
]


async def post_raw(
    http: aiohttp.ClientSession, url: str, data: bytes | str, *, last: bool = False
) -> tuple[int, dict[str, Any]]:
    """POST `data` as JSON; `last`: the connection is not kept for another request."""
    headers = {"Content-Type": "application/json"}
    if last:
        headers["Connection"] = "close"
    async with http.post(url, data=data, headers=headers) as response:
        assert response.content_type == "application/json"
        return response.status, await response.json()


async def read_until_closed(reader: asyncio.StreamReader, timeout: float) -> tuple[bytes, float]:
    """All the peer sends until it closes, and how long that took (bounded)."""
    start = time.monotonic()
    async with asyncio.timeout(timeout):
        data = await reader.read()
    return data, time.monotonic() - start


def json_error(answer: bytes) -> tuple[int, str]:
    """The status and `error` of one raw HTTP answer with a JSON body."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return int(head.split()[1]), json.loads(body)["error"]


# -- JSON bodies ------------------------------------------------------------------
async def test_deeply_nested_json_is_refused_on_every_route(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    _, base = await gateway(make_broker)
    for route in JSON_ROUTES:
        status, body = await post_raw(http, base + route, "[" * 100_000)
        assert (status, body) == (400, {"error": "body is nested too deeply"}), route
    # Nesting the parser takes is refused by the request's schema, as any other shape.
    status, body = await post_raw(http, base + JSON_ROUTES[0], "[" * 200 + "]" * 200)
    assert status == 400 and "body" in body["error"]


async def test_app_ids_that_are_not_unicode_text_are_refused(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    broker, base = await gateway(make_broker)
    url = f"{base}/v1/apps/X/dlq/replay"
    status, body = await post_raw(http, url, json.dumps({"to_app": ""}))
    assert (status, body) == (400, {"error": "to_app required"})
    for lone in ("\udcff", "\ud800"):  # JSON holds them as \u escapes (ensure_ascii)
        status, body = await post_raw(http, url, json.dumps({"to_app": lone}))
        assert status == 400
        assert body["error"] == "to_app is not UTF-8 text"
        status, body = await post_raw(
            http, f"{base}/v1/apps/a/messages", json.dumps({"content": "x" + lone})
        )
        assert status == 400 and "content: holds a lone surrogate" in body["error"]
    # A path's escapes are decoded as UTF-8 or refused: `a%FF` is no app, and is not
    # taken for the app `a%FF` (which `a%25FF` names).
    for path, expected in [
        ("%ED%A0%80", None), ("a%FF", None), ("a%25FF", "a%FF"), ("%C3%A9", "é")
    ]:  # fmt: skip
        url = yarl.URL(f"{base}/v1/apps/{path}/messages", encoded=True)
        status, body = await post_raw(http, str(url), '{"content": "x"}')
        if expected is None:
            assert (status, body) == (400, {"error": "appid is not UTF-8 text"}), path
        else:
            assert status == 200, (path, body)
    assert sorted(await broker.store.apps()) == ["a%FF", "é"]
    async with http.get(f"{base}/metrics") as response:
        assert response.status == 200


async def test_a_body_in_an_encoding_not_decoded_here_is_415(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    """gzip and deflate are decoded; an encoding aiohttp would take for none (or
    needs a package this install lacks) is refused as JSON, not read as plain JSON."""
    _, base = await gateway(make_broker)
    url = f"{base}/v1/apps/enc/messages"
    body = json.dumps({"content": "x"}).encode()
    headers = {"Content-Type": "application/json"}
    for encoding, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        async with http.post(url, data=data, headers={**headers, "Content-Encoding": encoding}
                             ) as response:  # fmt: skip
            assert response.status == 200, encoding
    for encoding in ("foo", "compress", "x-gzip"):
        async with http.post(url, data=body, headers={**headers, "Content-Encoding": encoding}
                             ) as response:  # fmt: skip
            assert response.status == 415, encoding
            assert "Content-Encoding" in (await response.json())["error"]


# -- bodies and headers that never finish -------------------------------------------
async def test_a_body_not_complete_within_frame_timeout_is_408(
    make_broker: BrokerFactory,
) -> None:
    broker, _ = await gateway(make_broker, frame_timeout=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", broker.gateway.port)
    writer.write(
        b"POST /v1/apps/a/messages HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    )
    data, took = await read_until_closed(reader, 20)
    assert json_error(data) == (408, "body not complete within FRAME_TIMEOUT (0.5 s)")
    assert took < 15  # FRAME_TIMEOUT, then aiohttp's lingering (10 s) at most
    writer.close()


async def test_a_body_announced_over_the_limit_is_413_before_it_is_sent(
    make_broker: BrokerFactory,
) -> None:
    """Content-Length over HTTP_MAX_BODY_BYTES is answered at once on every route, with
    `Expect: 100-continue` too, not once the body came (or FRAME_TIMEOUT ran out)."""
    broker, _ = await gateway(make_broker, http_max_body_bytes=2048, frame_timeout=60)
    cases = [(route, b"") for route in JSON_ROUTES]
    for route, expect in [*cases, (JSON_ROUTES[0], b"Expect: 100-continue\r\n")]:
        reader, writer = await asyncio.open_connection("127.0.0.1", broker.gateway.port)
        writer.write(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 9437184\r\n%s\r\n{}" % (route.encode(), expect)
        )
        async with asyncio.timeout(10):
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"HTTP/1.1 100"):  # (then the final answer)
                head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
        assert json_error(head + body) == (413, "request entity too large"), route
        writer.close()


async def test_slow_headers_and_idle_keepalive_are_closed(make_broker: BrokerFactory) -> None:
    """A header line at a time, each well within FRAME_TIMEOUT: the connection is still
    closed FRAME_TIMEOUT after it opened; an idle connection too."""
    broker, _ = await gateway(make_broker, frame_timeout=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", broker.gateway.port)
    start = time.monotonic()
    writer.write(b"GET /healthz HTTP/1.1\r\n")
    async with asyncio.timeout(10):
        while not reader.at_eof():
            writer.write(b"X-Slow: 1\r\n")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    assert await reader.read(1) == b""
    assert time.monotonic() - start < 5
    writer.close()
    idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", broker.gateway.port)
    data, _ = await read_until_closed(idle_reader, 10)
    assert data == b""
    idle_writer.close()


async def test_a_long_poll_outlives_frame_and_idle_timeouts(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    _, base = await gateway(make_broker, frame_timeout=0.3, idle_timeout=0.3)
    # Not kept alive: the broker closes an idle one after 0.3 s, and a loaded machine can
    # take that long to send the next request (which would then meet a reset).
    status, _ = await post_raw(http, f"{base}/v1/apps/lp/groups", '{"group": "g"}', last=True)
    assert status == 201
    start = time.monotonic()
    status, body = await post_raw(http, f"{base}/v1/apps/lp/groups/g/receive", '{"wait": 1.2}')
    assert (status, body) == (200, {"messages": []})
    assert time.monotonic() - start >= 1.0


# -- connection limits --------------------------------------------------------------
async def test_http_connections_count_against_the_connection_limits(
    make_broker: BrokerFactory,
) -> None:
    broker, _ = await gateway(make_broker, max_connections_per_host=3)
    port = broker.gateway.port
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]

    async def counted(n: int) -> bool:
        return broker.server.admission.per_host["127.0.0.1"] == n

    await eventually(lambda: counted(2))
    tcp = await RawClient.connect(broker.server.port)  # the third: the broker port's
    tcp.send_raw(b"ping\r\n\r\n")
    assert (await tcp.recv()).type == "pong"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data, _ = await read_until_closed(reader, 10)
    status, error = json_error(data)
    assert status == 503 and "MAX_CONNECTIONS_PER_HOST" in error
    writer.close()
    # The broker port refuses too: HTTP connections hold two of the three.
    extra = await RawClient.connect(broker.server.port)
    resp = await extra.resp()
    assert resp["status"] == "error" and "MAX_CONNECTIONS_PER_HOST" in resp["content"]
    await extra.closed()
    held[0][1].close()
    await eventually(lambda: counted(2))
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/openapi.json") as response,
    ):
        assert response.status == 200
    for _, w in held[1:]:
        w.close()
    await tcp.close()
    await extra.close()


async def test_max_connections_bounds_http_alone(make_broker: BrokerFactory) -> None:
    broker, _ = await gateway(make_broker, max_connections=2)
    port = broker.gateway.port
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]

    async def both_counted() -> bool:
        return broker.server.admission.total == 2

    await eventually(both_counted)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data, _ = await read_until_closed(reader, 10)
    assert json_error(data) == (503, "too many connections (MAX_CONNECTIONS)")
    # A client that sends its whole request before it reads still gets the 503: the
    # refused connection is read (and its bytes dropped) until it closes, not reset.
    loop = asyncio.get_running_loop()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setblocking(False)
        body = b"x" * (4 << 20)
        head = f"POST /v1/apps/a/messages HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n"
        await asyncio.wait_for(loop.sock_sendall(sock, head.encode() + body), 30)
        sock.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(sock, 65536), 30):
            got += chunk
    assert got.startswith(b"HTTP/1.1 503"), got[:200]
    for _, w in [*held, (reader, writer)]:
        w.close()


# -- the log ------------------------------------------------------------------------
HOSTILE_HTTP = [
    b"GARBAGE\r\n\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
    b"POST /v1/apps/a/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/apps/a/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"POST /v1/apps/a/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Encoding: gzip\r\nContent-Length: 5\r\n\r\nabcde",
    b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: 5\r\n"
    b"\r\nabcde",
    b"POST /v1/apps/a/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: " + b"[" * 5 + b"\r\n\r\n",
    b"POST /v1/apps/a/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100000\r\n\r\n" + b"[" * 100_000,
]


def test_hostile_http_leaves_no_traceback_in_the_log(broker_process: BrokerProcess) -> None:
    http_port = free_port()
    broker_process.env["SKMQ_HTTP_PORT"] = str(http_port)
    broker_process.start()
    for request in HOSTILE_HTTP:
        with socket.create_connection(("127.0.0.1", http_port), timeout=15) as sock:
            sock.sendall(request)
            assert sock.recv(65536).startswith(b"HTTP/1."), request[:60]
    # A body declared huge, the client gone after its first bytes.
    with socket.create_connection(("127.0.0.1", http_port), timeout=15) as sock:
        sock.sendall(
            b"POST /v1/apps/a/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b'\r\nContent-Length: 99999999999\r\n\r\n{"con'
        )
    # Still served, and nothing in the log but its start.
    with socket.create_connection(("127.0.0.1", http_port), timeout=15) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    log = broker_process.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "[error" not in log, log[-3000:]
