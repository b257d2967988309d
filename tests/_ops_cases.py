"""One grid of paged-attention cases shared by every backend's tests, plus a naive contiguous oracle.

A case describes a batch (per-sequence query and context lengths, head geometry, block size, features);
`build_case` turns it into pools filled through shuffled block tables, and `naive_attention` computes
the expected output per sequence from the contiguous K/V with an explicit float64 softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class AttentionCase:
    name: str
    q_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_size: int = 16
    num_kv_heads: int = 2
    group: int = 1
    head_dim: int = 32
    dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype | None = None  # None: the pools use `dtype`
    sliding_window: int | None = None
    softcap: float | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    extra_blocks: int = 3  # free blocks left in the pool so tables point at scattered ids
    seed: int = 0

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def decode_only(self) -> bool:
        return all(q == 1 for q in self.q_lens)


@dataclass
class BuiltCase:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor  # slots of every context token, sequence after sequence
    keys: list[torch.Tensor]  # per sequence [L, Hkv, D], dequantized fp32 view of what the pools hold
    values: list[torch.Tensor]
    scale: float

    def attention_args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)


def _mixed(name: str, **kw) -> AttentionCase:
    # decode, chunked prefill over a cached prefix, fresh prefill, decode at a block edge
    return AttentionCase(name, q_lens=(1, 5, 9, 1), seq_lens=(7, 21, 9, 33), **kw)


def _grid() -> list[AttentionCase]:
    cases = [
        _mixed(f"mixed-bs{bs}-g{group}", block_size=bs, group=group)
        for bs in (1, 16, 32)
        for group in (1, 4, 8)
    ]
    cases += [
        _mixed("mixed-fp16-g4", group=4, dtype=torch.float16),
        _mixed("mixed-bf16-g4", group=4, dtype=torch.bfloat16),
        _mixed("mixed-window", group=4, sliding_window=6),
        _mixed("mixed-softcap", group=2, softcap=5.0),
        _mixed("mixed-window-softcap-bs1", block_size=1, group=2, sliding_window=4, softcap=3.0),
        _mixed("mixed-fp8", group=4, dtype=torch.float16, kv_dtype=FP8, k_scale=0.05, v_scale=0.02),
        _mixed("mixed-fp8-fp32q", group=1, kv_dtype=FP8, k_scale=0.5, v_scale=0.25),
        AttentionCase("prefill-only-g3", q_lens=(4, 13), seq_lens=(4, 13), group=3, head_dim=16),
        AttentionCase("decode-ragged", q_lens=(1,) * 5, seq_lens=(1, 2, 17, 40, 64), group=4),
        AttentionCase("decode-window-bf16", q_lens=(1,) * 3, seq_lens=(5, 30, 48), group=8,
                      dtype=torch.bfloat16, sliding_window=10),
        AttentionCase("decode-fp8-bf16", q_lens=(1,) * 3, seq_lens=(3, 19, 50), group=4,
                      dtype=torch.bfloat16, kv_dtype=FP8, k_scale=0.1, v_scale=0.1),
    ]
    return cases


CASES: list[AttentionCase] = _grid()
# Few long decode sequences: the shape the split-KV (flash-decoding) path is for.
SPLIT_KV_CASES: list[AttentionCase] = [
    AttentionCase("split-decode", q_lens=(1, 1), seq_lens=(70, 129), group=4),
    AttentionCase("split-decode-window-softcap", q_lens=(1, 1), seq_lens=(90, 33), group=2,
                  sliding_window=40, softcap=4.0, dtype=torch.float16),
    AttentionCase("split-decode-fp8", q_lens=(1,), seq_lens=(100,), group=8, dtype=torch.bfloat16,
                  kv_dtype=FP8, k_scale=0.05, v_scale=0.05),
]


def _quantize(x: torch.Tensor, kv_dtype: torch.dtype, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored, dequantized fp32) for values that go into a pool of `kv_dtype`."""
    if kv_dtype == FP8:
        stored = (x.float() / scale).to(FP8)
        return stored, stored.float() * scale
    stored = x.to(kv_dtype)
    return stored, stored.float()


