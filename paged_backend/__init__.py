"""paged-backend: paged KV cache, paged attention and continuous batching for existing frameworks.

`from paged_backend import LLM, SamplingParams`, as one writes `from vllm import LLM, SamplingParams`: the engine's
names load on first use, so importing the package (or any core module) loads no model stack.
"""

import logging
from importlib import import_module
from typing import TYPE_CHECKING

from paged_backend.core.block_manager import BlockManager, BlockStats
from paged_backend.core.kv_cache import PagedKVCache
from paged_backend.errors import (
    BackendUnavailable,
    InvalidRequest,
    OutOfBlocks,
    PagedBackendError,
    PromptTooLong,
    UnsupportedModel,
)

# With the [quantization] extra installed, transformers imports torchao at start-up, which logs a warning for each
# CUDA-only kernel library a CPU build cannot load and for each deprecated pytree registration: noise on every
# command, not something to act on. Real errors still show. (Nothing above imports transformers.)
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

if TYPE_CHECKING:  # what __getattr__ gives, for type checkers (and the layer test, which counts these imports)
    from paged_backend.engine import (
        LLM,
        BeamSearchOutput,
        BeamSearchParams,
        BeamSearchSequence,
        CompletionOutput,
        Engine,
        EngineStats,
        Logprob,
        RequestOutput,
        SamplingParams,
        engine_config,
    )
    from paged_backend.engine.args import EngineArgs
    from paged_backend.lora import LoRARequest

__version__ = "0.1.0"

_LAZY = {
    **dict.fromkeys(("LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput", "Engine",
                     "EngineStats", "Logprob", "RequestOutput", "SamplingParams", "engine_config"),
                    "paged_backend.engine"),  # fmt: skip
    "EngineArgs": "paged_backend.engine.args",
    "LoRARequest": "paged_backend.lora",
}

__all__ = [  # a literal list, so linters see the lazy names too
    "LLM",
    "BackendUnavailable",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "BlockManager",
    "BlockStats",
    "CompletionOutput",
    "Engine",
    "EngineArgs",
    "EngineStats",
    "InvalidRequest",
    "LoRARequest",
    "Logprob",
    "OutOfBlocks",
    "PagedBackendError",
    "PagedKVCache",
    "PromptTooLong",
    "RequestOutput",
    "SamplingParams",
    "UnsupportedModel",
    "__version__",
    "engine_config",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
