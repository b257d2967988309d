"""KV-cache groups: layers that share one block table.

Full-attention layers form one kind, windowed layers with the same window W another. Each kind is split into
groups of an equal number of layers (the smallest kind's count), so one block id always means the same number
of bytes: block b of group g holds K/V for g's layers only, in the pool "slots" 0..group_size-1. A block id is
handed to one group at a time from a single shared free queue, so a windowed group that drops its old blocks
gives bytes back to every group. A model without windows is one group of all its layers (today's layout).

>>> [g.layers for g in kv_cache_groups([4, 4, 4, 4, 4, None])]
[(5,), (0,), (1,), (2,), (3,), (4,)]
>>> kv_cache_groups([None, None])
[KVCacheGroup(layers=(0, 1), sliding_window=None)]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]  # model layers whose K/V this group's blocks hold, slot i = layers[i]
    sliding_window: int | None = None  # None: full attention


def layer_types(config) -> list[str]:
    """The config's layer types, inferred the way transformers' DynamicCache does when not listed."""
    if getattr(config, "layer_types", None):
        return list(config.layer_types)
    if getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * config.num_hidden_layers
    if getattr(config, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * config.num_hidden_layers
    return ["full_attention"] * config.num_hidden_layers


def sliding_windows(config) -> tuple[int | None, ...]:
    """Per layer of a text config: its attention window, or None for full attention (and non-attention kinds)."""
    window = getattr(config, "sliding_window", None)
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types(config))


def kv_cache_groups(windows: list[int | None] | tuple[int | None, ...]) -> list[KVCacheGroup]:
    """Split layers into equal-sized groups, full attention first; the last group of a kind may be short."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    size = min(map(len, kinds.values()))
    ordered = sorted(kinds.items(), key=lambda kind: (kind[0] is not None, kind[0] or 0))
    return [
        KVCacheGroup(tuple(layers[i : i + size]), window)
        for window, layers in ordered
        for i in range(0, len(layers), size)
    ]
