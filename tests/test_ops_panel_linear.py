"""The panel linear kernel (csrc/cpu/panel_linear_cpu.cpp) against torch's linear layer: float32 and bfloat16,
decode and prefill row counts, shapes that leave partial panels and an odd K, bias, strided rows, row-by-row
independence of the batch, views into a grouped packing, and clear errors for what it does not take."""

import ctypes
import platform
import subprocess

import pytest
import torch

from paged_backend.ops import _cpu_build
from paged_backend.ops.panel_linear import PanelWeight, panel_bias, panel_linear_reference

# bfloat16: both sides accumulate in float32 and round once; the order of the sums differs
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}
DTYPES = list(TOLERANCE)
# (N, K): whole panels, partial panels, a tiny layer; K spans several k blocks of 64 steps (an odd K ends in the last)
SHAPES = [(576, 576), (200, 77), (49, 1536), (3, 5), (40, 201)]
# the streaming tiles (1-2 rows); one row tile; 12 rows as two of 6; 53 as a chunk of 48 rows and one of 5
ROWS = [1, 2, 3, 7, 12, 53]


def randn(*shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * 0.1).to(dtype)


def close(actual, expected, dtype):
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_panel_linear_matches_torch_linear(dtype, shape, rows):
    n, k = shape
    weight, bias = randn(n, k, dtype=dtype, seed=1), randn(n, dtype=dtype, seed=2)
    x = randn(rows, k, dtype=dtype, seed=3)
    packed = PanelWeight(weight)
    close(packed(x), panel_linear_reference(x.float(), weight.float()), dtype)
    close(packed(x, bias), panel_linear_reference(x.float(), weight.float(), bias.float()), dtype)


def test_float32_is_exact_to_the_sum_order_and_keeps_leading_dimensions():
    weight, x = randn(96, 40, dtype=torch.float32, seed=4), randn(2, 3, 40, dtype=torch.float32, seed=5)
    out = PanelWeight(weight)(x)
    assert out.shape == (2, 3, 96)
    expected = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_bitwise_independent_of_the_batch(dtype):
    weight = randn(960, 576, dtype=dtype, seed=6)
    x = randn(13, 576, dtype=dtype, seed=7)
    packed = PanelWeight(weight)
    batch = packed(x)
    for start, stop in [(0, 1), (1, 3), (5, 11), (0, 13)]:
        assert torch.equal(packed(x[start:stop]), batch[start:stop])


@pytest.mark.parametrize("rows", [1, 3])  # the streaming tile and the blocked one
def test_bfloat16_outputs_round_like_torch(rows):
    """Each output is one input (an identity weight) plus its bias, added in float32 and rounded once: exactly
    torch's rounding, ties to even and NaN included, in whole panels (vectors) and the partial last one (lanes)."""
    n = 40
    x = randn(rows, n, dtype=torch.bfloat16, seed=14)
    x[:, :3] = x[:, 32:35] = torch.tensor([1.0, 1.0078125, -1.0078125])  # plus 2**-8: ties (and in the last panel)
    bias = randn(n, dtype=torch.bfloat16, seed=15)
    bias[:3] = bias[32:35] = 2.0**-8
    bias[3] = bias[35] = float("nan")
    out = PanelWeight(torch.eye(n, dtype=torch.bfloat16))(x, panel_bias(bias, torch.bfloat16))
    expected = (x.float() + bias.float()).to(torch.bfloat16)
    assert torch.equal(out.isnan(), expected.isnan())  # NaN stays NaN (its payload is the CPU's choice)
    numbers = ~expected.isnan()
    assert torch.equal(out[numbers].view(torch.int16), expected[numbers].view(torch.int16))
    assert out[0, 0].item() == 1.0 and out[0, 1].item() == 1.015625  # ties went to the even neighbour


