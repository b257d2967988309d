"""Pure-PyTorch paged attention: the oracle every other backend is tested against.

Runs on CPU and GPU. Sequences are computed one by one: all scores of a sequence (its query rows and
the q heads of each kv head packed as rows), one softmax, then probabilities x V. K and V are gathered
from their blocks a chunk at a time into a reused buffer. Math is fp32 throughout.
"""

from __future__ import annotations

import torch

CHUNK_TOKENS = 256  # tokens gathered per step: small enough for the copy to stay in cache

FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


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
    slots = slot_mapping.to(device=key.device, dtype=torch.long)
    valid = slots >= 0
    if not bool(valid.all()):
        key, value, slots = key[valid], value[valid], slots[valid]
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
        if is_fp8(cache.dtype):
            # index_put is not implemented for fp8 on every device: write the raw bytes.
            quantized = (src.float() / scale).to(cache.dtype)
            flat.view(torch.uint8)[slots] = quantized.view(torch.uint8)
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
    """Varlen causal attention of `query [T, Hq, D]` over paged K/V. See DESIGN.md for the contract."""
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(query)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    tables = block_tables.to(device=query.device, dtype=torch.long)
    blocks_per_chunk = max(1, CHUNK_TOKENS // block_size)
    key_buffer = key_cache.new_empty((blocks_per_chunk, *key_cache.shape[1:]))
    value_buffer = value_cache.new_empty((blocks_per_chunk, *value_cache.shape[1:]))

    for b, length in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        if q_len == 0:
            continue
        # rows of one kv head are (query token, q head of its group): one strided matmul per chunk
        q = query[starts[b] : starts[b + 1]].float().view(q_len, num_kv_heads, group, head_dim)
        q = q.transpose(0, 1).reshape(num_kv_heads, q_len * group, head_dim) * (scale * k_scale)
        scores = torch.empty(num_kv_heads, q_len * group, length, device=query.device)
        for start, keys in _chunks(key_cache, tables[b], length, key_buffer):
            scores[:, :, start : start + keys.shape[0]] = torch.matmul(q, keys.permute(1, 2, 0))
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(length - q_len, length, device=query.device)[:, None]
        k_pos = torch.arange(length, device=query.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        visible = visible[:, None, :].expand(q_len, group, length).reshape(q_len * group, length)
        probs = torch.softmax(scores.masked_fill_(~visible, float("-inf")), dim=-1)
        o = torch.zeros(num_kv_heads, q_len * group, head_dim, device=query.device)
        for start, values in _chunks(value_cache, tables[b], length, value_buffer):
            o.baddbmm_(probs[:, :, start : start + values.shape[0]], values.transpose(0, 1))
        o = o.view(num_kv_heads, q_len, group, head_dim).transpose(0, 1).reshape(q_len, num_q_heads, head_dim)
        out[starts[b] : starts[b + 1]] = (o * v_scale if v_scale != 1.0 else o).to(query.dtype)
    return out
