"""The fused decoder-layer kernels (csrc/cpu/fused_ops_cpu.cpp) against their torch oracles, in every dtype, at
decode and prefill row counts (the latter threaded), and row by row independent of the batch."""

import pytest
import torch

from paged_backend.ops import fused_cpu
from paged_backend.ops.fused_cpu import PLAIN, HeadPrep, RotaryCache

TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}
DTYPES = list(TOLERANCE)
ROWS = [1, 5, 300]  # decode, a short chunk, a prefill chunk large enough to run threaded


def close(actual, expected, dtype):
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


def randn(*shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_add", [False, True])
def test_add_rms_norm_matches_the_oracle_and_updates_the_residual_in_place(dtype, rows, with_add):
    hidden = 576
    x = randn(rows, hidden, dtype=dtype, seed=1) if with_add else None
    residual = randn(rows, hidden, dtype=dtype, seed=2) * 3
    weight = randn(hidden, dtype=dtype, seed=3)
    expected_residual = residual.clone()
    expected = fused_cpu.add_rms_norm_reference(x, expected_residual, weight, 1e-5)
    out = fused_cpu.add_rms_norm(x, residual, weight, 1e-5)
    close(out, expected, dtype)
    if with_add:  # the add is one rounding in the dtype, exactly as torch's
        assert torch.equal(residual, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("normed_add", [False, True], ids=["pre-norm", "post-norm"])
def test_gemma_norms_match_the_oracle(dtype, rows, normed_add):
    """Gemma's norms scale by 1 + weight in fp32 and round once; its post-norms RMS-norm the branch's output before
    the residual add (`x_weight`)."""
    hidden = 640
    x, residual = randn(rows, hidden, dtype=dtype, seed=1), randn(rows, hidden, dtype=dtype, seed=2) * 3
    weight, x_weight = randn(hidden, dtype=dtype, seed=3), randn(hidden, dtype=dtype, seed=15)
    x_weight = x_weight if normed_add else None
    expected_residual = residual.clone()
    expected = fused_cpu.add_rms_norm_reference(x, expected_residual, weight, 1e-6, x_weight, unit_offset=True)
    out = fused_cpu.add_rms_norm(x, residual, weight, 1e-6, x_weight=x_weight, unit_offset=True)
    close(out, expected, dtype)
    close(residual, expected_residual, dtype)
    llama = fused_cpu.add_rms_norm(x, expected_residual.clone(), weight, 1e-6, x_weight=x_weight)
    assert not torch.allclose(llama.float(), out.float())  # the kinds differ


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_scaled_residual_add_matches_the_oracle(dtype):
    """Granite's residual multiplier: residual + x * scale, the product rounded in the dtype as torch's op is."""
    x, residual = randn(5, 576, dtype=dtype, seed=1), randn(5, 576, dtype=dtype, seed=2) * 3
    weight = randn(576, dtype=dtype, seed=3)
    expected_residual = residual.clone()
    expected = fused_cpu.add_rms_norm_reference(x, expected_residual, weight, 1e-5, x_scale=0.22)
    out = fused_cpu.add_rms_norm(x, residual, weight, 1e-5, x_scale=0.22)
    close(out, expected, dtype)
    assert torch.equal(residual, expected_residual)  # two roundings, each as torch's


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_gelu_tanh_mul_matches_the_oracle(dtype, rows):
    gate, up = randn(rows, 1536, dtype=dtype, seed=4) * 4, randn(rows, 1536, dtype=dtype, seed=5)
    expected = fused_cpu.act_mul_reference(gate, up, fused_cpu.GELU_TANH)
    close(fused_cpu.act_mul(gate, up, fused_cpu.GELU_TANH), expected, dtype)
    extremes = torch.tensor([[-1e4, -90.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 90.0, 1e4]])
    out = fused_cpu.act_mul(extremes, torch.ones_like(extremes), fused_cpu.GELU_TANH)
    close(out, fused_cpu.act_mul_reference(extremes, torch.ones_like(extremes), fused_cpu.GELU_TANH), torch.float32)


def test_an_unknown_activation_is_refused():
    gate = torch.ones(1, 8)
    with pytest.raises(RuntimeError, match="unknown activation code"):
        fused_cpu.act_mul(gate, gate, 7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_matches_the_oracle(dtype, rows):
    gate, up = randn(rows, 1536, dtype=dtype, seed=4) * 4, randn(rows, 1536, dtype=dtype, seed=5)
    close(fused_cpu.act_mul(gate, up), fused_cpu.act_mul_reference(gate, up), dtype)


def test_silu_mul_saturates_without_overflow():
    gate = torch.tensor([[-1e4, -90.0, -20.0, 0.0, 20.0, 90.0, 1e4, float("-inf")]])
    out = fused_cpu.act_mul(gate, torch.ones_like(gate))
    torch.testing.assert_close(out[:, :-1], torch.nn.functional.silu(gate)[:, :-1], rtol=1e-6, atol=1e-30)


def test_silu_mul_keeps_a_nan_gate_nan_as_torch_does():
    gate = torch.tensor([[float("nan"), 1.0] * 40])  # long enough for the vector loop and its tail
    out = fused_cpu.act_mul(gate, torch.ones_like(gate))
    assert out[0, ::2].isnan().all() and not out[0, 1::2].isnan().any()


def rotary_case(rows, dtype, num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, num_blocks=40, pool_dtype=None):
    positions = torch.arange(rows) + 7
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    qkv = randn(rows, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=6)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(7))[:rows]
    slots[::4] = -1  # padding rows are not stored
    pools = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=pool_dtype or dtype) for _ in range(4)]
    return q, k, v, cos, sin, slots, pools


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rotary_cache_rotates_q_and_k_and_stores_k_and_v_at_their_slots(dtype, rows):
    # q, k and v are column slices of one fused qkv output: strided rows, as a fused projection would give
    q, k, v, cos, sin, slots, (key_cache, value_cache, ref_keys, ref_values) = rotary_case(rows, dtype)
    expected = fused_cpu.rotary_cache_reference(q, k, v, cos, sin, ref_keys, ref_values, slots)
    out = RotaryCache(cos, sin, slots, block_size=16)(q, k, v, key_cache, value_cache)
    close(out, expected, dtype)
    close(key_cache, ref_keys, dtype)
    assert torch.equal(value_cache, ref_values)  # values are copied, not computed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rotary_cache_norms_each_q_and_k_head_first_as_qwen3_does(dtype, rows):
    """Qwen3's q_norm and k_norm (an RMSNorm over each head) run inside the rotary kernel, before the rotation."""
    q, k, v, cos, sin, slots, (key_cache, value_cache, ref_keys, ref_values) = rotary_case(rows, dtype)
    q_norm, k_norm = (randn(64, dtype=dtype, seed=seed) for seed in (13, 14))  # different weights: a swap shows
    prep = HeadPrep((q_norm, 1e-6), (k_norm, 1e-5))
    expected = fused_cpu.rotary_cache_reference(q, k, v, cos, sin, ref_keys, ref_values, slots, prep)
    out = RotaryCache(cos, sin, slots, block_size=16)(q, k, v, key_cache, value_cache, prep)
    close(out, expected, dtype)
    close(key_cache, ref_keys, dtype)
    assert torch.equal(value_cache, ref_values)
    plain = RotaryCache(cos, sin, slots, block_size=16)(q, k, v, key_cache.clone(), value_cache.clone())
    assert not torch.allclose(plain.float(), out.float())  # the norms changed the result


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_cache_norms_heads_the_gemma_way(dtype):
    q, k, v, cos, sin, slots, (key_cache, value_cache, ref_keys, ref_values) = rotary_case(5, dtype)
    prep = HeadPrep((randn(64, dtype=dtype, seed=13), 1e-6), (randn(64, dtype=dtype, seed=14), 1e-6), unit_offset=True)
    expected = fused_cpu.rotary_cache_reference(q, k, v, cos, sin, ref_keys, ref_values, slots, prep)
    out = RotaryCache(cos, sin, slots, block_size=16)(q, k, v, key_cache, value_cache, prep)
    close(out, expected, dtype)
    close(key_cache, ref_keys, dtype)


