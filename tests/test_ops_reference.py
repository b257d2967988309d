"""The torch oracle against a naive per-sequence attention over contiguous K/V, on the shared grid."""

from __future__ import annotations

import pytest
import torch

from paged_backend.ops import reference
from tests._ops_cases import CASES, FP8, SPLIT_KV_CASES, AttentionCase, build_case, naive_attention, tolerance


def _run(case: AttentionCase) -> tuple[torch.Tensor, torch.Tensor]:
    built = build_case(case)
    out = reference.paged_attention(
        *built.attention_args(), sliding_window=case.sliding_window, softcap=case.softcap,
        k_scale=case.k_scale, v_scale=case.v_scale,
    )
    return out, naive_attention(case, built)


@pytest.mark.parametrize("case", CASES + SPLIT_KV_CASES, ids=lambda c: c.name)
def test_oracle_matches_naive_attention(case: AttentionCase):
    out, expected = _run(case)
    assert out.dtype == case.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), expected, **tolerance(case))


def test_oracle_ignores_padded_table_entries_pointing_at_null_block():
    case = CASES[0]
    built = build_case(case, garbage_padding=False)
    out = reference.paged_attention(*built.attention_args())
    torch.testing.assert_close(out, naive_attention(case, built), **tolerance(case))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, FP8], ids=str)
def test_reshape_and_cache_writes_slots_and_skips_minus_one(kv_dtype: torch.dtype):
    num_blocks, block_size, heads, dim = 4, 8, 2, 16
    key_cache = torch.zeros(num_blocks, block_size, heads, dim, dtype=kv_dtype)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(5, heads, dim)
    value = torch.randn(5, heads, dim)
    slots = torch.tensor([9, -1, 31, 0, -1])
    scale = 0.5 if kv_dtype == FP8 else 1.0
    reference.reshape_and_cache(key, value, key_cache, value_cache, slots, k_scale=scale, v_scale=scale)

    flat_k = key_cache.view(-1, heads, dim).float() * scale
    flat_v = value_cache.view(-1, heads, dim).float() * scale
    tol = {"atol": 0.1, "rtol": 0.07} if kv_dtype == FP8 else {"atol": 1e-2, "rtol": 1e-2}
    for row, slot in ((0, 9), (2, 31), (3, 0)):
        torch.testing.assert_close(flat_k[slot], key[row], **tol)
        torch.testing.assert_close(flat_v[slot], value[row], **tol)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[[9, 31, 0]] = True
    assert (flat_k[~written] == 0).all() and (flat_v[~written] == 0).all()
