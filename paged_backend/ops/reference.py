"""Pure-PyTorch paged attention: the oracle every other backend is tested against.

Runs on CPU and GPU. Sequences are computed one by one: all scores of a sequence (its query rows and
the q heads of each kv head packed as rows), one softmax, then probabilities x V. K and V are gathered
from their blocks a chunk at a time into a reused buffer. Math is fp32 throughout.
"""

from __future__ import annotations

import torch

from paged_backend.ops._contract import AttentionBatch, CacheWrite, called_as

CHUNK_TOKENS = 256  # tokens gathered per step: small enough for the copy to stay in cache

FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def to_fp8(x: torch.Tensor, pool_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Quantize rows for an fp8 pool: divide by the scale in fp32, saturate to the finite range (as the csrc kernel
    does; torch's own cast saturates in some releases and gives NaN in others), then torch's rounding."""
    limit = torch.finfo(pool_dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(pool_dtype)


@called_as(CacheWrite)
def reshape_and_cache(write: CacheWrite) -> None:
    """Write key/value `[T, Hkv, D]` into the NHD pools at `slot_mapping[T]`; slot -1 is skipped."""
    key, value = write.key, write.value
    slots = write.slot_mapping.to(device=key.device, dtype=torch.long)
    valid = slots >= 0
    if not bool(valid.all()):
        key, value, slots = key[valid], value[valid], slots[valid]
    for src, cache, scale in ((key, write.key_cache, write.k_scale), (value, write.value_cache, write.v_scale)):
        flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
        if is_fp8(cache.dtype):
            # index_put is not implemented for fp8 on every device: write the raw bytes.
            flat.view(torch.uint8)[slots] = to_fp8(src, cache.dtype, scale).view(torch.uint8)
        else:
            flat[slots] = src.to(cache.dtype)


def _chunks(cache: torch.Tensor, table: torch.Tensor, length: int, buffer: torch.Tensor):
    """(first token, fp32 `[n, Hkv, D]`) pieces of the first `length` tokens behind `table`, in order.

    Gathering a cache-sized chunk at a time into one reused buffer keeps the copy out of DRAM.
    """
    block_size, blocks_per_chunk = cache.shape[1], buffer.shape[0]
    num_blocks = -(-length // block_size)
    for first in range(0, num_blocks, blocks_per_chunk):
        blocks = table[first : min(first + blocks_per_chunk, num_blocks)]
        chunk = buffer[: blocks.shape[0]]
        torch.index_select(cache, 0, blocks, out=chunk)
        start = first * block_size
        yield start, chunk.view(-1, cache.shape[2], cache.shape[3])[: length - start].float()


@called_as(AttentionBatch)
def paged_attention(batch: AttentionBatch) -> torch.Tensor:
    """Varlen causal attention of `query [T, Hq, D]` over paged K/V; the contract is `AttentionBatch`."""
    query, key_cache, value_cache = batch.query, batch.key_cache, batch.value_cache
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads, block_size, group = key_cache.shape[2], key_cache.shape[1], batch.group
    out = torch.zeros_like(query)
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    tables = batch.block_tables.to(device=query.device, dtype=torch.long)
    blocks_per_chunk = max(1, CHUNK_TOKENS // block_size)
    key_buffer = key_cache.new_empty((blocks_per_chunk, *key_cache.shape[1:]))
    value_buffer = value_cache.new_empty((blocks_per_chunk, *value_cache.shape[1:]))

    for b, length in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        if q_len == 0:
            continue
        # rows of one kv head are (query token, q head of its group): one strided matmul per chunk
        q = query[starts[b] : starts[b + 1]].float().view(q_len, num_kv_heads, group, head_dim)
        q = q.transpose(0, 1).reshape(num_kv_heads, q_len * group, head_dim) * (batch.scale * batch.k_scale)
        scores = torch.empty(num_kv_heads, q_len * group, length, device=query.device)
        for start, keys in _chunks(key_cache, tables[b], length, key_buffer):
            scores[:, :, start : start + keys.shape[0]] = torch.matmul(q, keys.permute(1, 2, 0))
        if batch.softcap:
            scores = batch.softcap * torch.tanh(scores / batch.softcap)
        q_pos = torch.arange(length - q_len, length, device=query.device)[:, None]
        k_pos = torch.arange(length, device=query.device)[None, :]
        visible = k_pos <= q_pos
        if batch.sliding_window is not None:
            visible &= k_pos > q_pos - batch.sliding_window
        visible = visible[:, None, :].expand(q_len, group, length).reshape(q_len * group, length)
        probs = torch.softmax(scores.masked_fill_(~visible, float("-inf")), dim=-1)
        o = torch.zeros(num_kv_heads, q_len * group, head_dim, device=query.device)
        for start, values in _chunks(value_cache, tables[b], length, value_buffer):
            o.baddbmm_(probs[:, :, start : start + values.shape[0]], values.transpose(0, 1))
        o = o.view(num_kv_heads, q_len, group, head_dim).transpose(0, 1).reshape(q_len, num_q_heads, head_dim)
        out[starts[b] : starts[b + 1]] = (o * batch.v_scale if batch.v_scale != 1.0 else o).to(query.dtype)
    return out
