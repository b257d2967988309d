"""The fused CPU kernel (csrc/cpu) against the torch oracle on the shared case grid, and its selection."""

from __future__ import annotations

import pytest
import torch

from paged_backend import ops
from paged_backend.errors import BackendUnavailable
from paged_backend.ops import _cpu_build, cpu, reference
from tests._ops_cases import CASES, FP8, SPLIT_KV_CASES, AttentionCase, build_case, tolerance

LONG_CASES = [
    # many query tiles per sequence, a window that cuts blocks in the middle, and one long decode
    AttentionCase("long-prefill-window", q_lens=(200, 1), seq_lens=(260, 300), group=4, sliding_window=50),
    AttentionCase("long-chunk-bf16-bs32", q_lens=(70,), seq_lens=(333,), block_size=32, group=2,
                  dtype=torch.bfloat16, head_dim=64),
    # head_dim not a multiple of 16 (the vector tail), blocks narrower than a 16-key panel, softcap
    AttentionCase("odd-dim-bs8-softcap", q_lens=(37, 1), seq_lens=(50, 23), block_size=8, group=3, head_dim=40,
                  softcap=4.0),
    # the decode path's bf16 pair dot products: a head_dim with a 16-element tail past the 32-wide pairs, a softcap
    # after the query's scale, short drafts; then bf16 keys under a float32 query (widened, not paired)
    AttentionCase("decode-bf16-pairs-tail", q_lens=(1, 1, 2, 1), seq_lens=(40, 77, 200, 16), group=3, head_dim=48,
                  dtype=torch.bfloat16, softcap=6.0),
    # the bf16 value pairs: a 64-wide chunk, a 16-wide one and an 8-element tail; odd key counts pair the last key
    # with a zero weight; four rows per kv head
    AttentionCase("decode-bf16-value-pairs", q_lens=(1, 1, 1), seq_lens=(31, 64, 97), group=4, head_dim=88,
                  dtype=torch.bfloat16),
    # contexts cut into parts of 512-2048 keys that are merged after: a 1-key last part, a window starting inside a
    # part, and a prefill tile whose first rows see none of the last part's keys
    AttentionCase("split-decode-long", q_lens=(1, 1, 1), seq_lens=(4500, 2049, 40), group=4),
    AttentionCase("split-decode-bf16-window", q_lens=(1, 2), seq_lens=(4200, 3000), group=3, head_dim=64,
                  dtype=torch.bfloat16, sliding_window=2500),
    AttentionCase("split-prefill-chunk", q_lens=(200,), seq_lens=(2210,), group=2),
    AttentionCase("decode-fp32q-bf16kv", q_lens=(1, 1), seq_lens=(45, 130), group=2, head_dim=48,
                  kv_dtype=torch.bfloat16),
    # fp32 and fp16 caches run every tile on the decode path, 128 rows per kv head (one kv head) or 64 (two); bf16 too
    # where the AMX tiles run it (elsewhere from 8 rows on the panels)
    AttentionCase("decode-path-128-rows", q_lens=(150, 1), seq_lens=(300, 40), num_kv_heads=1, group=8),
    AttentionCase("decode-path-128-rows-fp16", q_lens=(150, 1), seq_lens=(300, 40), num_kv_heads=1, group=8,
                  dtype=torch.float16, softcap=5.0),
    AttentionCase("decode-path-128-rows-bf16", q_lens=(140,), seq_lens=(333,), num_kv_heads=1, group=4, head_dim=64,
                  dtype=torch.bfloat16, sliding_window=100),
    AttentionCase("decode-path-64-rows", q_lens=(70,), seq_lens=(200,), group=4, head_dim=64),
    # fp8 caches take the panel path from 32 rows per kv head
    AttentionCase("panel-fp8-one-kv-head", q_lens=(150, 1), seq_lens=(300, 40), num_kv_heads=1, group=8,
                  dtype=torch.float16, kv_dtype=FP8, k_scale=0.05, v_scale=0.02, softcap=5.0),
    # fp8 rows whose last elements are no full sixteen (the widening's zero-padded tail), on both paths
    AttentionCase("fp8-odd-dim-tail", q_lens=(40, 1), seq_lens=(60, 23), group=8, head_dim=40, dtype=torch.float16,
                  kv_dtype=FP8, k_scale=0.05, v_scale=0.02),
]


def _kwargs(case: AttentionCase) -> dict:
    return dict(sliding_window=case.sliding_window, softcap=case.softcap, k_scale=case.k_scale,
                v_scale=case.v_scale)


@pytest.fixture(scope="module", autouse=True)
def _kernel_builds():
    assert cpu.unavailable_reason() is None  # g++ is on every machine this project supports


@pytest.mark.parametrize("case", CASES + SPLIT_KV_CASES + LONG_CASES, ids=lambda c: c.name)
def test_kernel_matches_oracle(case: AttentionCase):
    built = build_case(case)
    out = cpu.paged_attention(*built.attention_args(), **_kwargs(case))
    expected = reference.paged_attention(*built.attention_args(), **_kwargs(case))
    assert out.dtype == case.dtype and out.shape == built.query.shape
    torch.testing.assert_close(out.float(), expected.float(), **tolerance(case))


