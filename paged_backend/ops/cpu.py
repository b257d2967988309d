"""CPU backend: the fused csrc/cpu/ paged-attention kernel, built by the host compiler on first use.

The torch oracle runs a dozen small ops per sequence and layer and gathers K/V into a buffer first; this
kernel reads each sequence's blocks once, in place, for all query rows of a GQA group, threaded with
OpenMP over (sequence, kv head, query tile) at torch's thread count. Cache writes are the oracle's
(one `index_put` per layer is already cheap).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from paged_backend.errors import BackendUnavailable
from paged_backend.ops._cpu_build import CpuBuildError, cached_library
from paged_backend.ops.reference import reshape_and_cache

QUERY_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
KV_DTYPES = {**QUERY_DTYPES, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class AttentionArgs(ctypes.Structure):
    """Mirror of PbCpuAttentionArgs in csrc/cpu/paged_attention_cpu.cpp."""

    _fields_ = [
        ("query", _ptr), ("q_stride_token", _i64), ("q_stride_head", _i64),
        ("key_cache", _ptr), ("value_cache", _ptr),
        ("k_stride_block", _i64), ("k_stride_slot", _i64), ("k_stride_head", _i64),
        ("v_stride_block", _i64), ("v_stride_slot", _i64), ("v_stride_head", _i64),
        ("block_tables", _ptr), ("table_stride", _i64), ("seq_lens", _ptr), ("query_start_loc", _ptr),
        ("out", _ptr), ("o_stride_token", _i64), ("o_stride_head", _i64),
        ("num_seqs", _i32), ("num_q_heads", _i32), ("num_kv_heads", _i32), ("head_dim", _i32),
        ("block_size", _i32), ("q_dtype", _i32), ("kv_dtype", _i32), ("sliding_window", _i32),
        ("num_threads", _i32), ("scale", _f32), ("softcap", _f32), ("k_scale", _f32), ("v_scale", _f32),
    ]


@cache
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(cached_library()))
    lib.pb_cpu_paged_attention.argtypes = [ctypes.POINTER(AttentionArgs)]
    lib.pb_cpu_paged_attention.restype = ctypes.c_int
    lib.pb_cpu_error_string.argtypes = [ctypes.c_int]
    lib.pb_cpu_error_string.restype = ctypes.c_char_p
    lib.pb_cpu_attention_args_size.restype = ctypes.c_uint64
    if lib.pb_cpu_attention_args_size() != ctypes.sizeof(AttentionArgs):
        raise RuntimeError("csrc/cpu disagrees with the ctypes layout of AttentionArgs; rebuild it")
    return lib


def unavailable_reason() -> str | None:
    """None when the CPU kernel builds and loads here, else a sentence saying why not."""
    try:
        _library()
    except (CpuBuildError, OSError, RuntimeError) as exc:
        return f"building or loading the csrc/cpu library failed: {exc}"
    return None


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(dtype=torch.int32).contiguous()


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Varlen causal attention of `query [T, Hq, D]` over paged K/V, same contract as the oracle."""
    if query.device.type != "cpu" or key_cache.device.type != "cpu":
        raise BackendUnavailable("the cpu backend runs on CPU tensors; use backend='triton' or 'cuda' on a GPU")
    if query.dtype not in QUERY_DTYPES or key_cache.dtype not in KV_DTYPES or value_cache.dtype != key_cache.dtype:
        raise BackendUnavailable(f"the cpu backend supports queries in {list(QUERY_DTYPES)} and caches in "
                                 f"{list(KV_DTYPES)}, got {query.dtype} and {key_cache.dtype}/{value_cache.dtype}")
    if query.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise BackendUnavailable("the cpu backend needs a unit stride along head_dim; pass contiguous rows")
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    tables, lens, starts = _int32(block_tables), _int32(seq_lens), _int32(query_start_loc)
    out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=query.dtype)
    args = AttentionArgs(
        query.data_ptr(), query.stride(0), query.stride(1),
        key_cache.data_ptr(), value_cache.data_ptr(), *key_cache.stride()[:3], *value_cache.stride()[:3],
        tables.data_ptr(), tables.stride(0), lens.data_ptr(), starts.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1),
        lens.shape[0], num_q_heads, num_kv_heads, head_dim, block_size,
        QUERY_DTYPES[query.dtype], KV_DTYPES[key_cache.dtype], sliding_window or 0, torch.get_num_threads(),
        scale, softcap or 0.0, k_scale, v_scale,
    )
    lib = _library()
    status = lib.pb_cpu_paged_attention(ctypes.byref(args))
    if status != 0:
        raise RuntimeError(f"cpu paged attention failed: {lib.pb_cpu_error_string(status).decode()}")
    return out


__all__ = ["paged_attention", "reshape_and_cache", "unavailable_reason"]
