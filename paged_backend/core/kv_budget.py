"""The KV budget, decided once: what a model's KV costs, what a tensor-parallel rank keeps, how many blocks fit.

Every pool is sized here (the engine, each tensor/pipeline rank, the draft model, the TGI shard, several models
sharing one server, and a bare `PagedCache(model)`), so the same model, memory and flags give the same pool
whichever face starts it.

The default budget, when neither `num_blocks` nor `kv_cache_memory_bytes` is given:
- on a GPU, `gpu_memory_utilization` of the device's free memory (vLLM's and TGI's rule);
- on a CPU, "free memory" is the whole machine's, so the pool takes `CPU_DEFAULT_KV_BYTES` (512 MiB) or a tenth
  of the available memory, whichever is smaller: enough for thousands of tokens of a small model, and never
  enough to push the host into swap.

KV heads under tensor parallelism (`kv_heads_per_rank`): heads that divide over the ranks are split; fewer heads
than ranks, with the ranks a multiple of the heads, are replicated (each rank keeps the one head its query heads
read, as vLLM does); anything else is refused with the sizes that would work. A layout that cannot replicate
(transformers' own `tp_plan` chunks every projection evenly) asks with `replicate=False` and gets a refusal instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from paged_backend.errors import InvalidRequest, UnsupportedModel

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of a GPU's free memory
CPU_DEFAULT_KV_BYTES = 512 << 20
CPU_MEMORY_SHARE = 10  # at most 1/10 of the machine's available memory on CPU


@dataclass(frozen=True)
class KVShape:
    """What one token's KV looks like in one model (or one rank of it): layers x KV heads x head dim."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int = 2048

    @classmethod
    def of(cls, config) -> KVShape:
        """The shape of a transformers config (its text config, for multimodal ones).

        >>> from transformers import LlamaConfig
        >>> KVShape.of(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3))
        KVShape(num_layers=3, num_kv_heads=2, head_dim=16, max_positions=2048)
        """
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        return cls(
            num_layers=text.num_hidden_layers,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            max_positions=getattr(text, "max_position_embeddings", None) or 2048,
        )

    def per_rank(self, tp_size: int, *, replicate: bool = True) -> KVShape:
        """The KV one of `tp_size` tensor-parallel ranks holds."""
        return replace(self, num_kv_heads=kv_heads_per_rank(self.num_kv_heads, tp_size, replicate=replicate))

    def bytes_per_block(self, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
        """Bytes one block takes, K and V, across `num_layers` layers (default: all of them)."""
        return bytes_per_block(num_layers or self.num_layers, self.num_kv_heads, self.head_dim, block_size, dtype)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int, *, replicate: bool = True) -> int:
    """KV heads each of `tp_size` ranks keeps: an even share, or one replicated head when there are fewer heads.

    >>> kv_heads_per_rank(8, 2), kv_heads_per_rank(2, 4)
    (4, 1)
    """
    if tp_size <= 1 or num_kv_heads % tp_size == 0:
        return num_kv_heads // max(tp_size, 1)
    if replicate and tp_size % num_kv_heads == 0:
        return 1
    options = f"a size that divides {num_kv_heads}" + (" or a multiple of it" if replicate else "")
    raise UnsupportedModel(
        f"the model has {num_kv_heads} KV heads, which tensor parallelism of size {tp_size} cannot split evenly; "
        f"use {options}"
    )


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across `num_layers` layers, K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def available_memory(device: torch.device) -> int:
    """Free bytes on `device` right now (GPU: cudaMemGetInfo; CPU: the kernel's MemAvailable, which counts the
    page cache it can drop; free pages alone shrink whenever files are read, and the pool would shrink with them)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_memory_bytes(
    device: torch.device, memory_bytes: int | None = None, memory_fraction: float | None = None
) -> int:
    """The pool's byte budget: `memory_bytes` when given, else the default of the module docstring
    (`memory_fraction` of free device memory on a GPU; the capped share on a CPU)."""
    if memory_bytes is not None:
        return memory_bytes
    device = torch.device(device)
    if device.type != "cuda":
        return min(CPU_DEFAULT_KV_BYTES, available_memory(device) // CPU_MEMORY_SHARE)
    if memory_fraction is None or not 0 < memory_fraction <= 1:
        raise InvalidRequest(f"gpu_memory_utilization must be in (0, 1], got {memory_fraction}")
    return int(available_memory(device) * memory_fraction)


def num_blocks_for_budget(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    memory_bytes: int | None = None,
    memory_fraction: float | None = None,
    device: torch.device | str = "cpu",
) -> int:
    """How many blocks fit `memory_bytes`, or `memory_fraction` of the device's free memory."""
    if memory_bytes is None:
        if memory_fraction is None or not 0 < memory_fraction <= 1:
            raise InvalidRequest(f"memory fraction must be in (0, 1], got {memory_fraction}")
        memory_bytes = int(available_memory(torch.device(device)) * memory_fraction)
    per_block = bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype)
    num_blocks = memory_bytes // per_block
    if num_blocks < 2:
        raise InvalidRequest(
            f"a KV budget of {memory_bytes} bytes holds {num_blocks} blocks of {per_block} bytes; "
            f"at least 2 are needed (block 0 is reserved): raise the budget or lower block_size"
        )
    return int(num_blocks)


@dataclass(frozen=True)
class PoolSize:
    """Blocks of one pool: on the device, and in CPU memory for swapped-out sequences."""

    num_blocks: int
    num_cpu_blocks: int = 0


def pool_size(cache, shape: KVShape, dtype: torch.dtype, device: torch.device, num_layers: int | None = None) -> PoolSize:
    """The pool a `CacheConfig` asks for, for KV of `shape` (`num_layers` of them: a stage's or a group's slots):
    `num_blocks` when given, else the byte budget; plus `swap_space` GiB of CPU blocks."""
    per_block = shape.bytes_per_block(cache.block_size, dtype, num_layers)
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    else:
        budget = kv_memory_bytes(device, cache.kv_cache_memory_bytes, cache.gpu_memory_utilization)
        num_blocks = num_blocks_for_budget(
            num_layers or shape.num_layers, shape.num_kv_heads, shape.head_dim, cache.block_size, dtype,
            memory_bytes=budget,
        )  # fmt: skip
    return PoolSize(num_blocks, int(cache.swap_space * (1 << 30)) // per_block)
