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

from paged_backend.ops._contract import AttentionBatch, CacheWrite, called_as, unit_last_stride
from paged_backend.ops.reference import is_fp8, to_fp8

# Below this many (sequence, kv head) programs a decode batch leaves most SMs idle: split the KV axis.
SPLIT_KV_MAX_PROGRAMS = 128
SPLIT_KV_TOKENS_PER_SEGMENT = 512
SPLIT_KV_MAX_SEGMENTS = 16
KV_TILE = 32
FP8_BIT_DECODE_SCALE = 256.0  # the kernel decodes e4m3 bytes to value / 256 (see _e4m3_as_fp16)


def triton_interpreted() -> bool:
    """Whether Triton kernels run under its CPU interpreter (then `triton` accepts CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def unavailable_reason() -> str | None:
    """None when the Triton kernels can run here, else a sentence saying why not."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed; pip install 'paged-backend[triton]'"
    if not torch.cuda.is_available() and not triton_interpreted():
        return "no CUDA device is visible and TRITON_INTERPRET is not 1 (Triton's CPU interpreter)"
    return None


@cache
def _kernels() -> tuple[ModuleType, ModuleType]:
    from paged_backend.ops import _triton_attention, _triton_cache

    return _triton_attention, _triton_cache


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _to_pool_dtype(x: torch.Tensor, pool_dtype: torch.dtype, scale: float) -> torch.Tensor:
    # fp8: torch's rounding, identical to the oracle's (Triton's interpreter mis-rounds fp32 -> fp8 carries)
    return to_fp8(x, pool_dtype, scale) if is_fp8(pool_dtype) else x


@called_as(CacheWrite)
def reshape_and_cache(write: CacheWrite) -> None:
    """Write key/value `[T, Hkv, D]` into the NHD pools at `slot_mapping[T]`; slot -1 is skipped."""
    key, value, key_cache, value_cache = write.key, write.value, write.key_cache, write.value_cache
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key = unit_last_stride(_to_pool_dtype(key, key_cache.dtype, write.k_scale))
    value = unit_last_stride(_to_pool_dtype(value, value_cache.dtype, write.v_scale))
    _, cache_kernels = _kernels()
    cache_kernels.reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, write.slot_mapping,
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


@called_as(AttentionBatch)
def paged_attention(batch: AttentionBatch) -> torch.Tensor:
    """Varlen causal paged attention, `[T, Hq, D]` -> `[T, Hq, D]`; the contract is `AttentionBatch`."""
    if batch.invariant:  # one query token per program, one KV segment: a row's tiles are the same in any batch
        return _launch(batch, 1, one_token=True)
    num_seqs, num_tokens, num_kv_heads = batch.seq_lens.shape[0], batch.query.shape[0], batch.key_cache.shape[2]
    segments = choose_num_segments(num_seqs, num_tokens, num_kv_heads, batch.max_context)
    return _launch(batch, segments)


def paged_attention_split_kv(*args, num_segments: int = 1, **kwargs) -> torch.Tensor:
    """`paged_attention` (same arguments) with the KV axis of every sequence split into `num_segments`."""
    return _launch(AttentionBatch(*args, **kwargs), num_segments)


def _launch(batch: AttentionBatch, num_segments: int, *, one_token: bool = False) -> torch.Tensor:
    """Run the kernel with `num_segments` KV segments per sequence (a power of two; > 1 adds a reduction).

    `one_token`: each program takes one query token (its GQA group of heads), whatever the query length. A row then
    meets the same KV tiles, M tile and order in a prefill chunk, a decode step or any batch: batch-invariant."""
    if num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of two, got {num_segments}")
    num_tokens, num_q_heads, head_dim = batch.query.shape
    num_seqs = batch.seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = batch.key_cache.shape
    group = batch.group
    out = torch.zeros_like(batch.query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    query, key_cache, value_cache = unit_last_stride(batch.query), batch.key_cache, batch.value_cache
    k_scale, v_scale = batch.k_scale, batch.v_scale
    block_tables = batch.block_tables.contiguous()
    head_dim_pad = max(16, _next_pow2(head_dim))
    # M tile = query tokens x the q heads of one kv head; dot needs M >= 16, prefill wants taller tiles
    # (16-bit inputs only: an fp32 64 x 256 Q tile alone would take 64 KiB of shared memory)
    tall = query.is_cuda and num_tokens > num_seqs and query.element_size() <= 2 and not one_token
    prefill_rows = 64 if tall else 16
    block_m = max(prefill_rows, _next_pow2(group))
    block_q = 1 if one_token else block_m // group
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
        query, key_cache, value_cache, block_tables, batch.seq_lens, batch.query_start_loc,
        float(batch.scale * k_scale), float(batch.softcap or 0.0), float(v_scale),
        int(batch.sliding_window or 0),
        num_seqs, num_q_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, TILE=KV_TILE, BLOCK_M=block_m, BLOCK_Q=block_q,
        NUM_SEGMENTS=num_segments, USE_SOFTCAP=bool(batch.softcap), USE_WINDOW=batch.sliding_window is not None,
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