def test_strided_rows_give_the_same_answer_as_contiguous_ones():
    weight = randn(64, 48, dtype=torch.float32, seed=8)
    wide = randn(4, 100, dtype=torch.float32, seed=9)
    x = wide[:, 10:58]  # rows with a stride of 100
    packed = PanelWeight(weight)
    assert torch.equal(packed(x), packed(x.contiguous()))


def test_wrong_dtype_device_or_width_is_a_clear_error():
    with pytest.raises(ValueError, match="float32/bfloat16"):
        PanelWeight(torch.zeros(4, 4, dtype=torch.float16))
    packed = PanelWeight(torch.zeros(32, 8))
    with pytest.raises(ValueError, match="input"):
        packed(torch.zeros(1, 9))
    with pytest.raises(ValueError, match="input"):
        packed(torch.zeros(1, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_stacked_group_equals_its_parts_and_shares_their_memory(dtype):
    weights = [randn(n, 64, dtype=dtype, seed=10 + n) for n in (96, 32, 40)]  # the last ends in a partial panel
    parts = [PanelWeight(weight) for weight in weights]
    x = randn(3, 64, dtype=dtype, seed=11)
    alone = [part(x) for part in parts]
    group = PanelWeight.stack(parts)
    assert group is not None and group.out_features == 168
    assert torch.equal(group(x), torch.cat(alone, dim=-1))
    for part, expected in zip(parts, alone, strict=True):
        assert torch.equal(part(x), expected)  # each part now reads its slice of the group's panels
        assert part.packed.untyped_storage().data_ptr() == group.packed.untyped_storage().data_ptr()


def test_parts_that_cannot_stack_are_left_alone():
    partial_first = [PanelWeight(torch.zeros(40, 8)), PanelWeight(torch.zeros(32, 8))]
    assert PanelWeight.stack(partial_first) is None
    widths = [PanelWeight(torch.zeros(32, 8)), PanelWeight(torch.zeros(32, 16))]
    assert PanelWeight.stack(widths) is None


@pytest.fixture(scope="module")
def plain_library(tmp_path_factory) -> ctypes.CDLL:
    """The kernel built for a CPU without AVX-512 (AVX2 and FMA: most CI machines), once for the module's tests."""
    compiler = _cpu_build.find_compiler()
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C++ compiler for x86-64 (the plain path is built with -mavx2)")
    library = tmp_path_factory.mktemp("plain") / "panel_plain.so"
    source = _cpu_build.csrc_dir() / "cpu" / "panel_linear_cpu.cpp"
    # -O1: at -O3, GCC's expansion of the 512-bit vector types into AVX2 takes 85 s to compile; the arithmetic, which
    # is what the test holds to torch, is the same
    flags = ["-O1" if flag == "-O3" else flag for flag in _cpu_build.CXX_FLAGS if flag != "-march=native"]
    subprocess.run([compiler, *flags, "-mavx2", "-mfma", str(source), "-o", str(library)], check=True)
    lib = ctypes.CDLL(str(library))
    lib.pb_cpu_panel_packed_elements.restype = ctypes.c_int64
    return lib


def test_bfloat16_without_avx512_bf16_computes_the_same_products(plain_library):
    """CPUs without AVX512-BF16 (most CI machines) run the bfloat16 pairs as float32 multiply-adds: build that path
    explicitly and hold it to torch too."""
    lib = plain_library
    n, k, rows = 40, 77, 5
    weight, x = randn(n, k, dtype=torch.bfloat16, seed=12), randn(rows, k, dtype=torch.bfloat16, seed=13)
    packed = torch.empty(
        lib.pb_cpu_panel_packed_elements(ctypes.c_int64(n), ctypes.c_int64(k), 2), dtype=torch.bfloat16
    )
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    i64 = ctypes.c_int64
    assert (
        lib.pb_cpu_panel_pack(ctypes.c_void_p(weight.data_ptr()), i64(n), i64(k), 2, ctypes.c_void_p(packed.data_ptr()))
        == 0
    )
    status = lib.pb_cpu_panel_linear(
        ctypes.c_void_p(x.data_ptr()), i64(k), ctypes.c_void_p(packed.data_ptr()), None,
        ctypes.c_void_p(out.data_ptr()), i64(n), i64(rows), i64(n), i64(k), 2, 1,
    )  # fmt: skip
    assert status == 0
    close(out, panel_linear_reference(x.float(), weight.float()), torch.bfloat16)


def int8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights with a float32 scale per output, as torchao's int8_weight_only holds them."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
    return q, torch.rand(n, 1, generator=generator) * 0.02 + 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_int8_panels_give_the_float_panels_bits_on_the_dequantized_weight(dtype, shape, rows):
    """Each line is dequantized in registers as torchao's dequantize() rounds (q * scale in float32, then the
    activations' dtype), then the float step runs: the same bits as float panels of that weight, and torch's linear
    up to summation order."""
    q, scale = int8_weight(*shape, seed=shape[0] + rows)
    dequantized = (q.float() * scale).to(dtype)
    x, bias = randn(rows, shape[1], dtype=dtype, seed=rows), randn(shape[0], dtype=dtype, seed=7)
    out = PanelWeight.quantized(q, scale, 8, dtype)(x, bias)
    assert out.dtype == dtype and torch.equal(out, PanelWeight(dequantized)(x, bias))
    close(out, panel_linear_reference(x.float(), dequantized.float(), bias.float()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_parts_stack_with_their_scales(dtype):
    parts = [PanelWeight.quantized(*int8_weight(n, 64, seed=n), 8, dtype) for n in (96, 32, 40)]
    x = randn(2, 64, dtype=dtype, seed=5)
    alone = [part(x) for part in parts]
    group = PanelWeight.stack(parts)
    assert group is not None and group.scales.numel() == 96 + 32 + 48  # the last part's panel padded
    assert torch.equal(group(x), torch.cat(alone, dim=-1))
    assert all(torch.equal(part(x), expected) for part, expected in zip(parts, alone, strict=True))
    assert PanelWeight.stack([parts[0], PanelWeight(torch.zeros(32, 64, dtype=dtype))]) is None  # int8 beside float


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(576, 576), (49, 1536), (40, 64)])
@pytest.mark.parametrize("rows", [1, 3, 12])
def test_int8_panels_with_a_scale_per_group_of_32_give_the_float_panels_bits(dtype, shape, rows):
    """GGUF's Q8_0: int8 values with a float16 scale per output and 32 weights along K."""
    n, k = shape
    generator = torch.Generator().manual_seed(n + rows)
    q = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
    scale = (torch.rand(n, k // 32, generator=generator) * 0.02 + 1e-3).half().float()
    dequantized = (q.float() * scale.repeat_interleave(32, dim=1)).to(dtype)
    x, bias = randn(rows, k, dtype=dtype, seed=rows), randn(n, dtype=dtype, seed=9)
    out = PanelWeight.quantized(q, scale, 8, dtype, 32)(x, bias)
    assert out.dtype == dtype and torch.equal(out, PanelWeight(dequantized)(x, bias))


def int8_affine_weight(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, offset): 5-bit values 0 to 31 with a float16 scale and minimum per output and group of K, as GGUF's
    Q5_1 (and Q5_K) hold them: each weight scale * q + minimum."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 32, (n, k), generator=generator, dtype=torch.int8)
    scale = (torch.rand(n, k // group, generator=generator) * 0.02 - 0.01).half().float()  # negative ones too
    minimum = (torch.rand(n, k // group, generator=generator) * -0.15).half().float()
    return q, scale, minimum


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(576, 576, 32), (49, 1536, 32), (37, 160, 16)])
@pytest.mark.parametrize("rows", [1, 2, 3, 12, 53])
def test_int8_panels_with_an_offset_per_group_give_the_float_panels_bits(dtype, shape, rows):
    """GGUF's Q5_1 and Q5_K: q * scale + offset in one float32 rounding (the product is exact), then the dtype."""
    n, k, group = shape
    q, scale, offset = int8_affine_weight(n, k, group, seed=n + rows)
    dequantized = torch.addcmul(offset.repeat_interleave(group, dim=1), q.float(),
                                scale.repeat_interleave(group, dim=1)).to(dtype)  # fmt: skip
    x, bias = randn(rows, k, dtype=dtype, seed=rows), randn(n, dtype=dtype, seed=9)
    panel = PanelWeight.quantized(q, scale, 8, dtype, group, offset)
    assert panel.offsets and panel.scales.numel() == -(-n // 16) * 16 * (k // group) * 2
    assert torch.equal(panel(x, bias), PanelWeight(dequantized)(x, bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_parts_of_other_groups_and_offsets_stack_with_the_same_values(dtype):
    """A GGUF layer's q and k as Q5_1 (groups of 32, offsets) beside a Q8_0 v (no offsets) or a Q6_K one (groups of
    16): the stack takes groups of 16 with offsets (each scale repeated, -0 where a part had no offset), and every
    part still gives its own bits."""
    k = 128
    q5_1 = PanelWeight.quantized(*int8_affine_weight(64, k, 32, seed=1)[:2], 8, dtype, 32,
                                 int8_affine_weight(64, k, 32, seed=1)[2])  # fmt: skip
    q8_0_q, _ = int8_weight(32, k, seed=2)
    q8_0 = PanelWeight.quantized(q8_0_q, torch.rand(32, k // 32) * -0.02, 8, dtype, 32)  # negative: -0 products
    q6_k = PanelWeight.quantized(*int8_weight(40, k, seed=3)[:1], torch.rand(40, k // 16) * 0.02, 8, dtype, 16)
    per_output = PanelWeight.quantized(*int8_weight(16, k, seed=4), 8, dtype)
    x = randn(3, k, dtype=dtype, seed=5)
    for parts in ([q5_1, q8_0], [q5_1, q6_k], [per_output, q8_0, q6_k]):
        alone = [part(x) for part in parts]
        group = PanelWeight.stack(parts)
        assert group is not None and group.bits == 8
        assert (group.group_size, group.offsets) == (min(p.group_size for p in parts), any(p.offsets for p in parts))
        assert torch.equal(group(x), torch.cat(alone, dim=-1))
        assert all(torch.equal(part(x), expected) for part, expected in zip(parts, alone, strict=True))


def test_int8_panels_refuse_what_they_do_not_take():
    q, scale = int8_weight(8, 16, seed=1)
    with pytest.raises(ValueError, match="int8 panels pack 2-D CPU int8 weights"):
        PanelWeight.quantized(q.float(), scale, 8, torch.float32)
    with pytest.raises(ValueError, match="for torch.float16"):
        PanelWeight.quantized(q, scale, 8, torch.float16)
    with pytest.raises(ValueError, match="one scale per output: 4 scales for 8 outputs"):
        PanelWeight.quantized(q, scale[:4], 8, torch.float32)
    with pytest.raises(ValueError, match="one scale per output: 4 offsets for 8 outputs"):
        PanelWeight.quantized(q, scale, 8, torch.float32, 0, torch.zeros(4))


def plain_build_gives_its_float_bits(lib, panel: PanelWeight, q: torch.Tensor, dequantized: torch.Tensor, seed: int):
    """The plain build (`lib`) run on `panel`'s quantized values and scales gives the bits of its own float panels of
    the dequantized weight (`panel`: the native build's wrapper, for the scales' layout and the kind)."""
    (n, k), dtype, rows = q.shape, panel.dtype, 3
    code = 0 if dtype == torch.float32 else 2
    x = randn(rows, k, dtype=dtype, seed=seed)
    i64, ptr = ctypes.c_int64, lambda t: None if t is None else ctypes.c_void_p(t.data_ptr())
    elements = lib.pb_cpu_panel_packed_elements(i64(n), i64(k), code)
    packed_q = torch.empty(elements * panel.bits // 8, dtype=q.dtype)
    packed_f = torch.empty(elements, dtype=dtype)
    pack = lib.pb_cpu_panel_pack_int8 if panel.bits == 8 else lib.pb_cpu_panel_pack_int4
    assert pack(ptr(q), i64(n), i64(k), code, ptr(packed_q)) == 0
    assert lib.pb_cpu_panel_pack(ptr(dequantized.to(dtype)), i64(n), i64(k), code, ptr(packed_f)) == 0
    outs = [torch.empty(rows, n, dtype=dtype) for _ in range(2)]
    shape = (i64(rows), i64(n), i64(k), code, 1)
    assert lib.pb_cpu_panel_linear_quantized(ptr(x), i64(k), ptr(packed_q), panel.bits, ptr(panel.scales),
                                             i64(panel.group_size), int(panel.offsets), ptr(panel.levels), None,
                                             ptr(outs[0]), i64(n), *shape) == 0  # fmt: skip
    assert lib.pb_cpu_panel_linear(ptr(x), i64(k), ptr(packed_f), None, ptr(outs[1]), i64(n), *shape) == 0
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_panels_on_a_cpu_without_avx512_give_that_build_s_float_bits(dtype, plain_library):
    """The plain build dequantizes with GCC's vectors instead of AVX-512: its int8 panels give its own float panels'
    bits on the dequantized weight: a scale per output (odd K), and a scale and an offset per group of 32."""
    q, scale = int8_weight(40, 77, seed=21)
    panel = PanelWeight.quantized(q, scale, 8, dtype)
    plain_build_gives_its_float_bits(plain_library, panel, q, q.float() * scale, seed=22)
    q, scale, offset = int8_affine_weight(40, 96, 32, seed=25)
    dequantized = torch.addcmul(offset.repeat_interleave(32, dim=1), q.float(), scale.repeat_interleave(32, dim=1))
    panel = PanelWeight.quantized(q, scale, 8, dtype, 32, offset)
    plain_build_gives_its_float_bits(plain_library, panel, q, dequantized, seed=26)


def int4_weight(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """(q, scale, group, offset): int4 values 0 to 15 with a float16 scale and minimum per output and group, as GGUF's
    Q4_1 holds them (each weight scale * q + minimum)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=generator) * 0.02 + 1e-3).half().float()
    minimum = (torch.rand(n, k // group, generator=generator) * -0.15).half().float()
    return q, scale, group, minimum


def dequantized_int4(q: torch.Tensor, scale: torch.Tensor, group: int, offset: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """q * scale + offset in float32 (as gguf-py's dequantize: the product is exact), then `dtype`."""
    weights = q.float() * scale.repeat_interleave(group, dim=1)
    return (weights + offset.repeat_interleave(group, dim=1)).to(dtype)


def quantized_int4(q, scale, group, offset, dtype) -> PanelWeight:
    return PanelWeight.quantized(q, scale, 4, dtype, group, offset)


# (N, K, group): whole and partial panels, groups of 32 (torchao's) across k blocks of 64 steps, and small groups
INT4_SHAPES = [(576, 576, 32), (49, 1536, 32), (37, 160, 16), (200, 64, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", INT4_SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_int4_panels_give_the_float_panels_bits_on_the_dequantized_weight(dtype, shape, rows):
    n, k, group = shape
    weight = int4_weight(n, k, group, seed=n + rows)
    dequantized = dequantized_int4(*weight, dtype)
    x, bias = randn(rows, k, dtype=dtype, seed=rows), randn(n, dtype=dtype, seed=8)
    panel = quantized_int4(*weight, dtype)
    assert panel.packed.numel() * 2 == PanelWeight(dequantized).packed.numel()  # two weights a byte
    out = panel(x, bias)
    assert out.dtype == dtype and torch.equal(out, PanelWeight(dequantized)(x, bias))
    close(out, panel_linear_reference(x.float(), dequantized.float(), bias.float()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torchao_s_symmetric_int4_shifted_by_8_gives_q_times_scale_rounded_once(dtype):
    """torchao's int4 (values -8 to 7, any float32 scale) runs as q + 8 with offset -8 * scale: the one rounding of
    (q + 8) * scale - 8 * scale is that of q * scale, even where the product is not exact in float32."""
    n, k, group = 48, 128, 32
    generator = torch.Generator().manual_seed(11)
    q = torch.randint(-8, 8, (n, k), generator=generator, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=generator) * 0.02 + 1e-3  # full float32 mantissas
    dequantized = (q.float() * scale.repeat_interleave(group, dim=1)).to(dtype)
    x = randn(3, k, dtype=dtype, seed=12)
    panel = PanelWeight.quantized((q + 8).to(torch.uint8), scale, 4, dtype, group, scale * -8)
    assert torch.equal(panel(x), PanelWeight(dequantized)(x))


def test_int4_parts_stack_and_refuse_what_they_do_not_take():
    parts = [quantized_int4(*int4_weight(n, 64, 32, seed=n), torch.bfloat16) for n in (32, 40)]
    x = randn(2, 64, dtype=torch.bfloat16, seed=3)
    alone = [part(x) for part in parts]
    group = PanelWeight.stack(parts)
    assert group is not None and torch.equal(group(x), torch.cat(alone, dim=-1))
    int8 = PanelWeight.quantized(*int8_weight(32, 64, seed=1), 8, torch.bfloat16)
    int4 = quantized_int4(*int4_weight(32, 64, 32, seed=2), torch.bfloat16)
    assert PanelWeight.stack([int8, int4]) is None
    q, scale, _, offset = int4_weight(8, 64, 32, seed=4)
    with pytest.raises(ValueError, match="an even group size dividing K = 64, not 24"):
        PanelWeight.quantized(q, scale, 4, torch.float32, 24, offset)
    with pytest.raises(ValueError, match=r"scales \[8, 2\] \(outputs, groups\), not \(8, 4\)"):
        PanelWeight.quantized(q, torch.ones(8, 4), 4, torch.float32, 32, offset)
    with pytest.raises(ValueError, match=r"offsets \[8, 2\] \(outputs, groups\), not \(8, 1\)"):
        PanelWeight.quantized(q, scale, 4, torch.float32, 32, offset[:, :1])
    with pytest.raises(ValueError, match="int4 panels take a scale per output and group of K: give a group size"):
        PanelWeight.quantized(q, scale[:, 0], 4, torch.float32, 0, offset[:, 0])
    with pytest.raises(ValueError, match="levels are the 16 values of an int4 q, not 8 for int4"):
        PanelWeight.quantized(q, scale, 4, torch.float32, 32, offset, torch.arange(8.0))
    with_levels = PanelWeight.quantized(q, scale, 4, torch.bfloat16, 32, levels=torch.arange(16.0) - 8)
    assert PanelWeight.stack([with_levels, PanelWeight.quantized(q, scale, 4, torch.bfloat16, 32, offset)]) is None
    with pytest.raises(ValueError, match=r"int4 panels pack 2-D CPU uint8 weights \(0 to 15\)"):
        PanelWeight.quantized(q.to(torch.int8), scale, 4, torch.float32, 32, offset)


IQ4_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113.0])


def iq4_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, dequantized in float32): 4-bit indices into IQ4's 16 levels, a float16 scale per output and 32
    weights of K, each weight scale * level[q] (exact: an 11-bit scale times a 7-bit level)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, generator=generator) * 0.002 - 0.001).half().float()
    return q, scale, IQ4_LEVELS[q.long()] * scale.repeat_interleave(32, dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(576, 576), (49, 1536), (37, 160)])
@pytest.mark.parametrize("rows", [1, 2, 3, 12, 53])
def test_int4_panels_with_levels_give_the_float_panels_bits(dtype, shape, rows):
    """IQ4_NL / IQ4_XS: the 4-bit index reads one of 16 non-uniform levels (the permute's table), times the scale,
    no offset: the bits of float panels of the dequantized weight; its rows too."""
    q, scale, dequantized = iq4_weight(*shape, seed=shape[0] + rows)
    x, bias = randn(rows, shape[1], dtype=dtype, seed=rows), randn(shape[0], dtype=dtype, seed=9)
    panel = PanelWeight.quantized(q, scale, 4, dtype, 32, levels=IQ4_LEVELS)
    assert not panel.offsets and panel.scales.numel() == -(-shape[0] // 16) * 16 * (shape[1] // 32)
    assert torch.equal(panel(x, bias), PanelWeight(dequantized.to(dtype))(x, bias))
    assert torch.equal(panel.rows(torch.tensor([0, shape[0] - 1])), dequantized.to(dtype)[[0, shape[0] - 1]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_panels_on_a_cpu_without_avx512_give_that_build_s_float_bits(dtype, plain_library):
    """Q4_1-style values with scales and offsets, and IQ4's levels in place of 0 to 15 without offsets."""
    n, k, group = 40, 96, 32
    weight = int4_weight(n, k, group, seed=23)
    plain_build_gives_its_float_bits(plain_library, quantized_int4(*weight, dtype), weight[0],
                                     dequantized_int4(*weight, torch.float32), seed=24)  # fmt: skip
    odd_k = plain_library.pb_cpu_panel_pack_int4(ctypes.c_void_p(weight[0].data_ptr()), ctypes.c_int64(n),
                                                 ctypes.c_int64(k - 1), 0, None)  # fmt: skip
    assert odd_k == 2  # BAD_SHAPE: fp32 lines hold two steps
    q, scale, dequantized = iq4_weight(n, k, seed=27)
    panel = PanelWeight.quantized(q, scale, 4, dtype, 32, levels=IQ4_LEVELS)
    plain_build_gives_its_float_bits(plain_library, panel, q, dequantized, seed=28)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["float", "int8", "int8-groups-offsets", "int4"])
def test_rows_are_the_weight_s_rows_as_the_kernel_computes_with_them(dtype, kind):
    """`rows(ids)` gathers rows from the panels (what an embedding tied to the weight reads): the float weight's own
    rows, or the dequantized ones, bit for bit; partial last panel, odd K (bf16 pads a half pair), any id shape."""
    n, k = (49, 77) if kind in ("float", "int8") else (49, 96)
    if kind == "float":
        weight = randn(n, k, dtype=dtype, seed=31)
        panel = PanelWeight(weight)
    elif kind == "int8":
        q, scale = int8_weight(n, k, seed=32)
        panel, weight = PanelWeight.quantized(q, scale, 8, dtype), (q.float() * scale).to(dtype)
    elif kind == "int8-groups-offsets":
        q, scale, offset = int8_affine_weight(n, k, 32, seed=33)
        panel = PanelWeight.quantized(q, scale, 8, dtype, 32, offset)
        weight = torch.addcmul(offset.repeat_interleave(32, dim=1), q.float(), scale.repeat_interleave(32, dim=1))
        weight = weight.to(dtype)
    else:
        q, scale, group, offset = int4_weight(n, k, 32, seed=34)
        panel, weight = quantized_int4(q, scale, group, offset, dtype), dequantized_int4(q, scale, group, offset, dtype)
    ids = torch.tensor([[0, 15, 16], [48, 3, 3]])
    assert torch.equal(panel.rows(ids), weight[ids])
    assert torch.equal(panel.rows(torch.arange(n)), weight)
