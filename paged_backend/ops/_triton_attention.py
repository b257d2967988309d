"""Triton varlen paged attention: one kernel for mixed prefill + decode, optionally split over the KV axis.

A program owns (a block of query rows of one sequence, one kv head, one KV segment). Its M tile packs
`BLOCK_Q` query tokens x `GROUP` query heads that share the kv head, so each K/V tile is loaded once for
the whole GQA group. Softmax is online with fp32 state. With `NUM_SEGMENTS > 1` (flash-decoding) each
program covers a slice of the KV tiles and writes unnormalised partials that `reduce_segments_kernel`
merges with their log-sum-exp weights.

Imported lazily: `@triton.jit` picks interpreter or compiler mode from TRITON_INTERPRET at decoration.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # tanh from exp: saturates cleanly to +-1 (exp overflow gives 1 - 0) and runs in the interpreter
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _e4m3_as_fp16(x):
    """e4m3fn bytes -> fp16 holding value / 256: exponent and mantissa bits shift into place exactly.

    Bit decoding works on every GPU (Triton has no e4m3 type before sm89); the caller folds 256 into the scales.
    """
    bits = x.to(tl.uint16)
    return (((bits & 0x7F) << 7) | ((bits & 0x80) << 8)).to(tl.float16, bitcast=True)


@triton.jit
def _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Last sequence b whose first query block `query_start_loc[b] // BLOCK_Q + b` is <= q_block."""
    lo = tl.zeros([], dtype=tl.int32)  # tensors, not constants: num_seqs == 1 is specialised to a constexpr
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def paged_attention_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    query_ptr, key_cache_ptr, value_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale, softcap, v_scale, sliding_window,
    num_seqs, num_q_heads,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    seq = _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return  # the grid is an upper bound on the number of query blocks
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_tok = local_block * BLOCK_Q + offs_m // GROUP
    q_head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_tok < q_len)
    dim_valid = offs_d < HEAD_DIM
    q_row = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        query_ptr + q_row[:, None] * stride_q_token + q_head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_valid[:, None] & dim_valid[None, :], other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(tl.float32)  # every dot below runs in q's dtype
    q_pos = context_len + q_tok

    # keys this block of rows can see: [kv_start, kv_end)
    last_tok = tl.minimum(q_len, (local_block + 1) * BLOCK_Q) - 1
    kv_end = context_len + last_tok + 1
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(context_len + local_block * BLOCK_Q - sliding_window + 1, 0)
    tile_lo = kv_start // TILE
    tile_hi = tl.cdiv(kv_end, TILE)
    if NUM_SEGMENTS > 1:
        tiles_per_segment = tl.cdiv(tile_hi - tile_lo, NUM_SEGMENTS)
        tile_lo = tile_lo + segment * tiles_per_segment
        tile_hi = tl.minimum(tile_lo + tiles_per_segment, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * TILE + tl.arange(0, TILE)
        key_valid = offs_n < kv_end
        block_ids = tl.load(block_tables_ptr + seq * stride_table + offs_n // BLOCK_SIZE, mask=key_valid, other=0)
        block_ids = block_ids.to(tl.int64)
        slot = offs_n % BLOCK_SIZE
        k_offsets = block_ids * stride_k_block + slot * stride_k_slot + kv_head * stride_k_head
        k = tl.load(key_cache_ptr + k_offsets[None, :] + offs_d[:, None],
                    mask=key_valid[None, :] & dim_valid[:, None], other=0)
        if KV_FP8:
            k = _e4m3_as_fp16(k)
        # fp8 -> fp16/bf16/fp32 is exact; the pool scale is folded into qk_scale and v_scale
        scores = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
        if USE_SOFTCAP:
            scores = softcap * _tanh(scores / softcap)
        visible = key_valid[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_offsets = block_ids * stride_v_block + slot * stride_v_slot + kv_head * stride_v_head
        v = tl.load(value_cache_ptr + v_offsets[:, None] + offs_d[None, :],
                    mask=key_valid[:, None] & dim_valid[None, :], other=0)
        if KV_FP8:
            v = _e4m3_as_fp16(v)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale
        tl.store(out_ptr + q_row[:, None] * stride_o_token + q_head[:, None] * stride_o_head + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
    else:
        partial = (q_row * num_q_heads + q_head) * NUM_SEGMENTS + segment
        tl.store(partial_max_ptr + partial, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + partial, l_i, mask=row_valid)
        tl.store(partial_out_ptr + partial[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_valid[:, None])


@triton.jit
def reduce_segments_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    v_scale, num_q_heads, stride_o_token, stride_o_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    first = (token * num_q_heads + head) * NUM_SEGMENTS
    segments = first + tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    seg_max = tl.load(partial_max_ptr + segments)
    seg_sum = tl.load(partial_sum_ptr + segments)
    global_max = tl.max(seg_max, 0)
    weight = tl.exp(seg_max - tl.where(global_max == float("-inf"), 0.0, global_max))  # empty segments: 0
    denom = tl.sum(weight * seg_sum, 0)
    seg_out = tl.load(partial_out_ptr + segments[:, None] * HEAD_DIM_PAD + offs_d[None, :])
    o = tl.sum(seg_out * weight[:, None], 0) / tl.where(denom == 0.0, 1.0, denom) * v_scale
    tl.store(out_ptr + token * stride_o_token + head * stride_o_head + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
