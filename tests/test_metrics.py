"""`/metrics` (Prometheus text) and `/healthz` on METRICS_PORT (the gateway serves
them too: tests/test_http.py)."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from skmq.embedded import EmbeddedRedis
from tests.conftest import BrokerFactory, eventually, free_port
from tests.peers import FakeRecipient, RawClient


async def http_get(port: int, path: str) -> tuple[int, str]:
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(f"http://127.0.0.1:{port}{path}") as response,
    ):
        return response.status, await response.text()


def sample(text: str, name: str, app: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(f'{name}{{app="{app}"}} '):
            return float(line.split()[-1])
    return None


async def test_metrics_count_per_app_and_health(make_broker: BrokerFactory) -> None:
    broker = await make_broker(metrics_port=free_port())
    port = broker.settings.metrics_port
    rec = await FakeRecipient("shop", "r1").start()
    await rec.register(broker.server.port)
    client = await RawClient.connect(broker.server.port)
    for i in range(3):
        assert (await client.request("queue", b"x", appid="shop", msgid=f"m{i}"))["status"] == "ack"
    await client.request("queue", b"x", appid="shop", msgid="m0")  # a duplicate
    await client.request("queue", b"later", appid="idle", msgid="w1", delay="60000")
    for _ in range(3):
        await rec.next_push()

    async def acked() -> bool:
        _, text = await http_get(port, "/metrics")
        return sample(text, "skmq_messages_acked_total", "shop") == 3.0

    await eventually(acked)
    status, text = await http_get(port, "/metrics")
    assert status == 200
    assert sample(text, "skmq_messages_received_total", "shop") == 4.0
    assert sample(text, "skmq_messages_stored_total", "shop") == 3.0
    assert sample(text, "skmq_messages_duplicate_total", "shop") == 1.0
    assert sample(text, "skmq_pushes_total", "shop") == 3.0
    assert sample(text, "skmq_pending_messages", "shop") == 0.0
    assert sample(text, "skmq_delayed_messages", "idle") == 1.0
    assert sample(text, "skmq_dead_letters", "shop") == 0.0
    assert 'skmq_recipients{app="shop",state="alive"} 1.0' in text
    assert 'skmq_delivery_latency_seconds_count{app="shop"} 3.0' in text
    assert (await http_get(port, "/healthz"))[0] == 200
    assert (await http_get(port, "/nope"))[0] == 404
    await client.close()
    await rec.stop()


async def test_healthz_is_503_while_redis_is_down(
    make_broker: BrokerFactory, tmp_path: Path
) -> None:
    redis = EmbeddedRedis(tmp_path / "own-redis")
    redis.start()
    port = (await make_broker(metrics_port=free_port(), redis_url=redis.url)).settings.metrics_port
    assert (await http_get(port, "/healthz"))[0] == 200
    redis.stop()
    assert (await http_get(port, "/healthz"))[0] == 503


async def test_an_app_id_that_is_not_text_is_refused_and_never_breaks_metrics(
    make_broker: BrokerFactory,
) -> None:
    """Bytes that are not UTF-8 in an appid were stored, and then every scrape failed
    (the exposition could not encode the label). They are refused now; an app stored
    before that shows escaped."""
    broker = await make_broker(metrics_port=free_port())
    client = await RawClient.connect(broker.server.port)
    client.send_raw(b"type=queue\r\nappid=\xff\r\nmsgid=u1\r\ncontent=x\r\n\r\n")
    resp = await client.resp()
    assert (resp["status"], resp["content"]) == (
        "error",
        "appid is not UTF-8 text",
    )
    await client.close()
    broker.metrics.observe("stored", b"old\xff".decode("utf-8", "surrogateescape"))
    status, text = await http_get(broker.settings.metrics_port, "/metrics")
    assert status == 200
    assert 'skmq_messages_stored_total{app="old\\\\xff"} 1.0' in text
