"""Triton backend: the varlen paged-attention kernel (mixed prefill + decode, split-KV for long decode)
and the cache write. Kernels live in `_triton_attention` / `_triton_cache` and are imported on first use,
so asking whether this backend is available never compiles anything.

On CPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`), which is how the tests check
them against the oracle on machines without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from types import ModuleType

import torch

from paged_backend.ops.reference import is_fp8

# Below this many (sequence, kv head) programs a decode batch leaves most SMs idle: split the KV axis.
SPLIT_KV_MAX_PROGRAMS = 128
SPLIT_KV_TOKENS_PER_SEGMENT = 512
SPLIT_KV_MAX_SEGMENTS = 16
KV_TILE = 32
FP8_BIT_DECODE_SCALE = 256.0  # the kernel decodes e4m3 bytes to value / 256 (see _e4m3_as_fp16)


def unavailable_reason() -> str | None:
    """None when the Triton kernels can run here, else a sentence saying why not."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed; pip install 'paged-backend[triton]'"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "no CUDA device is visible and TRITON_INTERPRET is not 1 (Triton's CPU interpreter)"
    return None


@cache
def _kernels() -> tuple[ModuleType, ModuleType]:
    from paged_backend.ops import _triton_attention, _triton_cache

    return _triton_attention, _triton_cache


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _to_pool_dtype(x: torch.Tensor, pool_dtype: torch.dtype, scale: float) -> torch.Tensor:
    if not is_fp8(pool_dtype):
        return x
    # torch's rounding, identical to the oracle's (Triton's interpreter mis-rounds fp32 -> fp8 carries)
    return (x.float() / scale).to(pool_dtype)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value `[T, Hkv, D]` into the NHD pools at `slot_mapping[T]`; slot -1 is skipped."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key = _unit_last_stride(_to_pool_dtype(key, key_cache.dtype, k_scale))
    value = _unit_last_stride(_to_pool_dtype(value, value_cache.dtype, v_scale))
    _, cache_kernels = _kernels()
    cache_kernels.reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1], NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        HEADS_PAD=_next_pow2(num_heads), HEAD_DIM_PAD=_next_pow2(head_dim),
    )


def choose_num_segments(num_seqs: int, num_tokens: int, num_kv_heads: int, max_context: int) -> int:
    """KV segments per sequence: >1 only for decode-only batches too small to fill the GPU."""
    if num_tokens != num_seqs or num_seqs * num_kv_heads >= SPLIT_KV_MAX_PROGRAMS:
        return 1
    wanted = max(1, max_context // SPLIT_KV_TOKENS_PER_SEGMENT)
    return min(SPLIT_KV_MAX_SEGMENTS, _next_pow2(wanted))


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
    """Varlen causal paged attention, `[T, Hq, D]` -> `[T, Hq, D]`; contract in DESIGN.md."""
    max_context = block_tables.shape[1] * key_cache.shape[1]  # an upper bound known without a device sync
    segments = choose_num_segments(seq_lens.shape[0], query.shape[0], key_cache.shape[2], max_context)
    return paged_attention_split_kv(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
        sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale, num_segments=segments,
    )


def paged_attention_split_kv(
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
    num_segments: int = 1,
) -> torch.Tensor:
    """`paged_attention` with the KV axis of every sequence split into `num_segments` (a power of two)."""
    if num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two, got {num_segments}")
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    query = _unit_last_stride(query)
    block_tables = block_tables.contiguous()
    head_dim_pad = max(16, _next_pow2(head_dim))
    # M tile = query tokens x the q heads of one kv head; dot needs M >= 16, prefill wants taller tiles
    # (16-bit inputs only: an fp32 64 x 256 Q tile alone would take 64 KiB of shared memory)
    tall = query.is_cuda and num_tokens > num_seqs and query.element_size() <= 2
    prefill_rows = 64 if tall else 16
    block_m = max(prefill_rows, _next_pow2(group))
    block_q = block_m // group
    if num_segments > 1:
        partial_out = torch.empty(num_tokens, num_q_heads, num_segments, head_dim_pad,
                                  dtype=torch.float32, device=query.device)
        partial_max = torch.empty(num_tokens, num_q_heads, num_segments, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = out  # unused by the single-segment kernel
    # the interpreter's numpy dot cannot multiply bf16; on a GPU bf16 goes to the tensor cores as is
    upcast_dot = query.dtype == torch.bfloat16 and not query.is_cuda
    kv_fp8 = is_fp8(key_cache.dtype)
    if kv_fp8 and key_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 pools must be float8_e4m3fn for the Triton kernel, got {key_cache.dtype}")
    if kv_fp8:
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
        k_scale, v_scale = k_scale * FP8_BIT_DECODE_SCALE, v_scale * FP8_BIT_DECODE_SCALE
    attention_kernels, _ = _kernels()
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    attention_kernels.paged_attention_kernel[grid](
        out, partial_out, partial_max, partial_sum,
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        float(scale * k_scale), float(softcap or 0.0), float(v_scale),
        int(sliding_window or 0),
        num_seqs, num_q_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, TILE=KV_TILE, BLOCK_M=block_m, BLOCK_Q=block_q,
        NUM_SEGMENTS=num_segments, USE_SOFTCAP=bool(softcap), USE_WINDOW=sliding_window is not None,
        KV_FP8=kv_fp8, DOT_PRECISION="ieee" if query.dtype == torch.float32 or upcast_dot else "tf32",
        UPCAST_DOT=upcast_dot,
    )
    if num_segments > 1:
        attention_kernels.reduce_segments_kernel[(num_tokens, num_q_heads)](
            out, partial_out, partial_max, partial_sum,
            float(v_scale), num_q_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SEGMENTS=num_segments,
        )
    return out