def test_a_slot_past_the_pool_is_refused_before_any_write():
    q, k, v, cos, sin, slots, (key_cache, value_cache, *_) = rotary_case(8, torch.float32, num_blocks=4)
    slots[:] = torch.arange(8) * 8  # 0..56, inside the 64 slots
    slots[5] = 4 * 16  # the first slot past the pool
    with pytest.raises(RuntimeError, match="rotary_cache failed: cache write: a slot in slot_mapping lies past"):
        RotaryCache(cos, sin, slots, 16)(q, k, v, key_cache, value_cache)
    assert not key_cache.any() and not value_cache.any()  # refused before the rows before it were written


def test_a_head_too_wide_for_the_norm_buffer_is_refused():
    q, k, v, cos, sin, slots, (key_cache, value_cache, *_) = rotary_case(2, torch.float32, 2, 1, 1024, 16, 4)
    with pytest.raises(RuntimeError, match="head_dim <= 512 with q/k norms"):
        RotaryCache(cos, sin, slots, 16)(q, k, v, key_cache, value_cache, HeadPrep(q_norm=(torch.ones(1024), 1e-6)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rotary_cache_rotates_only_the_leading_dims_of_a_partial_rotary(dtype, rows):
    """Phi-4-mini rotates the first 3/4 of each head (cos/sin that wide) and passes the rest through."""
    q, k, v, cos, sin, slots, (key_cache, value_cache, ref_keys, ref_values) = rotary_case(rows, dtype)
    cos, sin = cos[:, :48].contiguous(), sin[:, :48].contiguous()  # rotary_dim 48 of head_dim 64
    expected = fused_cpu.rotary_cache_reference(q, k, v, cos, sin, ref_keys, ref_values, slots, head_dim=64)
    out = RotaryCache(cos, sin, slots, block_size=16, head_dim=64)(q, k, v, key_cache, value_cache)
    close(out, expected, dtype)
    close(key_cache, ref_keys, dtype)
    assert torch.equal(out[..., 48:], q.reshape(rows, -1, 64)[..., 48:])  # the passed dims are copied


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_cache_on_a_nope_layer_copies_q_and_k_unrotated(dtype):
    """SmolLM3's NoPE layers: q comes back as it went in, and k and v are stored as they are."""
    q, k, v, cos, sin, slots, (key_cache, value_cache, ref_keys, ref_values) = rotary_case(5, dtype)
    prep = HeadPrep(rotary=False)
    expected = fused_cpu.rotary_cache_reference(q, k, v, cos, sin, ref_keys, ref_values, slots, prep)
    out = RotaryCache(cos, sin, slots, block_size=16)(q, k, v, key_cache, value_cache, prep)
    assert torch.equal(out, q.reshape(5, -1, 64)) and torch.equal(out, expected)
    assert torch.equal(key_cache, ref_keys) and torch.equal(value_cache, ref_values)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("pool_dtype", FP8)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rotary_cache_stores_into_fp8_pools_scaled_and_rounded_as_the_reference(pool_dtype, dtype, rows):
    q, k, v, cos, sin, slots, (key_cache, value_cache, ref_keys, ref_values) = rotary_case(rows, dtype,
                                                                                          pool_dtype=pool_dtype)
    scales = (0.05, 0.02)
    for prep in (PLAIN, HeadPrep(rotary=False)):
        expected = fused_cpu.rotary_cache_reference(q, k, v, cos, sin, ref_keys, ref_values, slots, prep,
                                                    kv_scales=scales)  # fmt: skip
        out = RotaryCache(cos, sin, slots, block_size=16)(q, k, v, key_cache, value_cache, prep, scales)
        close(out, expected, dtype)
        assert torch.equal(value_cache.view(torch.uint8), ref_values.view(torch.uint8))  # values: the same bytes
        keys, ref = key_cache.view(torch.uint8), ref_keys.view(torch.uint8)
        if not prep.rotary:
            assert torch.equal(keys, ref)  # unrotated keys: the same bytes too
        else:  # the rotation's last bit may differ (fused multiply-adds in float32), so now and then an fp8 step
            assert (keys != ref).float().mean() < 0.01
            torch.testing.assert_close(key_cache.float(), ref_keys.float(), rtol=0.25, atol=2 ** -7)
    if rows > 1:  # (a single row is a padding row: slot -1)
        assert value_cache.float().abs().max() > 1.0  # the scale was applied (the values are N(0, 1) before it)


@pytest.mark.parametrize("pool_dtype", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.37, 3e-3])
def test_fp8_stores_every_bf16_value_as_torch_rounds_it(pool_dtype, scale):
    """Every bf16 bit pattern (infinities, NaNs and subnormals included), divided by the scale in float32, then
    saturated and rounded to nearest even: the value path of rotary_cache against reference.to_fp8, bit for bit."""
    values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    value = values.view(1024, 64)  # one kv head of 64 per token: 1024 tokens
    slots = torch.arange(1024)
    cos = sin = torch.zeros(1024, 64)
    pools = [torch.zeros(64, 16, 1, 64, dtype=pool_dtype) for _ in range(2)]
    RotaryCache(cos, sin, slots, block_size=16)(torch.zeros(1024, 64), torch.zeros(1024, 64), value, *pools,
                                                kv_scales=(1.0, scale))  # fmt: skip
    stored = pools[1].view(torch.uint8).view(-1)
    expected = fused_cpu.to_fp8(values, pool_dtype, scale).view(torch.uint8)
    nan = values.isnan()
    assert torch.equal(stored[~nan], expected[~nan])
    assert pools[1].view(-1)[nan].float().isnan().all()


def test_an_fp8_pool_needs_positive_scales():
    q, k, v, cos, sin, slots, pools = rotary_case(2, torch.float32, pool_dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="positive fp8 scales"):
        RotaryCache(cos, sin, slots, 16)(q, k, v, *pools[:2], kv_scales=(0.0, 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_kernel_gives_a_row_the_same_bits_alone_or_in_a_batch(dtype):
    rows, hidden = 300, 576
    x, residual = randn(rows, hidden, dtype=dtype, seed=8), randn(rows, hidden, dtype=dtype, seed=9)
    weight = randn(hidden, dtype=dtype, seed=10)
    batch_residual, one_residual = residual.clone(), residual[123:124].clone()
    batch = fused_cpu.add_rms_norm(x, batch_residual, weight, 1e-6)
    assert torch.equal(fused_cpu.add_rms_norm(x[123:124], one_residual, weight, 1e-6), batch[123:124])
    gate, up = randn(rows, 1536, dtype=dtype, seed=11), randn(rows, 1536, dtype=dtype, seed=12)
    assert torch.equal(fused_cpu.act_mul(gate[42:43], up[42:43]), fused_cpu.act_mul(gate, up)[42:43])
    q, k, v, cos, sin, slots, (key_cache, value_cache, *_) = rotary_case(rows, dtype)
    batch_q = RotaryCache(cos, sin, slots, 16)(q, k, v, key_cache, value_cache)
    one_q = RotaryCache(cos[5:6].contiguous(), sin[5:6].contiguous(), slots[5:6].clone(), 16)(
        q[5:6], k[5:6], v[5:6], key_cache, value_cache
    )
    assert torch.equal(one_q, batch_q[5:6])
