"""CPU backend: the fused csrc/cpu/ paged-attention kernel, built by the host compiler on first use.

The torch oracle runs a dozen small ops per sequence and layer and gathers K/V into a buffer first; this
kernel reads each sequence's blocks once, in place, for all query rows of a GQA group, threaded with
OpenMP over (sequence, kv head, query tile) at torch's thread count. The cache write is a row copy in C (fp8 pools,
which scale and round, take the oracle's).

On CPUs with AMX (Intel Sapphire Rapids and later) a bf16 query over a bf16 cache decodes on the tile unit, whose
sums are its own (`amx_tiles()`; `PAGED_BACKEND_CPU_AMX=0` keeps the AVX-512 path, for this kernel and the panel
linear alike): a row's bits still depend on nothing but its keys' positions.

`StepAttention` (in `paged_backend.ops`) asks this module for `StepPlans` and `CacheWriter`: a forward's step
arguments go into the kernels' structs once, and every layer then only points them at its own tensors.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from paged_backend.config.env import env_flag
from paged_backend.errors import BackendUnavailable
from paged_backend.ops import reference
from paged_backend.ops._c_abi import F32, I32, I64, PAGED_KV_FIELDS, PTR, check_layouts, check_status
from paged_backend.ops._contract import (
    AttentionBatch,
    CacheWrite,
    as_int32,
    batch_invariant_enabled,
    called_as,
    unit_last_stride,
)
from paged_backend.ops._cpu_build import CpuBuildError, cached_library

QUERY_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
KV_DTYPES = {**QUERY_DTYPES, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
AMX_SWITCH = "PAGED_BACKEND_CPU_AMX"  # "0": the AVX-512 code even where AMX tiles are there (every kernel here)


class AttentionArgs(ctypes.Structure):
    """Mirror of PbCpuAttentionArgs in csrc/cpu/paged_attention_cpu.cpp."""

    _fields_ = [
        ("query", PTR), ("q_stride_token", I64), ("q_stride_head", I64),
        *PAGED_KV_FIELDS, ("query_start_loc", PTR),
        ("out", PTR), ("o_stride_token", I64), ("o_stride_head", I64),
        ("num_seqs", I32), ("num_q_heads", I32), ("num_kv_heads", I32), ("head_dim", I32),
        ("block_size", I32), ("q_dtype", I32), ("kv_dtype", I32), ("sliding_window", I32),
        ("num_threads", I32), ("invariant", I32), ("scale", F32), ("softcap", F32), ("k_scale", F32), ("v_scale", F32),
    ]


class CacheWriteArgs(ctypes.Structure):
    """Mirror of PbCpuCacheWriteArgs in csrc/cpu/kernels.h."""

    _fields_ = [
        ("key", PTR), ("k_stride_token", I64), ("k_stride_head", I64),
        ("value", PTR), ("v_stride_token", I64), ("v_stride_head", I64),
        ("key_cache", PTR), ("value_cache", PTR),
        ("k_stride_block", I64), ("k_stride_slot", I64), ("k_stride_head_cache", I64),
        ("v_stride_block", I64), ("v_stride_slot", I64), ("v_stride_head_cache", I64),
        ("slot_mapping", PTR), ("num_slots", I64),
        ("num_tokens", I32), ("num_kv_heads", I32), ("head_dim", I32), ("block_size", I32), ("element_bytes", I32),
        ("num_threads", I32),
    ]  # fmt: skip


@cache
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(cached_library()))
    lib.pb_cpu_paged_attention.argtypes = [ctypes.POINTER(AttentionArgs)]
    lib.pb_cpu_paged_attention.restype = ctypes.c_int
    lib.pb_cpu_reshape_and_cache.argtypes = [ctypes.POINTER(CacheWriteArgs)]
    lib.pb_cpu_reshape_and_cache.restype = ctypes.c_int
    lib.pb_cpu_error_string.argtypes = [ctypes.c_int]
    lib.pb_cpu_error_string.restype = ctypes.c_char_p
    lib.pb_cpu_amx.argtypes = [I32]
    lib.pb_cpu_amx.restype = I32
    lib.pb_cpu_read_blocks.argtypes = [PTR, PTR, PTR, I64, I64, I32]
    lib.pb_cpu_read_blocks.restype = ctypes.c_uint32
    sizes = {AttentionArgs: "pb_cpu_attention_args_size", CacheWriteArgs: "pb_cpu_cache_write_args_size"}
    check_layouts(lib, sizes, "csrc/cpu")
    if not env_flag(AMX_SWITCH, True):
        lib.pb_cpu_amx(0)
    return lib


def amx_tiles(use: bool | None = None) -> bool:
    """Whether bf16 panels and bf16 decode attention run on AMX tiles; `use` True turns them on where this CPU and its
    OS allow them, False keeps the AVX-512 code (a process-wide switch, for comparisons: the two sum in other
    orders)."""
    return bool(_library().pb_cpu_amx(-1 if use is None else int(use)))


def read_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor) -> int:
    """Reads `blocks` of two contiguous `[num_blocks, ...]` pools in that order, each block front to back, as decode
    attention's table order asks for them and with nothing else to do: benchmarks/attention.py's bound for the
    access pattern. Returns the wrapping 32-bit sum of the words read (a test checks it against torch)."""
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError("read_blocks takes a K and a V pool of one shape and dtype")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()) or key_cache.device.type != "cpu":
        raise ValueError("read_blocks takes contiguous CPU pools")
    block_bytes = key_cache[0].numel() * key_cache.element_size()
    if block_bytes % 4:
        raise ValueError(f"read_blocks reads 32-bit words; a block of {block_bytes} bytes is not a whole number")
    ids = blocks.to(torch.int32).contiguous()
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < key_cache.shape[0]:
        raise ValueError(f"read_blocks: block ids must lie in [0, {key_cache.shape[0]})")
    return _library().pb_cpu_read_blocks(key_cache.data_ptr(), value_cache.data_ptr(), ids.data_ptr(), ids.numel(),
                                         block_bytes, torch.get_num_threads())


def unavailable_reason() -> str | None:
    """None when the CPU kernel builds and loads here, else a sentence saying why not."""
    try:
        _library()
    except (CpuBuildError, OSError, RuntimeError) as exc:
        return f"building or loading the csrc/cpu library failed: {exc}"
    return None


@called_as(AttentionBatch)
def paged_attention(batch: AttentionBatch) -> torch.Tensor:
    """Varlen causal attention of `query [T, Hq, D]` over paged K/V, same contract as the oracle."""
    plans = StepPlans(batch.block_tables, batch.seq_lens, batch.query_start_loc, invariant=batch.invariant)
    return plans(batch.query, batch.key_cache, batch.value_cache, batch.scale, sliding_window=batch.sliding_window,
                 softcap=batch.softcap, k_scale=batch.k_scale, v_scale=batch.v_scale)  # fmt: skip


def _check_tensors(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if query.device.type != "cpu" or key_cache.device.type != "cpu":
        raise BackendUnavailable("the cpu backend runs on CPU tensors; use backend='triton' or 'cuda' on a GPU")
    if query.dtype not in QUERY_DTYPES or key_cache.dtype not in KV_DTYPES or value_cache.dtype != key_cache.dtype:
        raise BackendUnavailable(f"the cpu backend supports queries in {list(QUERY_DTYPES)} and caches in "
                                 f"{list(KV_DTYPES)}, got {query.dtype} and {key_cache.dtype}/{value_cache.dtype}")
    if query.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise BackendUnavailable("the cpu backend needs a unit stride along head_dim; pass contiguous rows")


class StepPlans:
    """The attention of every layer of one forward: the step's tables, lengths and query starts converted once, and
    an `AttentionPlan` per kind of layer call (heads, dtypes, scale, cap, fp8 scales), so a layer's call is the
    checks and the kernel."""

    def __init__(self, block_tables, seq_lens, query_start_loc, *, invariant: bool | None = None) -> None:
        self.tables, self.lens, self.starts = as_int32(block_tables), as_int32(seq_lens), as_int32(query_start_loc)
        self.invariant = batch_invariant_enabled() if invariant is None else invariant
        self.plans: dict[tuple, AttentionPlan] = {}

    def __call__(self, query, key_cache, value_cache, scale, *, sliding_window=None, softcap=None, k_scale=1.0,
                 v_scale=1.0) -> torch.Tensor:  # fmt: skip
        _check_tensors(query, key_cache, value_cache)
        kind = (query.shape[1], key_cache.shape[1:], query.dtype, key_cache.dtype, scale, softcap, k_scale, v_scale)
        plan = self.plans.get(kind)
        if plan is None:
            _, block_size, num_kv_heads, head_dim = key_cache.shape
            plan = self.plans[kind] = AttentionPlan(
                self.tables, self.lens, self.starts, num_q_heads=query.shape[1], num_kv_heads=num_kv_heads,
                head_dim=head_dim, block_size=block_size, dtype=query.dtype, kv_dtype=key_cache.dtype, scale=scale,
                softcap=softcap, k_scale=k_scale, v_scale=v_scale, invariant=self.invariant,
            )  # fmt: skip
        return plan(query, key_cache, value_cache, sliding_window)


@called_as(CacheWrite)
def reshape_and_cache(write: CacheWrite) -> None:
    """Write key/value `[T, Hkv, D]` into the NHD pools at `slot_mapping[T]`; slot -1 is skipped."""
    CacheWriter(write.slot_mapping)(write.key, write.value, write.key_cache, write.value_cache,
                                    k_scale=write.k_scale, v_scale=write.v_scale)  # fmt: skip


def _copies_rows(key, value, key_cache, value_cache) -> bool:
    """Whether the C row copy makes this write: CPU tensors, pools of one dtype (one element size serves both),
    not fp8 (which scales and rounds: the oracle's write does that)."""
    on_cpu = all(t.device.type == "cpu" for t in (key, value, key_cache, value_cache))
    return on_cpu and value_cache.dtype == key_cache.dtype and not reference.is_fp8(key_cache.dtype)


class CacheWriter:
    """The cache write of every layer of one forward: the slot mapping goes into the struct once."""

    def __init__(self, slot_mapping: torch.Tensor) -> None:
        self.slots = slot_mapping.to(torch.int64).contiguous()
        self.args = CacheWriteArgs(slot_mapping=self.slots.data_ptr(), num_tokens=self.slots.shape[0],
                                   num_threads=torch.get_num_threads())  # fmt: skip

    def __call__(self, key, value, key_cache, value_cache, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        if not _copies_rows(key, value, key_cache, value_cache):
            return reference.reshape_and_cache(key, value, key_cache, value_cache, self.slots, k_scale=k_scale,
                                               v_scale=v_scale)  # fmt: skip
        num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
        rows = (self.args.num_tokens, num_kv_heads, head_dim)
        if key.shape != rows or value.shape != rows or value_cache.shape != key_cache.shape:
            raise ValueError(f"cache write: key {tuple(key.shape)} and value {tuple(value.shape)} must be {rows} "
                             f"(tokens, the pool's kv heads, head dim) for pools {tuple(key_cache.shape)}")
        if key.dtype != key_cache.dtype or value.dtype != value_cache.dtype:  # the oracle's cast
            key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
        key, value = unit_last_stride(key), unit_last_stride(value)
        args = self.args
        args.key, (args.k_stride_token, args.k_stride_head) = key.data_ptr(), key.stride()[:2]
        args.value, (args.v_stride_token, args.v_stride_head) = value.data_ptr(), value.stride()[:2]
        args.key_cache, args.value_cache = key_cache.data_ptr(), value_cache.data_ptr()
        args.k_stride_block, args.k_stride_slot, args.k_stride_head_cache = key_cache.stride()[:3]
        args.v_stride_block, args.v_stride_slot, args.v_stride_head_cache = value_cache.stride()[:3]
        args.num_slots, args.num_kv_heads, args.head_dim = num_blocks * block_size, num_kv_heads, head_dim
        args.block_size, args.element_bytes = block_size, key_cache.element_size()
        check_status(_library().pb_cpu_reshape_and_cache(ctypes.byref(args)), _library().pb_cpu_error_string,
                     "cpu cache write")  # fmt: skip


class AttentionPlan:
    """The kernel's arguments for every layer of one step: the step's block tables, lengths and query starts are
    set once, and each call only points the struct at its own query, pools and output. `paged_attention` builds
    one per call after its checks; the fused forward builds one per step and calls it for every layer."""

    def __init__(self, block_tables, seq_lens, query_start_loc, *, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, dtype: torch.dtype, scale: float,
                 kv_dtype: torch.dtype | None = None, softcap: float | None = None, k_scale: float = 1.0,
                 v_scale: float = 1.0, invariant: bool | None = None) -> None:  # fmt: skip
        tables, lens, starts = as_int32(block_tables), as_int32(seq_lens), as_int32(query_start_loc)
        self._keep = (tables, lens, starts)  # the struct points into them
        invariant = batch_invariant_enabled() if invariant is None else invariant
        self.args = AttentionArgs(
            block_tables=tables.data_ptr(), table_stride=tables.stride(0), seq_lens=lens.data_ptr(),
            query_start_loc=starts.data_ptr(), num_seqs=lens.shape[0], num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, q_dtype=QUERY_DTYPES[dtype],
            kv_dtype=KV_DTYPES[kv_dtype or dtype], num_threads=torch.get_num_threads(), invariant=int(invariant),
            scale=scale, softcap=softcap or 0.0, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        self.function = _library().pb_cpu_paged_attention

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 sliding_window: int | None = None, k_scale: float | None = None,
                 v_scale: float | None = None) -> torch.Tensor:  # fmt: skip
        """Attention of one layer's `query [T, Hq, D]` (unit stride along D) over its pools: `[T, Hq, D]`. `k_scale`
        and `v_scale`: this layer's fp8 scales, where they differ from the plan's."""
        args, out = self.args, query.new_empty(query.shape)
        if k_scale is not None:
            args.k_scale, args.v_scale = k_scale, v_scale
        args.query, args.q_stride_token, args.q_stride_head = query.data_ptr(), *query.stride()[:2]
        args.out, args.o_stride_token, args.o_stride_head = out.data_ptr(), *out.stride()[:2]
        args.key_cache, args.value_cache = key_cache.data_ptr(), value_cache.data_ptr()
        args.k_stride_block, args.k_stride_slot, args.k_stride_head = key_cache.stride()[:3]
        args.v_stride_block, args.v_stride_slot, args.v_stride_head = value_cache.stride()[:3]
        args.sliding_window = sliding_window or 0
        check_status(self.function(ctypes.byref(args)), _library().pb_cpu_error_string, "cpu paged attention")
        return out


__all__ = ["AttentionPlan", "CacheWriter", "StepPlans", "paged_attention", "reshape_and_cache", "unavailable_reason"]
