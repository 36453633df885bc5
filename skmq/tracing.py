"""OpenTelemetry spans (the `otel` extra), joined by the W3C traceparent a message carries.

Off (`tracer` None) until `enable()` or `from_environment()` turns it on, and nothing
from opentelemetry is imported before that: each hot path pays one None check, and the
helpers below are called only when `tracer` is set. Each hop starts its span as a child
of the traceparent it got, and hands its own span's traceparent on (into the stored
message, the push, the pulled message): send -> store -> push -> answer at the broker,
push -> receive at the recipient, store -> pull -> receive for a consumer group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import AbstractContextManager
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer, TracerProvider

tracer: Tracer | None = None

# A span's operation: its SpanKind and messaging.operation.type (OpenTelemetry's
# messaging semantic conventions; the span is named "skmq <operation>").
OPERATIONS = {
    "send": ("PRODUCER", "send"),  # a client sends (the producer)
    "store": ("CONSUMER", "receive"),  # the broker takes a message in
    "push": ("PRODUCER", "send"),  # the broker pushes it to a recipient
    "answer": ("SERVER", "settle"),  # the broker takes the recipient's answer
    "pull": ("SERVER", "receive"),  # the broker hands it to a consumer group's receive
    "receive": ("CONSUMER", "process"),  # a recipient or pull consumer gets it
}
GROUP = "messaging.consumer.group.name"  # of a `skmq pull` and a pull consumer's receive
ANSWER = "messaging.skmq.answer"  # of a `skmq answer`: ack, reject or error
# OTEL_TRACES_EXPORTER=otlp: the exporter for OTEL_EXPORTER_OTLP(_TRACES)_PROTOCOL.
OTLP = {"http/protobuf": "otlp_proto_http", "grpc": "otlp_proto_grpc"}


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard OTEL_* variables ask for traces: an exporter other than
    `none`, or an OTLP endpoint (OTEL_SDK_DISABLED=true: never)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if exporters := environ.get("OTEL_TRACES_EXPORTER", "").strip().lower():
        return exporters != "none"
    return any(
        environ.get(name)
        for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def from_environment(service: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """Trace as the OTEL_* variables say, under OTEL_SERVICE_NAME (else `service`), and
    make that the process's global tracer provider. Nothing when they ask for nothing;
    returns why not when they ask for traces that cannot be made."""
    if tracer is not None or not wanted(environ):
        return None
    try:
        enable(_provider(service, environ))
    except ImportError as exc:
        return f"OTEL_* asks for traces, but {exc.name} is not installed: pip install 'skmq[otel]'"
    except ValueError as exc:
        return str(exc)
    return None


def _provider(service: str, environ: Mapping[str, str]) -> TracerProvider:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()  # (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES)
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service}))
    provider = TracerProvider(resource=resource)  # (OTEL_TRACES_SAMPLER)
    for name in (environ.get("OTEL_TRACES_EXPORTER") or "otlp").lower().split(","):
        provider.add_span_processor(BatchSpanProcessor(_exporter(name.strip(), environ)))
    trace.set_tracer_provider(provider)
    return provider


def _exporter(name: str, environ: Mapping[str, str]) -> SpanExporter:
    """The span exporter the SDK's entry points name (its OTEL_EXPORTER_* variables are
    its own to read)."""
    if name == "otlp":
        protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
        )
        name = OTLP.get(protocol.strip(), protocol)
    found = entry_points(group="opentelemetry_traces_exporter", name=name)
    if not found:
        raise ValueError(f"OTEL_TRACES_EXPORTER: no span exporter {name!r} is installed")
    exporter: SpanExporter = next(iter(found)).load()()
    return exporter


def enable(provider: TracerProvider | None = None) -> None:
    """Make spans from now on, with `provider` (default: OpenTelemetry's global one, as
    the application set it up)."""
    global tracer
    from opentelemetry import trace

    tracer = (provider or trace.get_tracer_provider()).get_tracer("skmq")


def disable() -> None:
    global tracer
    tracer = None


def start(operation: str, parent: str | None, app: str, msgid: str, **attributes: str) -> Span:
    """A span `skmq <operation>` for message msgid of app, child of the W3C traceparent
    `parent` (None: of the current context)."""
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    assert tracer is not None
    kind, op_type = OPERATIONS[operation]
    context = TraceContextTextMapPropagator().extract({"traceparent": parent}) if parent else None
    return tracer.start_span(
        f"skmq {operation}",
        context,
        SpanKind[kind],
        {
            "messaging.system": "skmq",
            "messaging.destination.name": app,
            "messaging.message.id": msgid,
            "messaging.operation.type": op_type,
            "messaging.operation.name": operation,
            **attributes,
        },
    )


def traceparent(span: Span) -> str:
    """The W3C traceparent that makes the next hop's span a child of `span`."""
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{c.trace_flags:02x}"


def current(span: Span) -> AbstractContextManager[Span]:
    """`span` as the current span for a block (spans made in it are its children), ended
    after it, an exception recorded."""
    from opentelemetry.trace import use_span

    return use_span(span, end_on_exit=True)


def failed(span: Span, why: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, why))


def end(span: Span, why: str | None = None) -> None:
    """End `span`, failed for `why` if given."""
    if why:
        failed(span, why)
    span.end()
