"""OpenTelemetry request spans from `serve` and `launch`: one `llm_request` span per request with vLLM's
attribute names, continuing the client's W3C `traceparent`; the in-memory exporter, a real OTLP/HTTP
receiver (oteltap) and a gRPC TraceService from OTLP's own proto, both fed by the real OTLP exporters. The
command-line flags of both faces are tested end to end in tests/test_operate_live.py."""

from __future__ import annotations

import asyncio

import openai
import pytest
from text_generation import Client

from paged_backend.config import CacheConfig, EngineConfig, SchedulerConfig
from paged_backend.engine import Engine
from paged_backend.server.app import build_app
from paged_backend.server.state import ServerSettings

otel_sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="the [otel] extra is not installed")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: E402

from paged_backend.observability.tracing import RequestTracer  # noqa: E402
from paged_backend.tgi.backends.paged import PagedBackend  # noqa: E402
from paged_backend.tgi.http.app import create_app  # noqa: E402
from paged_backend.tgi.http.settings import RouterSettings  # noqa: E402
from paged_backend.worker.default_model import TINY_MODEL as MODEL  # noqa: E402
from tests._tgi_helpers import free_port, serving_in_thread  # noqa: E402

LATENCIES = ("time_to_first_token", "e2e", "time_in_model_decode")
SCHEDULED = ("time_in_queue", "time_in_model_prefill", "time_in_model_inference")


def make_engine() -> Engine:
    return Engine(
        EngineConfig(
            model=MODEL, device="cpu", cache=CacheConfig(num_blocks=64), scheduler=SchedulerConfig(max_model_len=256)
        )
    )


def in_memory_tracer() -> tuple[RequestTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestTracer(provider.get_tracer("test"), provider), exporter


def client_span():
    """A client-side span and the W3C headers that carry it."""
    provider = TracerProvider()
    span = provider.get_tracer("client").start_span("client call")
    headers: dict[str, str] = {}
    from opentelemetry import trace

    TraceContextTextMapPropagator().inject(headers, context=trace.set_span_in_context(span))
    return span.get_span_context(), headers


def check_span(span, parent, prompt_tokens: int | None, completion_tokens: int, finish: str, scheduled: bool) -> None:
    assert span.name == "llm_request"
    assert span.parent is not None and span.parent.span_id == parent.span_id
    assert span.context.trace_id == parent.trace_id
    attributes = span.attributes
    assert attributes["gen_ai.usage.completion_tokens"] == completion_tokens
    if prompt_tokens is not None:
        assert attributes["gen_ai.usage.prompt_tokens"] == prompt_tokens
    assert tuple(attributes["gen_ai.response.finish_reasons"]) == (finish,)
    assert attributes["gen_ai.request.max_tokens"] == completion_tokens
    for name in LATENCIES + (SCHEDULED if scheduled else ()):
        assert attributes[f"gen_ai.latency.{name}"] >= 0, name
    assert attributes["gen_ai.latency.e2e"] >= attributes["gen_ai.latency.time_to_first_token"]
    assert span.end_time - span.start_time == pytest.approx(attributes["gen_ai.latency.e2e"] * 1e9, rel=0.05, abs=2e6)


def test_serve_spans_continue_the_client_trace():
    tracer, exporter = in_memory_tracer()
    with serving_in_thread(build_app(make_engine(), ServerSettings(), tracer=tracer)) as url:
        parent, headers = client_span()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", default_headers=headers, max_retries=0)
        completion = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4,
                                               temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        assert sum(1 for _ in stream) > 0
    spans = exporter.get_finished_spans()
    assert len(spans) == 2
    assert completion.usage.completion_tokens == 4
    check_span(spans[0], parent, 3, 4, "length", scheduled=True)
    check_span(spans[1], parent, None, 3, "length", scheduled=True)
    assert spans[0].attributes["gen_ai.response.model"] == MODEL
    assert spans[0].attributes["gen_ai.request.temperature"] == 0


def test_launch_spans_continue_the_client_trace():
    tracer, exporter = in_memory_tracer()
    settings = RouterSettings(max_input_tokens=127, max_total_tokens=128, api_key=None)
    with serving_in_thread(create_app(PagedBackend(make_engine()), settings, drain_timeout=5, tracer=tracer)) as url:
        parent, headers = client_span()
        client = Client(url, headers=headers, timeout=60)
        response = client.generate("Hello", max_new_tokens=5, decoder_input_details=False)
        streamed = list(client.generate_stream("Hello", max_new_tokens=3))
    spans = exporter.get_finished_spans()
    assert len(spans) == 2
    assert response.details.generated_tokens == 5 and len(streamed) == 3
    check_span(spans[0], parent, None, 5, "length", scheduled=False)
    check_span(spans[1], parent, None, 3, "length", scheduled=False)


def test_serve_exports_over_otlp_to_a_real_receiver(monkeypatch):
    """The real OTLP/HTTP exporter (as `--otlp-traces-endpoint` makes it) into a real receiver."""
    oteltap = pytest.importorskip("oteltap", reason="the oteltap OTLP receiver is not installed (pip install oteltap)")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    port = free_port()
    settings = ServerSettings(otlp_traces_endpoint=f"http://127.0.0.1:{port}/v1/traces")

    async def run() -> object:
        receiver_settings = oteltap.OtelTapHttpProtobufReceiverSettings(http_port=port)
        async with oteltap.OtelTapHttpProtobufReceiver(receiver_settings) as receiver:
            parent, headers = client_span()
            app = build_app(make_engine(), settings)
            with serving_in_thread(app) as url:
                client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", default_headers=headers)
                await client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2,
                                                extra_body={"ignore_eos": True})  # fmt: skip
            # Leaving the server ran its shutdown, which flushed the batched span to the receiver.
            span = await receiver.await_trace(lambda s: s.name == "llm_request", timeout=30)
            return span, parent

    span, parent = asyncio.run(run())
    assert span.trace_id == parent.trace_id.to_bytes(16, "big")
    assert span.parent_span_id == parent.span_id.to_bytes(8, "big")
    attributes = {a.key: a.value for a in span.attributes}
    assert attributes["gen_ai.usage.completion_tokens"].int_value == 2
    assert attributes["gen_ai.usage.prompt_tokens"].int_value == 2
    assert attributes["gen_ai.latency.e2e"].double_value > 0


