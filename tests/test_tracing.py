"""OpenTelemetry spans (the `otel` extra; skmq/tracing.py): one trace from a client's send
through a real broker to a real recipient's ack, and to a pull consumer's receive; and
nothing of opentelemetry imported while tracing is off."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from skmq import tracing
from skmq.broker import Broker
from skmq.client import Consumer, Message, Producer
from skmq.pull.consumer import PullConsumer
from tests.conftest import BrokerFactory, eventually, free_port

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

APP = "traced"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """Every span of this process (client and in-process broker alike), in memory."""
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(provider)
    yield exporter
    tracing.disable()
    provider.shutdown()


def spans_by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    spans: dict[str, ReadableSpan] = {}
    for span in exporter.get_finished_spans():
        assert span.name not in spans, f"two {span.name} spans"
        spans[span.name] = span
    return spans


def assert_chain(spans: dict[str, ReadableSpan], *names: str) -> None:
    """Each span named is a child of the one before it, all in the first one's trace."""
    for parent, child in itertools.pairwise(names):
        p, c = spans[parent].context, spans[child].parent
        assert p is not None and c is not None, (parent, child)
        assert (c.trace_id, c.span_id) == (p.trace_id, p.span_id), f"{child} not of {parent}"


def assert_message(span: ReadableSpan, msgid: str, operation: str) -> None:
    attributes = dict(span.attributes or {})
    assert attributes["messaging.system"] == "skmq", span.name
    assert attributes["messaging.destination.name"] == APP, span.name
    assert attributes["messaging.message.id"] == msgid, span.name
    assert attributes["messaging.operation.name"] == operation, span.name


async def test_one_trace_from_send_to_the_ack(
    broker: Broker, exporter: InMemorySpanExporter
) -> None:
    """send -> store -> push -> the recipient's receive, and push -> the broker's answer;
    the handler runs in its receive span (spans it makes are the receive's children)."""
    from opentelemetry import trace

    handled: asyncio.Future[trace.SpanContext] = asyncio.get_running_loop().create_future()

    async def handler(msg: Message) -> None:
        handled.set_result(trace.get_current_span().get_span_context())

    port = broker.server.port
    async with (
        Consumer(APP, "r1", handler, broker_port=port),
        Producer("127.0.0.1", port) as producer,
    ):
        resp = await producer.send(APP, b"hello")
        assert resp.ok, resp
        in_handler = await asyncio.wait_for(handled, 10)

        async def answered() -> bool:
            return {"skmq answer", "skmq receive"} <= set(spans_by_name(exporter))

        await eventually(answered)
    spans = spans_by_name(exporter)
    assert set(spans) == {"skmq send", "skmq store", "skmq push", "skmq receive", "skmq answer"}
    assert_chain(spans, "skmq send", "skmq store", "skmq push", "skmq receive")
    assert_chain(spans, "skmq push", "skmq answer")
    assert in_handler == spans["skmq receive"].context
    for name, span in spans.items():
        assert_message(span, resp.msgid or "", name.removeprefix("skmq "))
    answer = spans["skmq answer"].attributes or {}
    assert answer["messaging.skmq.answer"] == "ack"


@pytest.mark.parametrize("transport", ["http", "tcp"])
async def test_one_trace_from_send_to_a_pull_consumers_receive(
    make_broker: BrokerFactory, exporter: InMemorySpanExporter, transport: str
) -> None:
    """send -> store -> pull (the broker's answer to a receive) -> the consumer's receive."""
    broker = await make_broker(http_port=free_port())
    port = broker.server.port
    where = (
        f"http://127.0.0.1:{broker.gateway.port}"
        if transport == "http"
        else f"tcp://127.0.0.1:{port}"
    )
    async with PullConsumer(where, APP, "g", wait=5) as consumer:
        async with Producer("127.0.0.1", port) as producer:
            resp = await producer.send(APP, b"hello")
        (msg,) = await consumer.receive()
        assert msg.msgid == resp.msgid
        assert await msg.ack()
    spans = spans_by_name(exporter)
    assert set(spans) == {"skmq send", "skmq store", "skmq pull", "skmq receive"}
    assert_chain(spans, "skmq send", "skmq store", "skmq pull", "skmq receive")
    for name, span in spans.items():
        assert_message(span, msgid=resp.msgid or "", operation=name.removeprefix("skmq "))
    assert (spans["skmq pull"].attributes or {})["messaging.consumer.group.name"] == "g"


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    plain = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run(
        [sys.executable, "-c", code], env={**plain, **env}, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip


# Run first in a child: opentelemetry as if not installed, and who asks for it noted.
HIDE = """
import sys
asked = set()
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != "opentelemetry":
            return None
        frame = sys._getframe(1)
        while frame.f_code.co_filename.startswith("<frozen"):
            frame = frame.f_back
        asked.add(frame.f_globals.get("__name__", "?"))
        raise ModuleNotFoundError(name=name)
sys.meta_path.insert(0, Hide())
"""
IMPORTS = "import skmq.server, skmq.client, skmq.cli.consume, skmq.cli.send, skmq.tracing\n"


def test_tracing_off_imports_nothing_of_opentelemetry() -> None:
    """Without OTEL_* variables asking for traces, no module of SKMQ's imports
    opentelemetry (redis-py itself tries to): the broker, the client and the commands
    run without it; the client alone does not load it even where it is installed."""
    code = (
        HIDE
        + IMPORTS
        + (
            "assert skmq.tracing.from_environment('skmq') is None and skmq.tracing.tracer is None\n"
            "assert not [m for m in asked if m.split('.')[0] == 'skmq'], asked\n"
        )
    )
    done = run_python(code, OTEL_TRACES_EXPORTER="none", OTEL_SERVICE_NAME="x")
    assert done.returncode == 0, done.stderr
    client = run_python(
        "import sys, skmq.client, skmq.pull.consumer, skmq.cli.send, skmq.cli.consume\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'opentelemetry']\n"
    )
    assert client.returncode == 0, client.stderr


def test_traces_asked_for_without_the_extra_say_what_to_install() -> None:
    code = (
        HIDE
        + IMPORTS
        + ("print(skmq.tracing.from_environment('skmq'))\nassert skmq.tracing.tracer is None\n")
    )
    done = run_python(code, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9")
    assert done.returncode == 0, done.stderr
    assert "pip install 'skmq[otel]'" in done.stdout, done.stdout


def test_the_environment_picks_the_exporter_and_the_service_name() -> None:
    """OTEL_TRACES_EXPORTER=console: spans of `skmq send` printed by the SDK's exporter,
    under OTEL_SERVICE_NAME (the standard setup, as for OTLP)."""
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
    code = (
        "import skmq.tracing as t\n"
        "assert t.from_environment('skmq') is None and t.tracer is not None\n"
        "t.start('send', None, 'app', 'm1').end()\n"
    )
    done = run_python(code, OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="shop")
    assert done.returncode == 0, done.stderr
    assert '"name": "skmq send"' in done.stdout and '"service.name": "shop"' in done.stdout
    unknown = run_python(
        "import skmq.tracing as t; print(t.from_environment('skmq'))", OTEL_TRACES_EXPORTER="nope"
    )
    assert "no span exporter 'nope' is installed" in unknown.stdout, unknown.stdout
