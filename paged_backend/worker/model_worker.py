"""One assembly of model + KV pool + runner, used by every face that runs a model over a paged pool.

The engine, each tensor/pipeline-parallel rank, the draft model of speculative decoding and the TGI shard all
build their worker here, in two steps:

1. `plan_pool` decides what the pool looks like (this rank's KV shape, the KV dtype, layer groups, how many
   blocks the budget buys: `core.kv_budget`). It is a plain value, so ranks can agree on it before allocating
   (every rank takes the smallest block count) and the TGI shard can plan at start and allocate at warmup.
2. `ModelWorker(model, plan, ...)` allocates the pool and the runner (and prepacks CPU linear layers, or tiles
   them in batch-invariant mode).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from paged_backend.config import CacheConfig
from paged_backend.core.kv_budget import KVShape, PoolSize, pool_size
from paged_backend.core.kv_cache import PagedKVCache, check_kv_dtype_runs, resolve_kv_dtype
from paged_backend.core.kv_groups import KVCacheGroup, kv_cache_groups, sliding_windows
from paged_backend.core.kv_scales import start_calibration
from paged_backend.worker.batch_invariant import BatchInvariantLinears
from paged_backend.worker.offload import layer_devices
from paged_backend.worker.packed_linear import pack_linears
from paged_backend.worker.runner import ModelRunner


@dataclass(frozen=True)
class PoolPlan:
    """What one worker's pool holds: `shape` (this rank's KV heads), `layers` (a pipeline stage's, or all),
    the block layout and size, and the layer groups that share block tables."""

    shape: KVShape
    dtype: torch.dtype
    block_size: int
    size: PoolSize
    groups: tuple[KVCacheGroup, ...]
    layers: range

    @property
    def num_slots(self) -> int:
        return slots_per_block(self.groups, self.layers)

    @property
    def bytes_per_block(self) -> int:
        return self.shape.bytes_per_block(self.block_size, self.dtype, self.num_slots)

    def with_blocks(self, num_blocks: int, num_cpu_blocks: int | None = None) -> PoolPlan:
        """The same pool with another block count (an explicit size, or the smallest over the ranks)."""
        cpu = self.size.num_cpu_blocks if num_cpu_blocks is None else num_cpu_blocks
        return replace(self, size=PoolSize(num_blocks, cpu))


def slots_per_block(groups: tuple[KVCacheGroup, ...], layers: range) -> int:
    """Layers one block holds: a group's (all of a stage's layers when there is one group)."""
    return len(groups[0].layers) if len(groups) > 1 else len(layers)


def plan_pool(
    model: nn.Module,
    cache: CacheConfig,
    device: torch.device,
    *,
    tp_size: int = 1,
    layers: range | None = None,
    split_windows: bool = True,
    backend: str | None = None,
) -> PoolPlan:
    """The pool `cache` asks for, for this rank of `model`: its share of the KV heads under `tp_size`, the layers
    `layers` of a pipeline stage (default all), sliding-window layers in their own groups when `split_windows`."""
    config = model.config.get_text_config()
    shape = KVShape.of(config).per_rank(tp_size)
    layers = layers if layers is not None else range(shape.num_layers)
    windows = sliding_windows(config)
    if not split_windows or len(layers) != shape.num_layers:
        windows = (None,) * shape.num_layers  # windowed layers kept whole, as full ones are
    groups = tuple(kv_cache_groups(windows))
    dtype = resolve_kv_dtype(cache.cache_dtype, model.dtype)
    check_kv_dtype_runs(dtype, device, backend)
    size = pool_size(cache, shape, dtype, device, slots_per_block(groups, layers))
    return PoolPlan(shape, dtype, cache.block_size, size, groups, layers)


class StageKVCache(PagedKVCache):
    """The pool of one pipeline stage: only its layers, addressed by their global layer index."""

    def __init__(self, layers: range, *args, **kwargs) -> None:
        self.first_layer = layers.start
        super().__init__(len(layers), *args, **kwargs)
        pad = [None] * layers.start  # indices of earlier stages' layers: never read by this stage
        self.k_scales, self.v_scales = pad + self.k_scales, pad + self.v_scales

    def allocate(self) -> None:
        super().allocate()
        pad = [None] * self.first_layer
        self.key_caches, self.value_caches = pad + self.key_caches, pad + self.value_caches


class ModelWorker:
    """A model, its KV pool and the runner that packs steps for it.

    `pack` prepacks CPU linear layers (`release`: the model is the worker's own, so it gives its dense weights
    up); `calibrate` starts fp8 K/V scale calibration on the first step; `batch_invariant`: the runner's linear
    layers, activations and attention compute each row the same way whatever the batch (`worker/batch_invariant.py`);
    `pool_cls`: a `StageKVCache` subclass (the parallel driver's records the block operations it replays on the
    other ranks)."""

    def __init__(
        self,
        model: nn.Module,
        plan: PoolPlan,
        device: torch.device,
        *,
        backend: str | None = None,
        pack: bool = False,
        release: bool = False,
        calibrate: bool = False,
        batch_invariant: bool = False,
        pool_cls: type[PagedKVCache] | None = None,
    ) -> None:
        self.model, self.plan = model, plan
        shape, size = plan.shape, plan.size
        common = dict(dtype=plan.dtype, device=device, num_cpu_blocks=size.num_cpu_blocks)
        if pool_cls is not None or len(plan.layers) < shape.num_layers:  # a pipeline stage's (or a driver's)
            self.kv_cache = (pool_cls or StageKVCache)(
                plan.layers, shape.num_kv_heads, shape.head_dim, size.num_blocks, plan.block_size, **common
            )
        else:
            self.kv_cache = PagedKVCache(
                shape.num_layers, shape.num_kv_heads, shape.head_dim, size.num_blocks, plan.block_size,
                groups=list(plan.groups), layer_devices=layer_devices(model, shape.num_layers), **common,
            )  # fmt: skip
        if calibrate:
            start_calibration(self.kv_cache)
        self.runner = model_runner(model, self.kv_cache, backend, pack=pack, release=release,
                                   batch_invariant=batch_invariant)  # fmt: skip


def model_runner(
    model: nn.Module, kv_cache: PagedKVCache, backend: str | None, *, pack: bool, release: bool, batch_invariant: bool
) -> ModelRunner:
    """The runner of `model` over `kv_cache`, its linear layers packed (or tiled in batch-invariant mode); with
    `release` the model is the runner's own (`owns_model`): it gives its dense weights up, and sleep mode may drop
    and reload it."""
    if batch_invariant:
        packed = BatchInvariantLinears(model, pack=pack, release=release)
    else:
        packed = pack_linears(model, pack, release=release)
    runner = ModelRunner(model, kv_cache, backend, packed)
    runner.owns_model = release
    return runner
