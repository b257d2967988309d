"""Prometheus metrics named like vLLM's (`vllm:` -> `paged_backend:`), in a registry owned by one app; the exposition
also carries them under vLLM's own names (`vllm_names.py`), so tools written for vLLM read them unchanged.

Engine gauges and counters are read from the engine's stats at scrape time; latency histograms are
observed by the server as it streams each request's tokens, and the per-request breakdown (queue, prefill,
decode), sizes and success counts when a request finishes. A tracer, when set, gets one span per finished request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from paged_backend.engine.async_engine import AsyncEngine
from paged_backend.engine.request import RequestOutput
from paged_backend.engine.sampling_params import SamplingParams
from paged_backend.engine.stats import ITERATION_TOKEN_BUCKETS
from paged_backend.observability.lora_metrics import lora_requests_info
from paged_backend.observability.tracing import RequestTiming, RequestTracer
from paged_backend.observability.vllm_names import WithVllmNames

PREFIX = "paged_backend:"
SLEEP_STATES = ("awake", "level_1", "level_2")  # by sleep level
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: buckets for token counts, which span orders of magnitude."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


class EngineStatsCollector(Collector):
    """The engine's gauges and counters, read at scrape time (also on the TGI face's /metrics, paged backend)."""

    def __init__(self, async_engine: AsyncEngine) -> None:
        self.async_engine = async_engine

    def collect(self) -> Iterator[Metric]:
        stats = self.async_engine.stats()
        yield GaugeMetricFamily(f"{PREFIX}num_requests_running", "Requests in the running batch.", stats.num_running)
        yield GaugeMetricFamily(f"{PREFIX}num_requests_waiting", "Requests waiting to run.", stats.num_waiting)
        yield GaugeMetricFamily(  # vLLM V0's name: sequences preempted by swapping, waiting to swap back in
            f"{PREFIX}num_requests_swapped", "Sequences swapped out to CPU memory.", stats.num_swapped
        )
        yield GaugeMetricFamily(f"{PREFIX}kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", stats.kv_usage)
        counters = {
            "num_preemptions": ("Sequences preempted for lack of KV blocks.", stats.num_preemptions),
            "num_cut_steps": ("Steps stopped between layers for a request that outranked all they computed.",
                              stats.num_cut_steps),  # fmt: skip
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            "prompt_tokens": ("Prompt tokens processed.", stats.prompt_tokens),
            "generation_tokens": ("Tokens generated.", stats.generation_tokens),
            "spec_decode_num_drafts": ("Speculative proposals verified.", stats.spec_decode_num_drafts),
            "spec_decode_num_draft_tokens": ("Speculative tokens proposed.", stats.spec_decode_num_draft_tokens),
            "spec_decode_num_accepted_tokens": ("Speculative tokens accepted.", stats.spec_decode_num_accepted_tokens),
        }
        for name, (documentation, value) in counters.items():
            yield CounterMetricFamily(f"{PREFIX}{name}", documentation, value)
        sleep = GaugeMetricFamily(
            f"{PREFIX}engine_sleep_state", "Sleep mode: 1 on the engine's state (awake, level_1: KV cache freed, "
            "level_2: weights freed too), 0 on the others.", labels=["sleep_state"],
        )  # fmt: skip
        for level, state in enumerate(SLEEP_STATES):
            sleep.add_metric([state], float(level == self.async_engine.sleep_level))
        yield sleep
        manager = self.async_engine.engine.block_manager
        pool = GaugeMetricFamily(
            f"{PREFIX}cache_config_info", "The KV pool's configuration (vLLM's cache_config_info): value 1, labels.",
            labels=["block_size", "num_gpu_blocks"],
        )  # fmt: skip
        pool.add_metric([str(manager.block_size), str(manager.num_blocks)], 1)
        yield pool
        lora = self.async_engine.engine.lora
        if lora is not None:
            yield lora_requests_info(PREFIX, stats, lora.max_loras)
        per_position = CounterMetricFamily(
            f"{PREFIX}spec_decode_num_accepted_tokens_per_pos", "Speculative tokens accepted, by draft position.",
            labels=["position"],
        )  # fmt: skip
        for position, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            per_position.add_metric([str(position)], value)
        yield per_position
        yield _iteration_tokens(stats)


def _iteration_tokens(stats) -> HistogramMetricFamily:
    """Tokens per step, from the engine's per-bucket step counts (vLLM's iteration_tokens_total)."""
    counts = stats.iteration_tokens or (0,) * (len(ITERATION_TOKEN_BUCKETS) + 1)
    bounds = [*map(str, ITERATION_TOKEN_BUCKETS), "+Inf"]
    cumulative, total = [], 0
    for bound, count in zip(bounds, counts, strict=True):
        total += count
        cumulative.append((bound, total))
    return HistogramMetricFamily(f"{PREFIX}iteration_tokens_total", "Tokens per engine step (prompt and generated).",
                                 buckets=cumulative, sum_value=stats.iteration_tokens_sum)  # fmt: skip


class ServerMetrics:
    """All metrics of one app; `track` wraps an engine output stream to time its tokens."""

    def __init__(self, async_engine: AsyncEngine, model_name: str = "", tracer: RequestTracer | None = None) -> None:
        self.model_name, self.tracer = model_name, tracer
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(async_engine))

        def histogram(name: str, documentation: str, buckets=LATENCY_BUCKETS) -> Histogram:
            return Histogram(f"{PREFIX}{name}", documentation, buckets=buckets, registry=self.registry)

        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to the first output token.")
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between successive outputs.")
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish of a request.")
        self.request_queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling.")
        self.request_prefill_time = histogram("request_prefill_time_seconds", "First scheduling to first token.")
        self.request_decode_time = histogram("request_decode_time_seconds", "First token to finish.")
        self.request_inference_time = histogram("request_inference_time_seconds", "First scheduling to finish.")
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "A request's decode time over its output tokens after the first.",
            TOKEN_GAP_BUCKETS,
        )  # fmt: skip
        sizes = one_two_five(async_engine.engine.max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of a finished request.", sizes)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens a finished request generated (n > 1: all its completions).", sizes
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Tokens of a finished request's longest completion.", sizes
        )
        self.request_params_n = histogram("request_params_n", "The n of finished requests.", N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of finished requests.", sizes
        )
        self.request_success = Counter(
            f"{PREFIX}request_success",
            "Completions finished, by reason (n > 1 counts each).",
            ["finished_reason"],
            registry=self.registry,
        )
        self.requests_by_class = Counter(
            f"{PREFIX}requests_by_class",
            'Requests added, by class of service ("batch": the batch API\'s, run on capacity left over).',
            ["request_class"],
            registry=self.registry,
        )

    def exposition(self) -> bytes:
        return generate_latest(WithVllmNames(self.registry, self.model_name))

    async def track(
        self, outputs: AsyncIterator[RequestOutput], params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Pass outputs through, observing TTFT, the gaps between them, and end-to-end latency."""
        arrival = previous = time.monotonic()
        tokens_seen = 0
        try:
            async for output in outputs:
                now = time.monotonic()
                tokens = sum(len(completion.token_ids) for completion in output.outputs)
                if tokens > tokens_seen:  # a prefill chunk that produced no token is not a token
                    (self.inter_token_latency if tokens_seen else self.time_to_first_token).observe(now - previous)
                    tokens_seen, previous = tokens, now
                if output.finished:
                    self.e2e_request_latency.observe(now - arrival)
                    self._finished(output, params, now)
                yield output
        finally:
            await outputs.aclose()

    def _finished(self, output: RequestOutput, params: SamplingParams | None, now: float) -> None:
        """The per-request breakdown, vLLM's success counter, and the request's span."""
        times = output.metrics
        scheduled = times.first_scheduled_time if times.first_scheduled_time is not None else times.arrival_time
        first_token = times.first_token_time if times.first_token_time is not None else now
        self.request_queue_time.observe(scheduled - times.arrival_time)
        self.request_prefill_time.observe(first_token - scheduled)
        self.request_decode_time.observe(now - first_token)
        self.request_inference_time.observe(now - scheduled)
        generated = [len(completion.token_ids) for completion in output.outputs]
        if max(generated, default=0) > 1:  # n > 1 decodes its completions side by side: the longest sets the pace
            self.request_time_per_output_token.observe((now - first_token) / (max(generated) - 1))
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(sum(generated))
        self.request_max_num_generation_tokens.observe(max(generated, default=0))
        if params is not None:
            self.request_params_n.observe(params.n)
            self.request_params_max_tokens.observe(params.max_tokens)
        reasons = [completion.finish_reason or "abort" for completion in output.outputs]
        for reason in reasons:
            self.request_success.labels(finished_reason=reason).inc()
        if self.tracer is None:
            return
        timing = RequestTiming(times.arrival_time, scheduled, first_token, now, len(output.prompt_token_ids),
                               sum(generated), reasons)  # fmt: skip
        options = {} if params is None else dict(
            max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            n=params.n,
        )  # fmt: skip
        self.tracer.record(output.request_id, self.model_name, timing, options)
