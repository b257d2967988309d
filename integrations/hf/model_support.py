"""Which transformers models a PagedCache can serve, and the KV geometry its pool needs."""

from __future__ import annotations

from dataclasses import dataclass, replace

from paged_backend.core.kv_budget import KVShape, kv_heads_per_rank
from paged_backend.core.kv_groups import layer_types, sliding_windows
from paged_backend.errors import UnsupportedModel

# Layer kinds whose K/V is an ordinary growing attention cache; anything else keeps other state.
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


@dataclass(frozen=True)
class KVGeometry:
    """Shape of one token's K (or V) in one layer, for every layer of the model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_windows: tuple[int | None, ...]  # per layer: window size, or None for full attention


def _unsupported_feature(config) -> str | None:
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        return "cross-attention (encoder-decoder models keep a second, encoder-side cache)"
    for layer_type in layer_types(config):
        if layer_type not in ATTENTION_LAYER_TYPES:
            return f"layers of type {layer_type!r} (only full and sliding-window attention layers are paged)"
    if getattr(config, "kv_lora_rank", None):
        return "multi-head latent attention (keys and values of different widths)"
    if getattr(config, "num_kv_shared_layers", 0) or getattr(config, "kv_sharing_modes", None):
        return "KV sharing across layers (some layers read another layer's cache)"
    return None


def kv_geometry(config) -> KVGeometry:
    """Geometry of a decoder-only config's KV cache; raises `UnsupportedModel` naming what does not fit.

    >>> from transformers import LlamaConfig
    >>> kv_geometry(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2))
    KVGeometry(num_layers=2, num_kv_heads=2, head_dim=16, sliding_windows=(None, None))
    """
    feature = _unsupported_feature(config)
    if feature:
        raise UnsupportedModel(f"{type(config).__name__} uses {feature}, which PagedCache does not support")
    shape = KVShape.of(config)
    return KVGeometry(shape.num_layers, shape.num_kv_heads, shape.head_dim, sliding_windows(config))


def rank_geometry(geometry: KVGeometry, tp_size: int | None) -> KVGeometry:
    """The KV one tensor-parallel rank stores: its share of the KV heads.

    transformers' `tp_plan` chunks every projection evenly, so heads that do not split over the ranks cannot be
    replicated as the engine does: `kv_heads_per_rank` refuses them.

    >>> rank_geometry(KVGeometry(2, 4, 16, (None, None)), 2).num_kv_heads
    2
    """
    return replace(geometry, num_kv_heads=kv_heads_per_rank(geometry.num_kv_heads, tp_size or 1, replicate=False))


def check_update_shapes(key, value, geometry: KVGeometry, layer_idx: int) -> None:
    """A model whose per-layer K/V does not match its config cannot share one pool layout."""
    expected = (geometry.num_kv_heads, geometry.head_dim)
    if layer_idx >= geometry.num_layers:  # the layer count is the cache's config's, not the model's
        raise UnsupportedModel(
            f"this PagedCache was built for a config with {geometry.num_layers} layers, but the model has more (it "
            f"wrote cache layer {layer_idx}); build the cache from the same model: PagedCache(model, ...)"
        )
    if tuple(key.shape[1:2]) + tuple(key.shape[3:]) != expected or value.shape != key.shape:
        raise UnsupportedModel(
            f"layer {layer_idx} caches keys {tuple(key.shape)} and values {tuple(value.shape)}, but the pool holds "
            f"{expected[0]} KV heads of width {expected[1]} for both: a cache built for another model? Build it "
            f"from this one, PagedCache(model, ...); models with per-layer or K/V-specific head sizes are not "
            f"supported"
        )
