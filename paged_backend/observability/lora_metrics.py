"""vLLM's `lora_requests_info` gauge: which adapters are running and waiting, as labels; the value is the time."""

from __future__ import annotations

import time

from prometheus_client.core import GaugeMetricFamily

from paged_backend.engine import EngineStats


def lora_requests_info(prefix: str, stats: EngineStats, max_loras: int) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(
        f"{prefix}lora_requests_info",
        "Running stats on LoRA requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    running, waiting = ",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters)
    gauge.add_metric([str(max_loras), waiting, running], time.time())
    return gauge
