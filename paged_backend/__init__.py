"""paged-backend: paged KV cache, paged attention and continuous batching for existing frameworks."""

import logging

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

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "BlockManager",
    "BlockStats",
    "InvalidRequest",
    "OutOfBlocks",
    "PagedBackendError",
    "PagedKVCache",
    "PromptTooLong",
    "UnsupportedModel",
    "__version__",
]
