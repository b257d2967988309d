"""The continuous-batching engine: scheduler, runner, sampler, `Engine` and `LLM`.

Names are imported on first use, so `paged_backend.engine.args` (every command's flags) loads without the model
stack: `paged-backend serve --help` answers before transformers' model code is imported.
"""

from importlib import import_module

_HOMES = {
    "BeamSearchOutput": "beam_search",
    "BeamSearchParams": "beam_search",
    "BeamSearchSequence": "beam_search",
    "Engine": "engine",
    "LLM": "llm",
    "engine_config": "llm",
    "CompletionOutput": "request",
    "Logprob": "request",
    "RequestMetrics": "request",
    "RequestOutput": "request",
    "SamplingParams": "sampling_params",
    "EngineStats": "stats",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
