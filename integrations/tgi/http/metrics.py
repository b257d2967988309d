"""Prometheus metrics under TGI's `tgi_*` names, one registry per app (tests run several apps per process)."""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric

# TGI (metrics-exporter-prometheus) buckets: durations grow by 1.5x from 150 us.
DURATION_BUCKETS = [0.00015 * 1.5**k for k in range(20)]
BATCH_SIZE_BUCKETS = [2.0**k for k in range(11)]


def _linear_buckets(maximum: int) -> list[float]:
    step = max(maximum / 100, 1.0)
    return [step * (k + 1) for k in range(100)]


class PlainCounter:
    """A monotonic count exported under its bare name (untyped): prometheus_client would force a `_total`
    suffix onto counters, and TGI's names have none."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, labelnames
        self.values: dict[tuple[str, ...], float] = defaultdict(float)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.values[tuple(labels[name] for name in self.labelnames)] += amount

    def collect(self) -> list[Metric]:
        metric = Metric(self.name, self.documentation, "unknown")
        for key, value in sorted(self.values.items()):
            metric.add_sample(self.name, dict(zip(self.labelnames, key, strict=True)), value)
        return [metric]


class TgiMetrics:
    def __init__(self, max_input_tokens: int, max_total_tokens: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> PlainCounter:
            plain = PlainCounter(name, doc, labels)
            registry.register(plain)
            return plain

        def histogram(name: str, doc: str, buckets: list[float], labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.request_count = counter("tgi_request_count", "requests received")
        self.request_success = counter("tgi_request_success", "requests that completed")
        self.request_failure = counter("tgi_request_failure", "requests that failed", ("err",))
        self.batch_inference_count = counter("tgi_batch_inference_count", "batch forwards", ("method",))
        self.batch_inference_success = counter("tgi_batch_inference_success", "batch forwards ok", ("method",))
        self.batch_inference_failure = counter("tgi_batch_inference_failure", "batch forwards failed", ("method",))
        self.batch_concat = counter("tgi_batch_concat", "new requests joined a running batch", ("reason",))
        self.queue_size = Gauge("tgi_queue_size", "requests waiting", registry=registry)
        self.batch_current_size = Gauge("tgi_batch_current_size", "requests running", registry=registry)
        self.batch_current_max_tokens = Gauge("tgi_batch_current_max_tokens", "tokens reserved", registry=registry)
        self.batch_max_total_tokens = Gauge("tgi_batch_max_total_tokens", "KV capacity in tokens", registry=registry)
        self.request_duration = histogram("tgi_request_duration", "end-to-end seconds", DURATION_BUCKETS)
        self.request_validation_duration = histogram(
            "tgi_request_validation_duration", "validation seconds", DURATION_BUCKETS
        )
        self.request_queue_duration = histogram("tgi_request_queue_duration", "queue seconds", DURATION_BUCKETS)
        self.request_inference_duration = histogram(
            "tgi_request_inference_duration", "inference seconds", DURATION_BUCKETS
        )
        self.request_mean_time_per_token_duration = histogram(
            "tgi_request_mean_time_per_token_duration", "seconds per generated token", DURATION_BUCKETS
        )
        self.request_generated_tokens = histogram(
            "tgi_request_generated_tokens", "generated tokens", _linear_buckets(max_total_tokens)
        )
        self.request_input_length = histogram(
            "tgi_request_input_length", "prompt tokens", _linear_buckets(max_input_tokens)
        )
        self.request_max_new_tokens = histogram(
            "tgi_request_max_new_tokens", "max_new_tokens asked", _linear_buckets(max_total_tokens)
        )
        self.request_skipped_tokens = histogram(
            "tgi_request_skipped_tokens", "tokens skipped by truncation", _linear_buckets(max_input_tokens)
        )
        self.batch_next_size = histogram("tgi_batch_next_size", "requests per new batch", BATCH_SIZE_BUCKETS)
        self.batch_forward_duration = histogram(
            "tgi_batch_forward_duration", "forward seconds", DURATION_BUCKETS, ("method",)
        )
        self.batch_decode_duration = histogram(
            "tgi_batch_decode_duration", "detokenize seconds", DURATION_BUCKETS, ("method",)
        )
        self.batch_filter_duration = histogram(
            "tgi_batch_filter_duration", "filter seconds", DURATION_BUCKETS, ("method",)
        )
        self.batch_inference_duration = histogram(
            "tgi_batch_inference_duration", "batch step seconds", DURATION_BUCKETS, ("method",)
        )
        self.batch_concat_duration = histogram(
            "tgi_batch_concat_duration", "concatenate seconds", DURATION_BUCKETS, ("method",)
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
