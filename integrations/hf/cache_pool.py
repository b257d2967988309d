"""The pool a PagedCache allocates: the model's KV geometry on this rank, its layer groups, and the blocks its
budget buys. Budgets follow `core.kv_budget`, so a bare `PagedCache(model)` gets the pool `run` would give it."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from paged_backend.core.block_manager import BlockManager
from paged_backend.core.kv_budget import GPU_MEMORY_UTILIZATION, kv_memory_bytes, num_blocks_for_budget
from paged_backend.core.kv_cache import KV_CACHE_DTYPES, PagedKVCache
from paged_backend.core.kv_groups import KVCacheGroup, kv_cache_groups
from paged_backend.errors import InvalidRequest
from paged_backend.worker.models import resolve_device
from paged_backend.worker.offload import input_device, layer_devices

from .model_support import KVGeometry, kv_geometry, rank_geometry

# The dtypes the pool's ops store: the engine's KV dtypes (fp8 e4m3 / e5m2 quantize with the pool's scales), and
# float64, which sdpa / eager read back exactly. Other floating formats (fp8 fnuz, e8m0, fp4) would be written by an
# unscaled cast and integers round every key: either ran and gave other tokens, silently.
POOL_DTYPES = (*dict.fromkeys(dtype for dtype in KV_CACHE_DTYPES.values() if dtype is not None), torch.float64)


@dataclass(frozen=True)
class ModelFacts:
    """What the pool copies from the model (or from a bare config: float32 on CPU unless the config names a dtype)."""

    config: object  # the text config
    dtype: torch.dtype
    device: torch.device  # where the inputs go
    layer_devices: list[torch.device] | None  # per layer, for a model dispatched by accelerate
    tp_size: int | None  # ranks of transformers' tensor parallelism (tp_plan)

    @classmethod
    def of(cls, model_or_config) -> ModelFacts:
        if not hasattr(model_or_config, "config" if isinstance(model_or_config, torch.nn.Module) else "get_text_config"):
            raise InvalidRequest(
                f"PagedCache takes the transformers model it caches for (or that model's config), got "
                f"{type(model_or_config).__name__} {model_or_config!r:.60}"
            )
        tp_size = getattr(model_or_config, "tp_size", None)
        if isinstance(model_or_config, torch.nn.Module):
            config = model_or_config.config.get_text_config(decoder=True)
            devices = layer_devices(model_or_config, config.num_hidden_layers)
            dtype = next(model_or_config.parameters()).dtype
            return cls(config, dtype, input_device(model_or_config), devices, tp_size)
        config = model_or_config.get_text_config(decoder=True)
        dtype = getattr(config, "dtype", None)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return cls(config, dtype or torch.float32, torch.device("cpu"), None, tp_size)


@dataclass(frozen=True)
class CachePool:
    """The allocated pool and the layout it was allocated for."""

    config: object
    geometry: KVGeometry
    groups: list[KVCacheGroup]
    block_manager: BlockManager
    kv_cache: PagedKVCache


def build_pool(
    model_or_config,
    *,
    max_tokens: int | None,
    num_blocks: int | None,
    memory_bytes: int | None,
    block_size: int,
    dtype: torch.dtype | None,
    device: torch.device | str | None,
) -> CachePool:
    """The pool of `PagedCache`'s arguments; `dtype` / `device` default to the model's."""
    facts = ModelFacts.of(model_or_config)
    # Under transformers' tensor parallelism (tp_plan) each rank's pool holds only its own KV heads.
    geometry = rank_geometry(kv_geometry(facts.config), facts.tp_size)
    # Sliding-window layers get their own block tables and drop blocks that leave their window.
    groups = kv_cache_groups(geometry.sliding_windows)
    pool_dtype = facts.dtype if dtype is None else dtype
    if pool_dtype not in POOL_DTYPES:
        # Without dtype= the pool took the model's dtype: say so, and dtype= is still what to pass.
        given = f"the model's dtype {facts.dtype}" if dtype is None else f"PagedCache(dtype={dtype!r})"
        raise InvalidRequest(
            f"{given} cannot hold keys and values; pass dtype= one of {', '.join(map(str, POOL_DTYPES))}"
        )
    dtype = pool_dtype
    block_size = whole_number("block_size", block_size)  # before any math: 0 divided by zero in pool_blocks
    pool_device = _pool_device(device or facts.device, "device" if device is not None else "the model's device")
    num_blocks = pool_blocks(
        geometry, groups, block_size, dtype, pool_device,
        max_tokens=max_tokens, num_blocks=num_blocks, memory_bytes=memory_bytes,
    )  # fmt: skip
    block_manager = BlockManager(
        num_blocks, block_size, enable_prefix_caching=False,
        sliding_windows=[group.sliding_window for group in groups],
    )  # fmt: skip
    kv_cache = PagedKVCache(
        geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, num_blocks, block_size, dtype=dtype,
        device=pool_device, groups=groups, layer_devices=None if device is not None else facts.layer_devices,
    )  # fmt: skip
    return CachePool(facts.config, geometry, groups, block_manager, kv_cache)


def _pool_device(device: torch.device | str, given: str) -> torch.device:
    """A CPU or CUDA device the pool's bytes can live on (not meta, which holds none, nor one this torch lacks)."""
    try:
        return resolve_device(str(device))
    except InvalidRequest as error:
        raise InvalidRequest(f"PagedCache: {given} {str(device)!r} cannot hold the pool: {error}") from None


def pool_blocks(
    geometry: KVGeometry,
    groups: list[KVCacheGroup],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    max_tokens: int | None,
    num_blocks: int | None,
    memory_bytes: int | None,
) -> int:
    """Blocks for one budget: `max_tokens` KV slots, `num_blocks`, `memory_bytes`, or, with none given,
    `core.kv_budget`'s default budget for `device` (as `DynamicCache()` needs no size, neither does PagedCache)."""
    if sum(budget is not None for budget in (max_tokens, num_blocks, memory_bytes)) > 1:
        raise InvalidRequest(
            "give PagedCache one budget at most: max_tokens=, num_blocks= or memory_bytes= (none: the default budget)"
        )
    # Checked here, before the math: max_tokens=0 became "num_blocks ... got 1", and 1.5 a TypeError in the pool.
    max_tokens, num_blocks, memory_bytes = (
        None if value is None else whole_number(name, value)
        for name, value in (("max_tokens", max_tokens), ("num_blocks", num_blocks), ("memory_bytes", memory_bytes))
    )
    if max_tokens is not None:  # every group holds each token; + the reserved null block
        return len(groups) * -(-max_tokens // block_size) + 1
    if num_blocks is not None:
        return num_blocks
    budget = kv_memory_bytes(device, memory_bytes, GPU_MEMORY_UTILIZATION)
    # A block holds one group's layers at a time (a slot per layer), and the first group is the largest.
    return num_blocks_for_budget(
        len(groups[0].layers), geometry.num_kv_heads, geometry.head_dim, block_size, dtype, memory_bytes=budget
    )


def whole_number(name: str, value) -> int:
    """`value` of the argument `name` as an int, or `InvalidRequest` naming it (numpy integers count; bools do not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidRequest(f"PagedCache({name}={value!r}) must be a positive whole number")
    return int(value)
