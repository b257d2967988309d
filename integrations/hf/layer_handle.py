"""What `PagedCache.update` returns under attn_implementation="paged_backend": a handle, not K/V tensors."""

from __future__ import annotations

from typing import Protocol

import torch

from paged_backend.errors import UnsupportedModel

_TOUCHED = (
    "the model's attention code used the cached keys/values after Cache.update ({what}) instead of passing them "
    "to the attention function; PagedCache cannot serve this architecture with attn_implementation='paged_backend', "
    "use 'sdpa' or 'eager' instead"
)


class LayerAttention(Protocol):
    """The cache a handle came from: it plans the forward on layer 0, then stores and attends each layer."""

    def attend_layer(
        self, handle: PagedLayerKV, query, scaling, sliding_window, softcap, attention_mask
    ) -> torch.Tensor: ...


class PagedLayerKV:
    """One layer's new K/V; `attend` stores them in the pool and runs paged attention over it.

    Model code must hand it to the attention function untouched: any tensor use raises `UnsupportedModel`.
    """

    def __init__(self, cache: LayerAttention, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.cache, self.layer_idx, self.key, self.value = cache, layer_idx, key, value

    def attend(self, query, scaling, sliding_window, softcap, attention_mask=None) -> torch.Tensor:
        """`query [B, Hq, q, D]` -> `[B, q, Hq, D]`, reading every past token straight from the pool."""
        return self.cache.attend_layer(self, query, scaling, sliding_window, softcap, attention_mask)

    def __getattr__(self, name: str):
        if name.startswith("__"):  # protocol probes (copy, pickle) must see a plain missing attribute
            raise AttributeError(name)
        raise UnsupportedModel(_TOUCHED.format(what=f"read .{name}"))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise UnsupportedModel(_TOUCHED.format(what=f"called {getattr(func, '__name__', func)}"))
