"""The HTTP gateway (docs/HTTP.md) over a real broker and a real HTTP client (aiohttp)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openapi_spec_validator import validate
from yarl import URL

from skmq.broker import Broker
from skmq.clock import now_ms
from skmq.config import Settings
from skmq.embedded import EmbeddedRedis
from skmq.errors import Misconfigured
from skmq.store.store import PREVIEW_BYTES
from skmq.workers.enqueue import NOT_STORED, UNAVAILABLE
from tests.conftest import FAST, BrokerFactory, eventually, free_port
from tests.openapi_check import check_response
from tests.peers import FakeRecipient

TENANT_A = "tenant-a-token-0123456789abcdef"
READER_A = "reader-a-token-0123456789abcdef"
WRONG = "not-the-token-0123456789abcdef"


async def gateway(make_broker: BrokerFactory, **settings: Any) -> tuple[Broker, str]:
    broker = await make_broker(http_port=free_port(), **settings)
    return broker, f"http://127.0.0.1:{broker.gateway.port}"


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, **headers: str
) -> tuple[int, dict[str, Any]]:
    async with http.post(url, json=body, headers=headers) as response:
        assert response.content_type == "application/json"
        return response.status, await response.json()


async def test_a_message_posted_is_stored_then_pushed(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    broker, base = await gateway(make_broker)
    rec = await FakeRecipient("shop", "r1").start()
    await rec.register(broker.server.port)
    status, body = await post(http, f"{base}/v1/apps/shop/messages", {"content": "héllo"})
    assert status == 200 and body["status"] == "stored" and len(body["msgid"]) == 32
    push = await rec.next_push()
    assert push.content == "héllo".encode() and push.fields["msgid"] == body["msgid"]
    await rec.stop()


async def test_a_batch_with_base64_duplicates_topics_and_delays(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    broker, base = await gateway(make_broker)
    raw = bytes(range(256))
    batch = {
        "messages": [
            {"msgid": "b1", "content": base64.b64encode(raw).decode(), "encoding": "base64"},
            {"msgid": "b2", "content": "t", "kind": "topic"},
            {"msgid": "b3", "content": "later", "delay": 60_000},
            {"msgid": "b1", "content": "again"},
        ]
    }
    status, body = await post(http, f"{base}/v1/apps/batch/messages", batch)
    assert status == 200
    assert body["results"] == [
        {"msgid": "b1", "status": "stored"},
        {"msgid": "b2", "status": "stored"},
        {"msgid": "b3", "status": "stored"},
        {"msgid": "b1", "status": "duplicate"},
    ]
    store = broker.store
    waiting = {w.msgid: w for w in await store.peek("batch", 10, now_ms())}
    assert (waiting["b1"].size, waiting["b1"].preview) == (256, raw[:PREVIEW_BYTES])
    assert set(waiting) == {"b1", "b2", "b3"} and waiting["b3"].due_ms > now_ms()
    counts = (await store.counts(["batch"], now_ms()))["batch"]
    assert (counts.pending, counts.delayed) == (2, 1)


async def test_ttl_and_ordering_keys_as_over_tcp_and_the_apps_ttl_by_default(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    broker, base = await gateway(make_broker, ttl_by_app={"ttl": 1})
    rec = await FakeRecipient("ttl", "r1").start()
    await rec.register(broker.server.port)
    batch = {
        "messages": [  # each due 100 ms on: after a TTL of 1 ms
            {"msgid": "own-ttl", "content": "x", "ttl": 1, "delay": 100},
            {"msgid": "apps-ttl", "content": "x", "delay": 100},
            {"msgid": "no-ttl", "content": "x", "ttl": 0, "delay": 100, "key": "k1"},
        ]
    }
    assert (await post(http, f"{base}/v1/apps/ttl/messages", batch))[0] == 200
    push = await rec.next_push()
    assert push.fields["msgid"] == "no-ttl"

    async def expired() -> bool:
        dead = await broker.store.dead_letters("ttl")
        return sorted((d.msgid, d.last_error[:7]) for d in dead) == [
            ("apps-ttl", "expired"),
            ("own-ttl", "expired"),
        ]

    await eventually(expired)
    await rec.stop()


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        ({"content": 5}, 400, "content: Input should be a valid string"),
        ({"content": "x", "colour": "red"}, 400, "colour: Extra inputs are not permitted"),
        ({"content": "x", "kind": "fanout"}, 400, "kind: Input should be 'queue' or 'topic'"),
        ({"content": "x", "delay": -1}, 400, "delay: Input should be greater than or equal to 0"),
        ({"content": "x", "ttl": -1}, 400, "ttl: Input should be greater than or equal to 0"),
        ({"content": "x", "delay": 10**309}, 400, "delay reaches at most"),
        ({"content": "x", "ttl": 3650 * 86_400_000 + 1}, 400, "(MAX_TTL)"),
        ({"content": "x", "key": "k\x01"}, 400, "key holds a control character"),
        ({"content": "x", "key": "k", "kind": "topic"}, 400, "applies to queue messages only"),
        ({"content": "x", "msgid": "a\x01b"}, 400, "msgid holds a control character"),
        ({"content": "x", "msgid": "m" * 257}, 400, "msgid: String should have at most 256"),
        ({"content": "%%", "encoding": "base64"}, 400, "content: not valid base64"),
        ({"content": "x" * 70_000}, 413, "content: 70000 bytes, over 61440 (MAX_FRAME_BYTES"),
        ({"messages": []}, 400, "messages: List should have at least 1 item"),
        ({"messages": [{"content": "x"}] * 11}, 413, "11 messages: at most 10 a batch"),
        ([1, 2], 400, "Input should be a valid dictionary"),
    ],
)
async def test_invalid_produce_requests_are_refused_and_store_nothing(
    make_broker: BrokerFactory,
    http: aiohttp.ClientSession,
    body: Any,
    status: int,
    error: str,
) -> None:
    broker, base = await gateway(make_broker, http_max_batch=10)
    got, answer = await post(http, f"{base}/v1/apps/bad/messages", body)
    assert (got, error in answer["error"]) == (status, True), answer
    assert await broker.store.redis.hlen(broker.store.base("bad") + "msgs") == 0


async def test_bodies_and_routes_outside_the_api_get_json_errors(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    _, base = await gateway(make_broker, http_max_body_bytes=2048)
    url = f"{base}/v1/apps/a/messages"
    async with http.post(url, data=b"{not json", headers={"Content-Type": "application/json"}) as r:
        assert (r.status, await r.json()) == (400, {"error": "body is not valid JSON"})
    async with http.post(url, data=b"x", headers={"Content-Type": "text/plain"}) as r:
        assert r.status == 415 and "application/json" in (await r.json())["error"]
    async with http.post(url, json={"content": "x" * 4096}) as r:
        assert r.status == 413 and "error" in await r.json()
    async with http.get(f"{base}/nope") as r:
        assert (r.status, await r.json()) == (404, {"error": "not found"})
    async with http.delete(url) as r:  # (GET is a peek: skmq/http/console.py)
        assert r.status == 405 and set(r.headers["Allow"].split(",")) == {"GET", "HEAD", "POST"}
        assert (await r.json())["error"] == "method not allowed"
    bad_app = f"{base}/v1/apps/a%01b/messages"
    async with http.post(bad_app, json={"content": "x"}) as r:
        assert (r.status, await r.json()) == (400, {"error": "appid holds a control character"})


@pytest.fixture
def auth_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.toml"
    path.write_text(
        f'[[tokens]]\nname = "a"\ntoken = "{TENANT_A}"\napps = ["a"]\nroles = ["produce"]\n'
        f'[[tokens]]\nname = "r"\ntoken = "{READER_A}"\napps = ["a"]\nroles = ["consume"]\n'
    )
    return path


async def test_bearer_tokens_with_the_roles_of_the_auth_file(
    make_broker: BrokerFactory, http: aiohttp.ClientSession, auth_file: Path
) -> None:
    broker, base = await gateway(make_broker, auth_file=auth_file)
    msg = {"content": "x"}
    status, body = await post(http, f"{base}/v1/apps/a/messages", msg)
    assert status == 401 and body["error"].startswith("authentication required")
    for header in (f"Bearer {WRONG}", f"Basic {TENANT_A}"):
        status, _ = await post(http, f"{base}/v1/apps/a/messages", msg, Authorization=header)
        assert status == 401
    status, body = await post(
        http, f"{base}/v1/apps/b/messages", msg, Authorization=f"Bearer {TENANT_A}"
    )
    assert (status, body["error"]) == (
        403,
        "not allowed: this token lacks the produce role for app 'b'",
    )
    status, _ = await post(
        http, f"{base}/v1/apps/a/messages", msg, Authorization=f"Bearer {READER_A}"
    )
    assert status == 403
    status, body = await post(
        http, f"{base}/v1/apps/a/messages", msg, Authorization=f"bearer {TENANT_A}"
    )
    assert (status, body["status"]) == (200, "stored")
    counts = await broker.store.counts(["a", "b"], now_ms())
    assert (counts["a"].pending, counts["b"].pending) == (1, 0)


async def test_openapi_document_is_valid_and_names_every_route(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    _, base = await gateway(make_broker)
    async with http.get(f"{base}/openapi.json") as r:
        doc = await r.json()
    validate(doc)
    assert set(doc["paths"]) == {
        "/v1/apps/{app}/messages",
        "/v1/apps/{app}/groups",
        "/v1/apps/{app}/groups/{group}",
        *(f"/v1/apps/{{app}}/groups/{{group}}/{verb}"
          for verb in ("receive", "ack", "nack", "extend", "reset")),
        "/v1/apps/{app}/dlq",
        "/v1/apps/{app}/dlq/replay",
        "/v1/apps/{app}/dlq/purge",
        "/v1/recipients",
        "/v1/apps/{app}/recipients/{id}",
        "/v1/connections",
        "/v1/apps",
        "/v1/apps/{app}/purge",
        "/metrics",
        "/healthz",
        "/openapi.json",
    }  # fmt: skip
    message = doc["components"]["schemas"]["OutgoingMessage"]
    assert message["properties"]["kind"]["enum"] == ["queue", "topic"]
    assert message["additionalProperties"] is False


@pytest.mark.parametrize(
    ("method", "path", "status", "body", "why"),
    [
        # the answers the document once had wrong: createGroup's 201 was not in it, and
        # deleteGroup's and resetGroup's answers were checked against request schemas
        ("POST", "/v1/apps/a/groups", 202, {"group": "g", "created": True}, "202"),
        ("DELETE", "/v1/apps/a/groups/g", 200, {"group": "g"}, "deleted"),
        ("POST", "/v1/apps/a/groups/g/reset", 200, {"group": "g", "position": "x"}, "position"),
        ("POST", "/v1/apps/a/groups/g/ack", 404, {"no": "error"}, "error"),
        ("POST", "/v1/apps/a/groups/g/ack", 200, {"results": [{"receipt": "r"}]}, "status"),
    ],
)
def test_the_openapi_check_refuses_an_answer_the_document_does_not_describe(
    method: str, path: str, status: int, body: dict[str, Any], why: str
) -> None:
    """The check every HTTP test's client makes (tests/openapi_check.py) can fail."""
    url = URL(f"http://127.0.0.1:1735{path}")
    with pytest.raises(AssertionError, match=why):
        check_response(method, url, status, "application/json", json.dumps(body).encode())


