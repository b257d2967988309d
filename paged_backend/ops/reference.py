"""Pure-PyTorch paged attention: the oracle every other backend is tested against.

Runs on CPU and GPU. Decode rows (q_len == 1) are batched into one gathered matmul;
prefill / chunked-prefill sequences are computed one by one. Math is fp32 throughout.
"""

from __future__ import annotations

import torch

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


def _dequant(x: torch.Tensor, scale: float) -> torch.Tensor:
    x = x.float()
    return x * scale if scale != 1.0 else x


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int, scale: float) -> torch.Tensor:
    """Contiguous `[..., length, Hkv, D]` fp32 view of the first `length` tokens behind `table`."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = table[..., :num_blocks].long().clamp_(min=0)
    gathered = cache[blocks]  # [..., nb, bs, H, D]
    shape = gathered.shape
    gathered = gathered.reshape(*shape[:-4], shape[-4] * shape[-3], shape[-2], shape[-1])
    return _dequant(gathered[..., :length, :, :], scale)


def _probs(scores: torch.Tensor, scale: float, softcap: float | None, mask: torch.Tensor):
    scores = scores * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)


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
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    decode = [b for b, q in enumerate(q_lens) if q == 1]
    others = [b for b, q in enumerate(q_lens) if q > 1]

    if decode:
        idx = torch.tensor(decode, device=query.device)
        rows = torch.tensor([starts[b] for b in decode], device=query.device)
        ctx = torch.tensor([lens[b] for b in decode], device=query.device)
        max_len = max(lens[b] for b in decode)
        tables = block_tables.to(query.device)[idx]
        keys = _gather(key_cache, tables, max_len, k_scale)  # [B, L, Hkv, D]
        values = _gather(value_cache, tables, max_len, v_scale)
        q = query[rows].float().view(len(decode), num_kv_heads, group, head_dim)
        scores = torch.einsum("bhgd,blhd->bhgl", q, keys)
        pos = torch.arange(max_len, device=query.device)
        mask = pos[None, :] < ctx[:, None]
        if sliding_window is not None:
            mask &= pos[None, :] > (ctx[:, None] - 1 - sliding_window)
        probs = _probs(scores, scale, softcap, mask[:, None, None, :])
        o = torch.einsum("bhgl,blhd->bhgd", probs, values)
        out[rows] = o.reshape(len(decode), num_q_heads, head_dim).to(query.dtype)

    for b in others:
        q_len, length = q_lens[b], lens[b]
        table = block_tables[b].to(query.device)
        keys = _gather(key_cache, table, length, k_scale)  # [L, Hkv, D]
        values = _gather(value_cache, table, length, v_scale)
        q = query[starts[b] : starts[b + 1]].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,lhd->hgql", q, keys)
        q_pos = torch.arange(length - q_len, length, device=query.device)[:, None]
        k_pos = torch.arange(length, device=query.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        probs = _probs(scores, scale, softcap, mask)
        o = torch.einsum("hgql,lhd->qhgd", probs, values)
        out[starts[b] : starts[b + 1]] = o.reshape(q_len, num_q_heads, head_dim).to(query.dtype)
    return out
