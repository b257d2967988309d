"""Every Triton kernel against the torch oracle on the shared case grid.

Without a GPU the kernels run under Triton's CPU interpreter. TRITON_INTERPRET must be set before the
first `import triton` of the process (triton decorates its own library functions at import), which
tests/conftest.py does; `paged_backend.ops.triton` imports its kernels only on first use.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set, so its interpreter cannot run; "
                           "set the variable in tests/conftest.py before anything imports triton")
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from paged_backend.ops import reference  # noqa: E402
from tests._ops_cases import CASES, FP8, SPLIT_KV_CASES, AttentionCase, build_case, tolerance  # noqa: E402

pytest.importorskip("triton")
from paged_backend.ops import triton as triton_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _oracle(case: AttentionCase, built) -> torch.Tensor:
    return reference.paged_attention(
        *(t.cpu() for t in built.attention_args()[:-1]), built.scale,
        sliding_window=case.sliding_window, softcap=case.softcap, k_scale=case.k_scale, v_scale=case.v_scale,
    )


def _assert_matches_oracle(case: AttentionCase, out: torch.Tensor, built) -> None:
    assert out.dtype == case.dtype and out.shape == built.query.shape
    torch.testing.assert_close(out.cpu().float(), _oracle(case, built).float(), **tolerance(case))


def test_backend_reports_available_here():
    assert triton_ops.unavailable_reason() is None


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_attention_kernel_matches_oracle(case: AttentionCase):
    built = build_case(case, DEVICE)
    out = triton_ops.paged_attention(
        *built.attention_args(), sliding_window=case.sliding_window, softcap=case.softcap,
        k_scale=case.k_scale, v_scale=case.v_scale,
    )
    _assert_matches_oracle(case, out, built)


@pytest.mark.parametrize("num_segments", [2, 4])
@pytest.mark.parametrize("case", SPLIT_KV_CASES, ids=lambda c: c.name)
def test_split_kv_path_matches_oracle(case: AttentionCase, num_segments: int):
    built = build_case(case, DEVICE)
    out = triton_ops.paged_attention_split_kv(
        *built.attention_args(), sliding_window=case.sliding_window, softcap=case.softcap,
        k_scale=case.k_scale, v_scale=case.v_scale, num_segments=num_segments,
    )
    _assert_matches_oracle(case, out, built)


@pytest.mark.parametrize("case", CASES[:5], ids=lambda c: c.name)
def test_public_op_runs_triton_under_the_interpreter(case: AttentionCase):
    """`paged_attention(..., backend="triton")` is how users reach the kernels: CPU tensors are accepted
    when TRITON_INTERPRET=1, as the op documents."""
    from paged_backend import ops

    built = build_case(case, DEVICE)
    key_cache = torch.zeros_like(built.key_cache)
    value_cache = torch.zeros_like(built.value_cache)
    keys = torch.cat(built.keys).to(DEVICE, case.dtype)
    values = torch.cat(built.values).to(DEVICE, case.dtype)
    ops.reshape_and_cache(keys, values, key_cache, value_cache, built.slot_mapping, backend="triton",
                          k_scale=case.k_scale, v_scale=case.v_scale)
    out = ops.paged_attention(built.query, key_cache, value_cache, *built.attention_args()[3:],
                              sliding_window=case.sliding_window, softcap=case.softcap,
                              k_scale=case.k_scale, v_scale=case.v_scale, backend="triton")
    _assert_matches_oracle(case, out, built)


def test_split_kv_chosen_only_for_small_decode_batches():
    assert triton_ops.choose_num_segments(num_seqs=2, num_tokens=2, num_kv_heads=8, max_context=32768) == 16
    assert triton_ops.choose_num_segments(num_seqs=2, num_tokens=9, num_kv_heads=8, max_context=32768) == 1
    assert triton_ops.choose_num_segments(num_seqs=64, num_tokens=64, num_kv_heads=8, max_context=32768) == 1
    assert triton_ops.choose_num_segments(num_seqs=1, num_tokens=1, num_kv_heads=8, max_context=256) == 1


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16, FP8], ids=str)
def test_reshape_and_cache_matches_oracle(kv_dtype: torch.dtype):
    num_blocks, block_size, heads, dim = 5, 4, 3, 24  # non-power-of-two heads and dim exercise the masks
    src_dtype = torch.float32 if kv_dtype in (torch.float32, FP8) else kv_dtype
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(6, heads, dim, generator=gen).to(src_dtype)
    value = torch.randn(6, heads, dim, generator=gen).to(src_dtype)
    slots = torch.tensor([3, -1, 17, 0, 8, -1])
    scale = 0.25 if kv_dtype == FP8 else 1.0
    pools = []
    for write in (reference.reshape_and_cache, triton_ops.reshape_and_cache):
        key_cache = torch.zeros(num_blocks, block_size, heads, dim, dtype=kv_dtype, device=DEVICE)
        value_cache = torch.zeros_like(key_cache)
        write(key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slots.to(DEVICE),
              k_scale=scale, v_scale=scale)
        pools.append((key_cache.cpu().float(), value_cache.cpu().float()))
    (ref_k, ref_v), (tri_k, tri_v) = pools
    torch.testing.assert_close(tri_k, ref_k, atol=0, rtol=0)
    torch.testing.assert_close(tri_v, ref_v, atol=0, rtol=0)


def test_cache_write_then_attention_round_trip():
    case = CASES[4]  # mixed, block 16, group 4
    built = build_case(case, DEVICE)
    key_cache = torch.zeros_like(built.key_cache)
    value_cache = torch.zeros_like(built.value_cache)
    keys = torch.cat(built.keys).to(DEVICE, case.dtype)
    values = torch.cat(built.values).to(DEVICE, case.dtype)
    triton_ops.reshape_and_cache(keys, values, key_cache, value_cache, built.slot_mapping)
    out = triton_ops.paged_attention(built.query, key_cache, value_cache, *built.attention_args()[3:])
    _assert_matches_oracle(case, out, built)