def test_the_openapi_check_passes_the_documented_group_answers() -> None:
    for method, path, status, body in (
        ("POST", "/v1/apps/a/groups", 201, {"group": "g", "created": True}),
        ("POST", "/v1/apps/a/groups", 200, {"group": "g", "created": False}),
        ("DELETE", "/v1/apps/a/groups/g", 200, {"group": "g", "deleted": True}),
        ("POST", "/v1/apps/a/groups/g/reset", 200, {"group": "g", "position": "earliest"}),
        ("POST", "/v1/apps/a/groups/g/nack", 404, {"error": "no group 'g' for app 'a'"}),
        ("GET", "/nowhere", 404, {"error": "not found"}),  # outside the document: unchecked
    ):
        url = URL(f"http://127.0.0.1:1735{path}")
        check_response(method, url, status, "application/json", json.dumps(body).encode())


async def test_metrics_and_healthz_are_served_by_the_gateway(
    make_broker: BrokerFactory, http: aiohttp.ClientSession
) -> None:
    _, base = await gateway(make_broker)
    await post(http, f"{base}/v1/apps/m/messages", {"content": "x"})
    async with http.get(f"{base}/metrics") as r:
        assert r.status == 200 and r.content_type == "text/plain"
        assert 'skmq_messages_stored_total{app="m"} 1.0' in await r.text()
    async with http.get(f"{base}/healthz") as r:
        assert (r.status, await r.text()) == (200, "ok\n")


