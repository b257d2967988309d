"""The metrics again under vLLM's own names and labels, for the tools written against a vLLM server.

vLLM's dashboards, autoscalers (KEDA, the production stack's router) and monitors query `vllm:<name>` with a
`model_name` label (and `engine`, one per engine core). Our families are named `paged_backend:<name>`, unlabelled
on a single model, so a scrape also carries each family vLLM has as `vllm:<name>{model_name, engine="0"}`: the same
samples, renamed at exposition, so the two can never disagree. Families vLLM lacks (swapped requests, cut steps,
request classes) stay ours only.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

OURS, VLLM = "paged_backend:", "vllm:"
VLLM_FAMILIES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "engine_sleep_state", "cache_config_info",
    "lora_requests_info", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens",
    "generation_tokens", "request_success", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "iteration_tokens_total",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "request_inference_time_seconds", "request_time_per_output_token_seconds", "request_prompt_tokens",
    "request_generation_tokens", "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens",
})  # fmt: skip
# vLLM names the sleep levels by what they free: level 1 offloads the weights, level 2 discards them.
SLEEP_STATES = {"awake": "awake", "level_1": "weights_offloaded", "level_2": "discard_all"}


class WithVllmNames:
    """A collector of `registry`'s families followed by the renamed copies of those vLLM has, each sample labelled
    `model_name=model_name, engine="0"`; the registry is collected once, so both views are one reading."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry, self.model_name = registry, model_name

    def collect(self) -> Iterator[Metric]:
        families = list(self.registry.collect())
        yield from families
        for family in families:
            name = family.name.removeprefix(OURS)
            if name != family.name and name in VLLM_FAMILIES:
                yield self._renamed(family, VLLM + name)

    def _renamed(self, family: Metric, name: str) -> Metric:
        renamed = Metric(name, family.documentation, family.type, family.unit)
        extra = {"model_name": self.model_name, "engine": "0"}
        for sample in family.samples:
            labels = {**sample.labels, **extra}
            if "sleep_state" in labels:
                labels["sleep_state"] = SLEEP_STATES[labels["sleep_state"]]
            renamed.samples.append(sample._replace(name=VLLM + sample.name.removeprefix(OURS), labels=labels))
        return renamed
