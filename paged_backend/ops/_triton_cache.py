"""Triton cache write: one program per token copies its `[Hkv, D]` key and value rows to their slot.

The rows arrive already in the pool's dtype (fp8 pools: quantized by the caller), so this is a pure copy.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_row(src_ptr, dst_ptr, token, block, offset,
               stride_src_token, stride_src_head, stride_dst_block, stride_dst_slot, stride_dst_head,
               NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
               HEAD_DIM_PAD: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    row = tl.load(src_ptr + token * stride_src_token + heads * stride_src_head + dims, mask=mask)
    dst = dst_ptr + block * stride_dst_block + offset * stride_dst_slot + heads * stride_dst_head + dims
    tl.store(dst, row.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block, stride_vc_slot, stride_vc_head,
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token (CUDA-graph batches pad slot_mapping with -1)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    _store_row(key_ptr, key_cache_ptr, token, block, offset,
               stride_key_token, stride_key_head, stride_kc_block, stride_kc_slot, stride_kc_head,
               NUM_HEADS, HEAD_DIM, HEADS_PAD, HEAD_DIM_PAD)
    _store_row(value_ptr, value_cache_ptr, token, block, offset,
               stride_value_token, stride_value_head, stride_vc_block, stride_vc_slot, stride_vc_head,
               NUM_HEADS, HEAD_DIM, HEADS_PAD, HEAD_DIM_PAD)