async def test_store_unavailable_is_503_and_the_gateway_keeps_serving(
    make_broker: BrokerFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    redis = EmbeddedRedis(tmp_path / "own-redis")
    redis.start()
    _, base = await gateway(make_broker, redis_url=redis.url, store_timeout=0.5)
    redis.stop()
    async with http.post(f"{base}/v1/apps/x/messages", json={"content": "x"}) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        # (the owner engine's connection is closed before the write: certainly not stored)
        assert (await r.json())["error"] in (UNAVAILABLE, NOT_STORED)
    async with http.get(f"{base}/healthz") as r:
        assert r.status == 503


async def start_refused(settings: Settings) -> str:
    """The one-line refusal of a broker that must not start (stopped again either way)."""
    broker = Broker(settings)
    try:
        with pytest.raises(Misconfigured) as refused:
            await broker.start()
    finally:
        if hasattr(broker, "server"):
            await broker.stop()
    return str(refused.value)


async def test_a_gateway_port_the_broker_uses_already_is_refused(
    redis_server: EmbeddedRedis, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """(The broker reaches the session's Redis by its unix socket: the server's TCP port
    counts as an address it uses too. HTTP_PORT equal to PORT is a bad setting, refused
    before anything starts: tests/test_cli_ops.py.)"""
    http_port = redis_server.port
    settings = Settings(
        **{**FAST, "port": free_port(), "http_port": http_port},
        redis_url=redis_url,
        key_prefix=prefix,
        data_dir=tmp_path / "data",
    )
    assert await start_refused(settings) == (
        f"HTTP_PORT {http_port} is an address the broker uses already "
        "(its Redis, PORT or METRICS_PORT)"
    )


async def test_http_port_zero_turns_the_gateway_off(make_broker: BrokerFactory) -> None:
    broker = await make_broker(http_port=0)
    assert broker.gateway.port is None


def test_documented_curl_bodies_are_valid_json() -> None:
    text = (Path(__file__).parent.parent / "docs" / "HTTP.md").read_text()
    bodies = [part.partition("'")[0] for part in text.split("-d '")[1:]]
    assert bodies
    for body in bodies:
        json.loads(body)
