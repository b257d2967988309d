"""paged-backend: paged KV cache, paged attention and continuous batching for existing frameworks."""

from paged_backend.block_manager import BlockManager, BlockStats
from paged_backend.errors import (
    BackendUnavailable,
    InvalidRequest,
    OutOfBlocks,
    PagedBackendError,
    PromptTooLong,
    UnsupportedModel,
)
from paged_backend.kv_cache import PagedKVCache

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
