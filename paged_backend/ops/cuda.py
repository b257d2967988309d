"""CUDA backend: the csrc/ decode kernel and cache write, built by nvcc on first use and loaded with ctypes.

The kernels are registered as torch.library custom ops (`paged_backend::paged_decode`,
`paged_backend::reshape_and_cache`) with fake implementations, so torch.compile and CUDA-graph capture
see them as opaque ops; they launch on `torch.cuda.current_stream()`.

This backend runs decode only (one query token per sequence). A prefill or mixed batch raises
`BackendUnavailable` rather than silently running another backend; auto-selection in the dispatcher
sends those batches to Triton.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from paged_backend.errors import BackendUnavailable
from paged_backend.ops import _cuda_abi
from paged_backend.ops._c_abi import check_status, paged_kv_values
from paged_backend.ops._contract import AttentionBatch, CacheWrite, as_int32, called_as, max_context, unit_last_stride
from paged_backend.ops._cuda_build import CudaBuildError, cached_library, find_nvcc

MAX_HEAD_DIM = 256


@cache
def _library() -> ctypes.CDLL:
    major, minor = torch.cuda.get_device_capability()
    return _cuda_abi.load_library(cached_library([major * 10 + minor]))


def unavailable_reason() -> str | None:
    """None when the CUDA kernels can run here, else a sentence saying why not."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    if find_nvcc() is None:
        return "nvcc was not found on PATH or in $CUDA_HOME/bin, so csrc/ cannot be built; install the CUDA toolkit"
    try:
        _library()
    except (CudaBuildError, OSError, RuntimeError) as exc:
        return f"building or loading the csrc/ library failed: {exc}"
    return None


def _stream() -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def _dtype_code(dtype: torch.dtype) -> int:
    if dtype not in _cuda_abi.DTYPE_CODES:
        raise BackendUnavailable(f"the cuda backend does not support {dtype}; use float32/16, bfloat16 or fp8 e4m3")
    return _cuda_abi.DTYPE_CODES[dtype]


def _check_pool(pool: torch.Tensor) -> None:
    """The kernel reads 8 elements per lane with one vector load: rows must be 8-element aligned."""
    aligned = pool.stride(-1) == 1 and all(s % 8 == 0 for s in pool.stride()[:-1]) and pool.data_ptr() % 16 == 0
    if not aligned:
        raise BackendUnavailable("the cuda backend needs KV pools with unit last stride, other strides a multiple "
                                 "of 8 elements and 16-byte aligned storage; use backend='triton'")


@torch.library.custom_op("paged_backend::paged_decode", mutates_args=(), device_types="cuda")
def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """Decode attention: `query [B, Hq, D]`, one token per sequence; sliding_window/softcap 0 means off."""
    num_seqs, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    _check_pool(key_cache)
    _check_pool(value_cache)
    out = torch.empty_like(query)
    # partitions cover the longest context the tables can address: known without reading seq_lens
    num_partitions = max(1, -(-max_context(block_tables, block_size) // _cuda_abi.PARTITION_SIZE))
    partial_out = partial_max = partial_sum = None
    if num_partitions > 1:
        partial_out = torch.empty(num_seqs, num_q_heads, num_partitions, head_dim,
                                  dtype=torch.float32, device=query.device)
        partial_max = torch.empty(num_seqs, num_q_heads, num_partitions, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    args = _cuda_abi.DecodeArgs(
        query.data_ptr(), query.stride(0), query.stride(1),
        *paged_kv_values(key_cache, value_cache, block_tables, seq_lens),
        out.data_ptr(), out.stride(0), out.stride(1),
        *(t.data_ptr() if t is not None else None for t in (partial_out, partial_max, partial_sum)),
        num_seqs, num_q_heads, num_kv_heads, head_dim, block_size, num_partitions,
        scale, softcap, k_scale, v_scale, sliding_window,
    )
    lib = _library()
    status = lib.pb_paged_decode(ctypes.byref(args), _dtype_code(query.dtype), _dtype_code(key_cache.dtype), _stream())
    check_status(status, lib.pb_error_string, "paged_backend::paged_decode")
    return out


@paged_decode.register_fake
def _(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap, k_scale, v_scale):
    return torch.empty_like(query)


@torch.library.custom_op("paged_backend::reshape_and_cache", mutates_args=("key_cache", "value_cache"),
                         device_types="cuda")
def reshape_and_cache_op(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    """Write key/value `[T, Hkv, D]` rows to `slot_mapping` (int64, -1 skipped) in the NHD pools."""
    num_tokens, num_heads, head_dim = key.shape
    args = _cuda_abi.CacheWriteArgs(
        key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.data_ptr(), value_cache.data_ptr(),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        slot_mapping.data_ptr(), num_tokens, num_heads, head_dim, key_cache.shape[1], k_scale, v_scale,
    )
    lib = _library()
    status = lib.pb_reshape_and_cache(ctypes.byref(args), _dtype_code(key.dtype), _dtype_code(key_cache.dtype),
                                      _stream())
    check_status(status, lib.pb_error_string, "paged_backend::reshape_and_cache")


@reshape_and_cache_op.register_fake
def _(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
    return None


@called_as(CacheWrite)
def reshape_and_cache(write: CacheWrite) -> None:
    """Write key/value `[T, Hkv, D]` into the NHD pools at `slot_mapping[T]`; slot -1 is skipped."""
    key, value = write.key, write.value
    if write.key_cache.dtype != torch.float8_e4m3fn:  # same-dtype copies; fp8 pools quantize from any input dtype
        key, value = key.to(write.key_cache.dtype), value.to(write.value_cache.dtype)
    reshape_and_cache_op(unit_last_stride(key), unit_last_stride(value), write.key_cache, write.value_cache,
                         write.slot_mapping.to(torch.int64), float(write.k_scale), float(write.v_scale))


@called_as(AttentionBatch)
def paged_attention(batch: AttentionBatch) -> torch.Tensor:
    """Decode-only paged attention (query row b is sequence b's one new token); the contract is `AttentionBatch`."""
    if not batch.decode_only:
        raise BackendUnavailable(
            f"the cuda backend runs decode batches only (one query token per sequence), got {batch.query.shape[0]} "
            f"tokens for {batch.seq_lens.shape[0]} sequences; use backend='triton' or auto selection"
        )
    head_dim = batch.query.shape[-1]
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        raise BackendUnavailable(f"the cuda backend needs head_dim a multiple of 8 and <= 256, got {head_dim}")
    return paged_decode(
        unit_last_stride(batch.query), batch.key_cache, batch.value_cache,
        as_int32(batch.block_tables), as_int32(batch.seq_lens), float(batch.scale),
        int(batch.sliding_window or 0), float(batch.softcap or 0.0), float(batch.k_scale), float(batch.v_scale),
    )
