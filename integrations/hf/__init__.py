"""HuggingFace adapter: `model.generate(..., past_key_values=PagedCache(model, max_tokens=...))`.

Importing this package registers attn_implementation="paged_backend" with transformers, so
`from_pretrained(..., attn_implementation="paged_backend")` and `model.set_attn_implementation("paged_backend")`
work right away.
"""

from paged_backend.worker.attention import register_paged_attention

from .cache_stats import CacheStats
from .model_support import KVGeometry, kv_geometry
from .paged_cache import PagedCache

ATTN_IMPLEMENTATION = register_paged_attention()

__all__ = ["ATTN_IMPLEMENTATION", "CacheStats", "KVGeometry", "PagedCache", "kv_geometry"]
