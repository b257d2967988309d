"""OpenTelemetry request spans, shared by `serve` (`--otlp-traces-endpoint`) and `launch` (`--otlp-endpoint`).

One span per request, made when it finishes: named `llm_request` and carrying vLLM's attribute names
(gen_ai.* usage, request options and latency breakdown). Its start is the request's arrival, and a W3C
`traceparent` header the client sent makes it a child of the client's span. The SDK is the optional
`[otel]` extra; nothing here is imported unless a flag asks for tracing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"
_incoming_headers: ContextVar[dict[str, str]] = ContextVar("incoming_trace_headers", default={})  # noqa: B039


@dataclass
class RequestTiming:
    """A finished request's times (time.monotonic seconds) and sizes."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float
    prompt_tokens: int
    completion_tokens: int
    finish_reasons: Sequence[str]


class RequestTracer:
    """Records finished requests as spans on an OpenTelemetry tracer."""

    def __init__(self, tracer, provider=None) -> None:
        self.tracer, self.provider = tracer, provider

    def record(self, request_id: str, model: str, timing: RequestTiming, options: Mapping[str, object]) -> None:
        """One span for one request; `options` are gen_ai.request.* values (max_tokens, temperature, ...)."""
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(_incoming_headers.get())
        to_epoch_ns = time.time_ns() - time.monotonic_ns()
        first_token = timing.first_token if timing.first_token is not None else timing.finished
        attributes = {
            "gen_ai.request.id": request_id,
            "gen_ai.response.model": model,
            "gen_ai.usage.prompt_tokens": timing.prompt_tokens,
            "gen_ai.usage.completion_tokens": timing.completion_tokens,
            "gen_ai.response.finish_reasons": list(timing.finish_reasons),
            "gen_ai.latency.time_to_first_token": first_token - timing.arrival,
            "gen_ai.latency.e2e": timing.finished - timing.arrival,
            "gen_ai.latency.time_in_model_decode": timing.finished - first_token,
            **{f"gen_ai.request.{name}": value for name, value in options.items() if value is not None},
        }
        if timing.first_scheduled is not None:  # a backend that does not report scheduling leaves these out
            attributes["gen_ai.latency.time_in_queue"] = timing.first_scheduled - timing.arrival
            attributes["gen_ai.latency.time_in_model_prefill"] = first_token - timing.first_scheduled
            attributes["gen_ai.latency.time_in_model_inference"] = timing.finished - timing.first_scheduled
        span = self.tracer.start_span(
            SPAN_NAME,
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=int(timing.arrival * 1e9) + to_epoch_ns,
        )
        span.end(end_time=int(timing.finished * 1e9) + to_epoch_ns)

    def shutdown(self) -> None:
        """Flush the spans still batched (call once the server has drained)."""
        if self.provider is not None:
            self.provider.shutdown()


def otlp_tracer(endpoint: str, service_name: str) -> RequestTracer:
    """A tracer exporting over OTLP to `endpoint`: gRPC unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (or
    OTEL_EXPORTER_OTLP_PROTOCOL) says http/protobuf, as the OpenTelemetry SDK's own variables do."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as error:
        raise RuntimeError(
            "tracing needs the OpenTelemetry SDK: pip install 'paged-backend[otel]' (or drop the OTLP flag)"
        ) from error
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol in (None, "", "grpc"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise RuntimeError(f"OTLP protocol {protocol!r} is not supported; use grpc or http/protobuf")
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    # The SDK retries an export for 10 s; at shutdown, with no collector, that held the exit well past the drain.
    # Its own variables still win.
    timeout = None if any(name in os.environ for name in TIMEOUT_VARIABLES) else EXPORT_TIMEOUT_S
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=timeout)))
    return RequestTracer(provider.get_tracer("paged_backend"), provider)


EXPORT_TIMEOUT_S = 2.0
TIMEOUT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")


class TraceHeaders:
    """Pure ASGI middleware: keeps the request's W3C trace headers where `RequestTracer.record` finds them."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {}
        for name, value in scope["headers"]:
            key = name.decode("latin-1").lower()
            if key in TRACE_HEADERS:
                headers[key] = value.decode("latin-1")
        token = _incoming_headers.set(headers)
        try:
            await self.app(scope, receive, send)
        finally:
            _incoming_headers.reset(token)
