"""PagedKVCache: per-layer K/V block pools in the NHD layout, plus the copies the BlockManager asks for.

Layout per layer: ``key_cache`` / ``value_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``
(the layout FlashInfer and TGI's flashdecoding read). All layers live in one tensor so a block copy or a
swap is one indexed copy for the whole model.
"""

from __future__ import annotations

import os

import torch

from paged_backend.errors import InvalidRequest

KV_CACHE_DTYPES = {
    "auto": None,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def resolve_kv_dtype(name: str | torch.dtype | None, model_dtype: torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in KV_CACHE_DTYPES:
        raise InvalidRequest(f"unknown kv cache dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or model_dtype


def check_kv_dtype_runs(dtype: torch.dtype, device: torch.device, backend: str | None) -> None:
    """Refuse at load a pool the chosen attention kernels cannot read: e5m2 runs on the cpu and torch backends
    (the Triton and CUDA kernels read e4m3), so on a GPU it needs backend 'torch'."""
    from paged_backend.ops import ENV_VAR

    if backend in (None, "auto"):
        backend = os.environ.get(ENV_VAR) or None
    gpu_kernel = backend in ("triton", "cuda") or (backend in (None, "auto") and device.type == "cuda")
    if dtype == torch.float8_e5m2 and gpu_kernel:
        raise InvalidRequest(
            "kv cache dtype fp8_e5m2 is read by the cpu and torch attention backends only; on a "
            "GPU use fp8 (e4m3), or attention backend 'torch'"
        )


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def available_memory(device: torch.device) -> int:
    """Free bytes on `device` right now (GPU: cudaMemGetInfo; CPU: the OS's available pages)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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


class PagedKVCache:
    """The physical KV pool. `BlockManager` decides which blocks hold what; this class holds the bytes."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        *,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
        num_cpu_blocks: int = 0,
    ) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=self.device)
        self.key_caches = [self.kv[layer, 0] for layer in range(num_layers)]
        self.value_caches = [self.kv[layer, 1] for layer in range(num_layers)]
        # Per-layer dequantization scales; only meaningful for fp8 pools.
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers
        self.scales_pending: set[int] = set()  # layers whose scales come from their next write (kv_scales.py)
        self.cpu_kv = None
        if num_cpu_blocks:
            pin = self.device.type == "cuda"
            cpu_shape = (num_layers, 2, num_cpu_blocks, block_size, num_kv_heads, head_dim)
            self.cpu_kv = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_caches[layer_idx], self.value_caches[layer_idx]

    def _raw(self, tensor: torch.Tensor) -> torch.Tensor:
        # fp8 tensors lack some indexing kernels on CPU; move bytes instead.
        return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        raw = self._raw(self.kv)
        raw[:, :, dst] = raw[:, :, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy GPU blocks to CPU blocks, (gpu, cpu) pairs."""
        self._transfer(pairs, self.kv, self.cpu_kv)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to GPU blocks, (cpu, gpu) pairs."""
        self._transfer(pairs, self.cpu_kv, self.kv)

    def _transfer(self, pairs, src_pool, dst_pool) -> None:
        if not pairs:
            return
        if self.cpu_kv is None:
            raise InvalidRequest("no CPU swap space was allocated; construct the cache with num_cpu_blocks > 0")
        src = torch.tensor([s for s, _ in pairs])
        dst = torch.tensor([d for _, d in pairs])
        moved = self._raw(src_pool)[:, :, src.to(src_pool.device)].to(dst_pool.device, non_blocking=True)
        self._raw(dst_pool)[:, :, dst.to(dst_pool.device)] = moved
