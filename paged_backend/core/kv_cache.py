"""PagedKVCache: per-layer K/V block pools in the NHD layout, plus the copies the BlockManager asks for.

Layout per layer: ``key_cache`` / ``value_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``
(the layout FlashInfer and TGI's flashdecoding read). All layers of one device live in one tensor so a block
copy or a swap is one indexed copy per device; `layer_devices` spreads layers over devices (accelerate's device
maps run each layer on its own device, so its KV lives there too).

With layer groups (`kv_groups`: sliding-window layers apart from full-attention ones) a tensor has one "slot"
per layer of a group instead of one per layer: block b of group g holds g's layers in slots 0..group_size-1,
and the BlockManager hands each block id to one group at a time.
"""

from __future__ import annotations

import torch

from paged_backend.config.env import env_flag
from paged_backend.core import huge_pages
from paged_backend.core.kv_groups import KVCacheGroup
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
    from paged_backend.ops import asked_backend

    if backend in (None, "auto"):
        backend = asked_backend(None)
    gpu_kernel = backend in ("triton", "cuda") or (backend in (None, "auto") and device.type == "cuda")
    if dtype == torch.float8_e5m2 and gpu_kernel:
        raise InvalidRequest(
            "kv cache dtype fp8_e5m2 is read by the cpu and torch attention backends only; on a "
            "GPU use fp8 (e4m3), or attention backend 'torch'"
        )


def pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool tensor; with PAGED_BACKEND_KV_HUGE_PAGES=1, on the CPU on 2 MiB pages, where decode's reads of
    scattered blocks miss the TLB less (huge_pages.py: opt-in for its start-up cost)."""
    if device.type == "cpu" and env_flag(huge_pages.SWITCH, False):
        return huge_pages.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


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
        groups: list[KVCacheGroup] | None = None,
        layer_devices: list[torch.device | str] | None = None,
    ) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size, self.num_cpu_blocks = num_blocks, block_size, num_cpu_blocks
        self.dtype, self.device = dtype, torch.device(device)
        self.groups = groups or [KVCacheGroup(tuple(range(num_layers)))]
        self.layer_group = [0] * num_layers  # which group's block tables a layer reads
        layer_slot = list(range(num_layers))
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                self.layer_group[layer], layer_slot[layer] = g, slot
        self.num_slots = max(len(group.layers) for group in self.groups)
        self.layer_devices = [torch.device(d) for d in layer_devices or [self.device] * num_layers]
        self.layer_slot = layer_slot
        # The slots each device holds, in first-use order: one tensor [slots, 2, num_blocks, ...] per device.
        self.slots_on: dict[torch.device, list[int]] = {}
        for layer, layer_device in enumerate(self.layer_devices):
            slots = self.slots_on.setdefault(layer_device, [])
            if layer_slot[layer] not in slots:
                slots.append(layer_slot[layer])
        # Per-layer dequantization scales; only meaningful for fp8 pools.
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers
        self.scales_pending: set[int] = set()  # layers whose scales come from their next write (kv_scales.py)
        self.generation = 0  # changes whenever the pool tensors are replaced (callers holding raw pointers rebuild)
        self.allocate()

    def allocate(self) -> None:
        """(Re)allocate the zeroed pool tensors and the per-layer views into them (`kvs`; `kv` / `cpu_kv` when
        there is one device)."""
        self.generation += 1
        block = (self.block_size, self.num_kv_heads, self.head_dim)
        self.kvs = [pool_zeros((len(slots), 2, self.num_blocks, *block), self.dtype, d)
                    for d, slots in self.slots_on.items()]  # fmt: skip
        pools = dict(zip(self.slots_on, self.kvs, strict=True))
        self.key_caches, self.value_caches = [], []
        for layer, layer_device in enumerate(self.layer_devices):
            kv = pools[layer_device][self.slots_on[layer_device].index(self.layer_slot[layer])]
            self.key_caches.append(kv[0])
            self.value_caches.append(kv[1])
        self.cpu_kvs = []
        if self.num_cpu_blocks:
            pin = any(kv.device.type == "cuda" for kv in self.kvs)
            self.cpu_kvs = [torch.zeros((kv.shape[0], 2, self.num_cpu_blocks, *block), dtype=self.dtype,
                                        pin_memory=pin) for kv in self.kvs]  # fmt: skip
        self.kv = self.kvs[0] if len(self.kvs) == 1 else None
        self.cpu_kv = self.cpu_kvs[0] if len(self.cpu_kvs) == 1 else None

    def release(self) -> None:
        """Drop every pool tensor (device and CPU swap space) so their memory goes back (sleep mode); the pool's
        contents are gone and `allocate()` brings zeroed tensors of the same layout back."""
        self.kvs, self.cpu_kvs, self.key_caches, self.value_caches = [], [], [], []
        self.kv = self.cpu_kv = None
        self.generation += 1

    @property
    def allocated(self) -> bool:
        return bool(self.kvs)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id takes across every device's slots, K and V (allocated or not)."""
        slots = sum(len(slots) for slots in self.slots_on.values())
        return slots * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def total_bytes(self) -> int:
        """Bytes the device pool holds now (0 while released)."""
        return sum(kv.numel() * kv.element_size() for kv in self.kvs)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_caches[layer_idx], self.value_caches[layer_idx]

    def _raw(self, tensor: torch.Tensor) -> torch.Tensor:
        # fp8 tensors lack some indexing kernels on CPU; move bytes instead.
        return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every slot (copy-on-write; a block id belongs to one group)."""
        if not pairs:
            return
        for kv in self.kvs:
            src = torch.tensor([s for s, _ in pairs], device=kv.device)
            dst = torch.tensor([d for _, d in pairs], device=kv.device)
            raw = self._raw(kv)
            raw[:, :, dst] = raw[:, :, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy GPU blocks to CPU blocks, (gpu, cpu) pairs."""
        for kv, cpu_kv in self._swap_pools(pairs):
            self._transfer(pairs, kv, cpu_kv)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to GPU blocks, (cpu, gpu) pairs."""
        for kv, cpu_kv in self._swap_pools(pairs):
            self._transfer(pairs, cpu_kv, kv)

    def _swap_pools(self, pairs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device pool, its CPU swap pool) per device; nothing to do without pairs."""
        if pairs and not self.cpu_kvs:
            raise InvalidRequest("no CPU swap space was allocated; construct the cache with num_cpu_blocks > 0")
        return list(zip(self.kvs, self.cpu_kvs, strict=True)) if pairs else []

    def _transfer(self, pairs, src_pool, dst_pool) -> None:
        src = torch.tensor([s for s, _ in pairs])
        dst = torch.tensor([d for _, d in pairs])
        moved = self._raw(src_pool)[:, :, src.to(src_pool.device)].to(dst_pool.device, non_blocking=True)
        self._raw(dst_pool)[:, :, dst.to(dst_pool.device)] = moved