def build_case(case: AttentionCase, device: str | torch.device = "cpu", *, garbage_padding: bool = True) -> BuiltCase:
    """Random pools and a batch for `case`; tables are a random permutation of non-null blocks."""
    gen = torch.Generator().manual_seed(case.seed)
    bs, hkv, dim = case.block_size, case.num_kv_heads, case.head_dim
    kv_dtype = case.kv_dtype or case.dtype
    blocks_per_seq = [-(-length // bs) for length in case.seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + case.extra_blocks
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 stays the null block
    max_blocks = max(blocks_per_seq) + 1
    pad = num_blocks - 1 if garbage_padding else 0  # padding points at a real block: must never be read
    table = torch.full((len(case.seq_lens), max_blocks), pad, dtype=torch.int32)

    # poison every slot that is not written (0x7F is NaN in e4m3fn) so reading a wrong slot shows up
    key_cache = torch.empty(num_blocks, bs, hkv, dim, dtype=kv_dtype)
    value_cache = torch.empty_like(key_cache)
    for pool in (key_cache, value_cache):
        if kv_dtype == FP8:
            pool.view(torch.uint8).fill_(0x7F)
        else:
            pool.fill_(float("nan"))
    keys, values, slots = [], [], []
    for b, length in enumerate(case.seq_lens):
        table[b, : blocks_per_seq[b]] = torch.tensor([ids.pop() for _ in range(blocks_per_seq[b])])
        pos = torch.arange(length)
        seq_slots = table[b, pos // bs].long() * bs + pos % bs
        k = torch.randn(length, hkv, dim, generator=gen)
        v = torch.randn(length, hkv, dim, generator=gen)
        k_stored, k_deq = _quantize(k, kv_dtype, case.k_scale)
        v_stored, v_deq = _quantize(v, kv_dtype, case.v_scale)
        key_cache.view(-1, hkv, dim).view(torch.uint8 if kv_dtype == FP8 else kv_dtype)[seq_slots] = (
            k_stored.view(torch.uint8) if kv_dtype == FP8 else k_stored
        )
        value_cache.view(-1, hkv, dim).view(torch.uint8 if kv_dtype == FP8 else kv_dtype)[seq_slots] = (
            v_stored.view(torch.uint8) if kv_dtype == FP8 else v_stored
        )
        keys.append(k_deq)
        values.append(v_deq)
        slots.append(seq_slots)

    num_tokens = sum(case.q_lens)
    query = torch.randn(num_tokens, case.num_q_heads, dim, generator=gen).to(case.dtype)
    starts = [0]
    for q_len in case.q_lens:
        starts.append(starts[-1] + q_len)
    to = {"device": device}
    return BuiltCase(
        query=query.to(**to),
        key_cache=key_cache.to(**to),
        value_cache=value_cache.to(**to),
        block_tables=table.to(**to),
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        slot_mapping=torch.cat(slots).to(**to),
        keys=keys,
        values=values,
        scale=dim**-0.5,
    )


def naive_attention(case: AttentionCase, built: BuiltCase) -> torch.Tensor:
    """Expected output `[T, Hq, D]` (fp32): each sequence on its own, contiguous K/V, explicit softmax."""
    query = built.query.double().cpu()
    out = torch.zeros_like(query)
    start = 0
    for b, (q_len, length) in enumerate(zip(case.q_lens, case.seq_lens, strict=True)):
        keys, values = built.keys[b].double(), built.values[b].double()
        for t in range(q_len):
            pos = length - q_len + t
            for head in range(case.num_q_heads):
                kv_head = head // case.group
                scores = keys[: pos + 1, kv_head] @ query[start + t, head] * built.scale
                if case.softcap:
                    scores = case.softcap * torch.tanh(scores / case.softcap)
                visible = torch.arange(pos + 1)
                if case.sliding_window is not None:
                    scores = scores.masked_fill(visible <= pos - case.sliding_window, float("-inf"))
                weights = torch.exp(scores - scores.max())
                out[start + t, head] = (weights / weights.sum()) @ values[: pos + 1, kv_head]
        start += q_len
    return out.float()


def tolerance(case: AttentionCase) -> dict[str, float]:
    """Comparison tolerance for an output computed in `case.dtype` with fp32 accumulation."""
    if case.dtype == torch.bfloat16:
        return {"atol": 2e-2, "rtol": 2e-2}
    if case.dtype == torch.float16:
        return {"atol": 4e-3, "rtol": 4e-3}
    return {"atol": 2e-5, "rtol": 2e-5}