def test_an_unknown_otlp_protocol_is_named(monkeypatch):
    from paged_backend.observability.tracing import otlp_tracer

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(RuntimeError, match="OTLP protocol 'http/json' is not supported; use grpc or http/protobuf"):
        otlp_tracer("http://127.0.0.1:4318/v1/traces", "paged-backend")


def test_serve_exports_over_otlp_grpc_by_default(monkeypatch):
    """The default protocol (gRPC, as vLLM's) on the wire, into a TraceService built from OTLP's own proto."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def __init__(self) -> None:
            self.spans = []

        def Export(self, request, context):  # noqa: N802 (the proto's name)
            self.spans += [span for resource in request.resource_spans for scope in resource.scope_spans
                           for span in scope.spans]  # fmt: skip
            return trace_service_pb2.ExportTraceServiceResponse()

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    collector, server = Collector(), grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        settings = ServerSettings(otlp_traces_endpoint=f"http://127.0.0.1:{port}")
        with serving_in_thread(build_app(make_engine(), settings)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            client.completions.create(model=MODEL, prompt=[9, 8], max_tokens=2,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        # Leaving the server flushed the batched span over gRPC.
    finally:
        server.stop(None)
    assert [span.name for span in collector.spans] == ["llm_request"]
    attributes = {a.key: a.value for a in collector.spans[0].attributes}
    assert attributes["gen_ai.usage.completion_tokens"].int_value == 2


def test_a_server_whose_collector_is_gone_still_stops_within_its_drain(monkeypatch):
    """With nothing at the OTLP endpoint, the exporter's retries held the exit ~10 s past the drain."""
    import time

    from tests._server_helpers import running_server, stop

    for name in ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    endpoint = f"http://127.0.0.1:{free_port()}"  # nobody listens
    with running_server("--otlp-traces-endpoint", endpoint, "--drain-timeout", "1") as server:
        server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)  # a span to export
        started = time.monotonic()
        stop(server)
        assert time.monotonic() - started < 5, "the exit waited on the exporter"  # 8-10 s before, 1.5 s now