def test_fp8_e5m2_pools_match_oracle():
    case = AttentionCase("e5m2", q_lens=(1, 6), seq_lens=(30, 6), group=2, dtype=torch.float16, k_scale=0.5,
                         v_scale=0.25)
    built = build_case(case, garbage_padding=False)
    args = list(built.attention_args())
    args[1], args[2] = args[1].to(torch.float8_e5m2), args[2].to(torch.float8_e5m2)
    out = cpu.paged_attention(*args, **_kwargs(case))
    torch.testing.assert_close(out, reference.paged_attention(*args, **_kwargs(case)), **tolerance(case))


@pytest.mark.parametrize("case", [LONG_CASES[0], next(c for c in LONG_CASES if c.name == "split-decode-long")],
                         ids=lambda c: c.name)
def test_result_does_not_depend_on_thread_count(case: AttentionCase):
    built = build_case(case)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu.paged_attention(*built.attention_args(), **_kwargs(case))
        torch.set_num_threads(4)
        threaded = cpu.paged_attention(*built.attention_args(), **_kwargs(case))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, threaded)


def test_strided_query_rows_are_read_through_their_strides():
    case = CASES[4]
    built = build_case(case)
    wide = torch.randn(built.query.shape[0], built.query.shape[1], 3 * built.query.shape[2])
    wide[..., : built.query.shape[2]] = built.query
    strided = wide[..., : built.query.shape[2]]
    args = list(built.attention_args())
    args[0] = strided
    torch.testing.assert_close(cpu.paged_attention(*args), cpu.paged_attention(*built.attention_args()))


@pytest.mark.parametrize(("query_dtype", "kv_dtype"), [(torch.float64, torch.float64), (FP8, FP8),
                                                     (torch.float32, torch.int8)], ids=str)
def test_unsupported_dtypes_are_refused_with_the_supported_list(query_dtype, kv_dtype):
    built = build_case(CASES[4])
    args = list(built.attention_args())
    args[0] = args[0].to(query_dtype)
    args[1], args[2] = args[1].to(kv_dtype), args[2].to(kv_dtype)
    with pytest.raises(BackendUnavailable, match="cpu backend supports"):
        cpu.paged_attention(*args)


def test_missing_compiler_is_a_sentence_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.setattr(_cpu_build, "find_compiler", lambda: None)
    with pytest.raises(_cpu_build.CpuBuildError, match="no C\\+\\+ compiler"):
        _cpu_build.build_library(tmp_path / "lib.so")


def test_auto_selection_prefers_the_kernel_on_cpu_and_torch_is_still_selectable(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    assert ops.resolve_backend(None, torch.device("cpu")) == "cpu"
    assert ops.resolve_backend("torch", torch.device("cpu")) == "torch"
    monkeypatch.setenv(ops.ENV_VAR, "torch")
    assert ops.resolve_backend(None, torch.device("cpu")) == "torch"


def test_build_is_cached_per_source(monkeypatch, tmp_path):
    # the cache's rules on one small source, not the whole kernel (a 30 s build the suite has already paid for)
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path))
    monkeypatch.setattr(_cpu_build, "SOURCES", ("argmax_cpu.cpp",))
    first = _cpu_build.cached_library()
    assert first.is_relative_to(tmp_path) and first.exists()
    mtime = first.stat().st_mtime_ns
    assert _cpu_build.cached_library() == first and first.stat().st_mtime_ns == mtime  # no rebuild


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16, FP8], ids=str)
def test_cache_write_matches_oracle(kv_dtype: torch.dtype):
    """The C row copy (the oracle's index_put for fp8, which scales and rounds): strided rows, skipped slots, rows
    of another dtype cast to the pool's, and a prefill-sized write that spreads over threads."""
    gen = torch.Generator().manual_seed(3)
    for tokens in (6, 130):
        slots = torch.randperm(9 * 16, generator=gen)[:tokens]
        slots[::5] = -1
        rows = torch.randn(tokens, 2, 3, 40, generator=gen)  # [T, k|v, Hkv, D]: key and value are strided views
        key, value = rows[:, 0], rows[:, 1]
        if kv_dtype in (torch.float16, torch.bfloat16):
            key, value = key.to(kv_dtype), value.float()  # one row set in the pool's dtype, one cast to it
        scale = 0.5 if kv_dtype == FP8 else 1.0
        pools = []
        for write in (reference.reshape_and_cache, cpu.reshape_and_cache):
            key_cache = torch.zeros(9, 16, 3, 40, dtype=kv_dtype)
            value_cache = torch.zeros_like(key_cache)
            write(key, value, key_cache, value_cache, slots, k_scale=scale, v_scale=scale)
            pools.append((key_cache.view(torch.uint8), value_cache.view(torch.uint8)))
        assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])


