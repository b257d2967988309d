"""The continuous-batching engine: scheduler, runner, sampler, `Engine` and `LLM`."""

from paged_backend.engine.engine import LLM, Engine, EngineStats, engine_config
from paged_backend.engine.request import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineStats",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "engine_config",
]
