"""OpenTelemetry tracing: one trace per request across gateway -> scheduler -> worker.

Off unless an OTLP endpoint is configured, by `--otlp-endpoint URL` or the standard
OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT variables (OTLP over HTTP/protobuf;
OTEL_SDK_DISABLED=true wins over both). When off, `tracer()` is None and no span code runs.

Context travels as W3C `traceparent` in gRPC metadata from the gateway to the scheduler, and in
the Assignment's `trace_context` map from the scheduler to the worker (one stream carries every
request, so per-request metadata cannot). Spans that cover work already done (queueing, prefill,
decode) are created when the request ends, with their recorded start and end times: nothing is
traced inside the worker's step.
"""

from __future__ import annotations

import os

from opentelemetry import propagate, trace
from opentelemetry.context import Context

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def configure_tracing(service_name: str, otlp_endpoint: str | None = None) -> bool:
    """Install an OTLP-exporting tracer provider if an endpoint is configured; True if tracing is on.

    --otlp-endpoint takes the collector's base URL (http://host:4318) or the full traces URL.
    """
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    if not otlp_endpoint and not any(os.environ.get(v) for v in _ENDPOINT_VARS):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    endpoint = None
    if otlp_endpoint:
        endpoint = otlp_endpoint if otlp_endpoint.rstrip("/").endswith("/v1/traces") else \
            otlp_endpoint.rstrip("/") + "/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    # Batched: spans leave from a background thread, never from a request's path.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    return True


def tracer(name: str) -> trace.Tracer | None:
    """The tracer for a service, or None while no provider is installed (tracing off). Checked with the
    API's own classes, so a process with tracing off never imports the SDK."""
    if isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    return trace.get_tracer(name)


def inject_context(span: trace.Span | None = None) -> dict[str, str]:
    """The current (or the given span's) trace context as W3C headers."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span) if span is not None else None)
    return carrier


def extract_context(carrier) -> Context:
    """A parent context from W3C headers: a dict, or gRPC metadata as (key, value) pairs."""
    if not isinstance(carrier, dict):
        carrier = {k: v for k, v in (carrier or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def ns(seconds: float) -> int:
    """time.time() seconds -> the nanoseconds OpenTelemetry takes."""
    return int(seconds * 1e9)