def test_cache_write_refuses_slots_past_the_pool_and_rows_of_another_shape():
    key_cache = torch.zeros(2, 16, 3, 8)
    rows = torch.ones(2, 3, 8)
    with pytest.raises(RuntimeError, match="past the pool's last block"):
        cpu.reshape_and_cache(rows, rows, key_cache, key_cache.clone(), torch.tensor([1, 32]))
    assert not key_cache.any()  # refused before any row was copied
    with pytest.raises(ValueError, match=r"must be \(2, 3, 8\)"):
        cpu.reshape_and_cache(torch.ones(2, 2, 8), torch.ones(2, 2, 8), key_cache, key_cache.clone(),
                              torch.tensor([0, 1]))  # fmt: skip


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])  # triton: its interpreter (tests/conftest.py)
def test_step_attention_equals_the_dispatcher_for_every_layer(backend):
    """`StepAttention` (a forward's dispatch done once) writes and attends as the two functions do, bit for bit,
    across layers of different scales and caps sharing its plans, and in batch-invariant mode."""
    if backend == "triton":
        pytest.importorskip("triton")
    case = AttentionCase("step", q_lens=(1, 5, 1), seq_lens=(40, 21, 77), group=3, head_dim=32)
    built = build_case(case)
    query, key_cache, value_cache, tables, lens, starts, scale = built.attention_args()
    new = torch.randn(query.shape[0], key_cache.shape[2], key_cache.shape[3])
    slots = torch.tensor([tables[b, (n - 1) // 16] * 16 + (n - 1) % 16 for b, n in enumerate(lens.tolist())
                          for _ in range(int(starts[b + 1] - starts[b]))])  # fmt: skip
    slots[1:6] = torch.arange(5) + tables[1, 0] * 16 + 16  # prefill rows: five fresh slots
    for invariant in (False, True):
        with ops.batch_invariant(invariant):
            step = ops.StepAttention(slots, tables, lens, starts, backend=backend)
            if invariant and backend not in ops.INVARIANT_BACKENDS:  # refused as the dispatcher refuses it
                with pytest.raises(BackendUnavailable, match="batch-invariant attention runs on the cpu or triton"):
                    step.attend(query, key_cache, value_cache, scale)
                continue
            for layer_scale, softcap in ((scale, None), (scale * 2, None), (scale, 5.0), (scale, None)):
                pools = [(key_cache.clone(), value_cache.clone()) for _ in range(2)]
                step.write(new, -new, *pools[0])
                ops.reshape_and_cache(new, -new, *pools[1], slots, backend=backend)
                assert all(_same_bits(mine, theirs) for mine, theirs in zip(*pools, strict=True))  # NaN-filled pools
                got = step.attend(query, *pools[0], layer_scale, softcap=softcap)
                expected = ops.paged_attention(query, *pools[1], tables, lens, starts, layer_scale, softcap=softcap,
                                               backend=backend)  # fmt: skip
                assert _same_bits(got, expected)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_order_read_reads_exactly_the_tables_blocks(dtype):
    """benchmarks/attention.py's bound for scattered blocks: every word of each listed block of both pools, once."""
    gen = torch.Generator().manual_seed(3)
    key, value = (torch.randn(40, 16, 3, 64, generator=gen).to(dtype) for _ in range(2))
    blocks = torch.randperm(39, generator=gen)[:17] + 1

    def words(pool: torch.Tensor) -> int:
        return int(pool[blocks].contiguous().view(torch.int32).to(torch.int64).sum())

    assert cpu.read_blocks(key, value, blocks) == (words(key) + words(value)) % 2**32
    assert cpu.read_blocks(key, value, blocks[:0]) == 0
    with pytest.raises(ValueError, match=r"block ids must lie in \[0, 40\)"):
        cpu.read_blocks(key, value, torch.tensor([40]))
    with pytest.raises(ValueError, match="contiguous CPU pools"):
        cpu.read_blocks(key.transpose(1, 2), value.transpose(1, 2), blocks)


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 32], ids=["decode-path", "panels"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_every_fp8_byte_widens_to_torchs_float(fp8, group, query_dtype):
    # one key per sequence, so its value row is the output: every byte of the format, NaNs and e5m2's infinities too
    values = torch.zeros(3, 16, 1, 128, dtype=torch.uint8)
    values[1:, 0, 0] = torch.arange(256, dtype=torch.uint8).view(2, 128)
    values = values.view(fp8)
    keys = torch.zeros_like(values)
    query = torch.ones(2, group, 128, dtype=query_dtype)
    tables, lens = torch.tensor([[1], [2]], dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    out = cpu.paged_attention(query, keys, values, tables, lens, torch.arange(3, dtype=torch.int32), 1.0)
    want = values[1:, 0, 0].to(query_dtype)[:, None].expand(2, group, 128).clone()
    if query_dtype == torch.bfloat16 and cpu.amx_tiles():
        # the tiles (widened to bf16 as every other byte is) take a value row's elements in pairs, the weight on one
        # and zero on the other: a NaN or an infinity makes its pair's sum NaN, as over a bf16 cache
        pairs = want.view(2, group, 64, 2)
        pairs.copy_(pairs.where(pairs.isfinite().all(-1, keepdim=True), float("nan")))
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
