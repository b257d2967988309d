"""GPU correctness of the cuda (csrc/) and compiled Triton backends against the torch oracle."""

from __future__ import annotations

import pytest
import torch

from paged_backend.errors import BackendUnavailable
from paged_backend.ops import reference
from tests._ops_cases import CASES, FP8, SPLIT_KV_CASES, AttentionCase, build_case, tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Decode shapes the csrc kernel specialises on: head dims (lanes per token), GQA chunks above 8 q heads
# per kv head, several 512-token partitions, sliding windows that empty whole partitions, fp8 pools.
GPU_DECODE_CASES = [
    AttentionCase("llama3-geometry", q_lens=(1,) * 4, seq_lens=(1, 700, 1500, 3000), num_kv_heads=8, group=4,
                  head_dim=128, dtype=torch.bfloat16),
    AttentionCase("hd64-g16", q_lens=(1,) * 3, seq_lens=(33, 513, 1025), num_kv_heads=2, group=16, head_dim=64,
                  dtype=torch.float16),
    AttentionCase("hd256-mha-fp32", q_lens=(1,) * 2, seq_lens=(90, 600), num_kv_heads=4, group=1, head_dim=256),
    AttentionCase("hd32-g6-bs1", q_lens=(1,) * 2, seq_lens=(7, 530), block_size=1, group=6, head_dim=32,
                  dtype=torch.float16),
    AttentionCase("window-across-partitions", q_lens=(1,) * 2, seq_lens=(1200, 2100), num_kv_heads=2, group=8,
                  head_dim=128, dtype=torch.bfloat16, sliding_window=700, softcap=30.0),
    AttentionCase("fp8-long", q_lens=(1,) * 2, seq_lens=(800, 1900), num_kv_heads=2, group=4, head_dim=128,
                  dtype=torch.bfloat16, kv_dtype=FP8, k_scale=0.05, v_scale=0.03),
]
DECODE_CASES = [c for c in CASES if c.decode_only] + SPLIT_KV_CASES + GPU_DECODE_CASES


def _run(backend_module, case: AttentionCase):
    built = build_case(case, "cuda")
    out = backend_module.paged_attention(
        *built.attention_args(), sliding_window=case.sliding_window, softcap=case.softcap,
        k_scale=case.k_scale, v_scale=case.v_scale,
    )
    expected = reference.paged_attention(
        *built.attention_args(), sliding_window=case.sliding_window, softcap=case.softcap,
        k_scale=case.k_scale, v_scale=case.v_scale,
    )
    return out, expected


@pytest.fixture(scope="module")
def cuda_ops():
    from paged_backend.ops import cuda

    reason = cuda.unavailable_reason()
    if reason:
        pytest.fail(f"a GPU is present but the cuda backend is not: {reason}")
    return cuda


@pytest.fixture(scope="module")
def triton_ops():
    from paged_backend.ops import triton

    return triton


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.name)
def test_cuda_decode_matches_oracle(cuda_ops, case: AttentionCase):
    out, expected = _run(cuda_ops, case)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance(case))


@pytest.mark.parametrize("case", CASES + GPU_DECODE_CASES, ids=lambda c: c.name)
def test_triton_compiled_matches_oracle(triton_ops, case: AttentionCase):
    out, expected = _run(triton_ops, case)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance(case))


@pytest.mark.parametrize("case", SPLIT_KV_CASES + GPU_DECODE_CASES, ids=lambda c: c.name)
def test_triton_split_kv_matches_oracle(triton_ops, case: AttentionCase):
    built = build_case(case, "cuda")
    kwargs = dict(sliding_window=case.sliding_window, softcap=case.softcap, k_scale=case.k_scale,
                  v_scale=case.v_scale)
    out = triton_ops.paged_attention_split_kv(*built.attention_args(), num_segments=8, **kwargs)
    expected = reference.paged_attention(*built.attention_args(), **kwargs)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance(case))


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.float32, FP8], ids=str)
def test_cuda_reshape_and_cache_matches_oracle(cuda_ops, kv_dtype: torch.dtype):
    src_dtype = torch.bfloat16 if kv_dtype == FP8 else kv_dtype
    key = torch.randn(9, 8, 128, device="cuda").to(src_dtype)
    value = torch.randn(9, 8, 128, device="cuda").to(src_dtype)
    slots = torch.tensor([5, -1, 17, 0, 63, -1, 32, 1, 40], device="cuda")
    pools = []
    for write in (reference.reshape_and_cache, cuda_ops.reshape_and_cache):
        key_cache = torch.zeros(4, 16, 8, 128, dtype=kv_dtype, device="cuda")
        value_cache = torch.zeros_like(key_cache)
        write(key, value, key_cache, value_cache, slots, k_scale=0.5, v_scale=0.25)
        pools.append((key_cache.float(), value_cache.float()))
    torch.testing.assert_close(pools[1], pools[0], atol=0, rtol=0)


def test_cuda_backend_refuses_prefill_batches(cuda_ops):
    built = build_case(CASES[0], "cuda")
    with pytest.raises(BackendUnavailable, match="decode batches only"):
        cuda_ops.paged_attention(*built.attention_args())


def test_cuda_decode_under_torch_compile_and_cuda_graph(cuda_ops):
    case = GPU_DECODE_CASES[0]
    built = build_case(case, "cuda")
    eager = cuda_ops.paged_attention(*built.attention_args())
    compiled = torch.compile(lambda *args: cuda_ops.paged_attention(*args), fullgraph=True)
    torch.testing.assert_close(compiled(*built.attention_args()), eager, atol=0, rtol=0)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cuda_ops.paged_attention(*built.attention_args())
    built.query.mul_(2.0)  # replay must read the new query in place
    graph.replay()
    torch.testing.assert_close(captured, cuda_ops.paged_attention(*built.attention_args()), atol=0, rtol=0)
