"""The panel kernel's bfloat16 path on AMX tiles (csrc/cpu/panel_linear_cpu.cpp, `amx::linear`), on CPUs that have them
(Intel Sapphire Rapids and later): against torch and against the AVX-512 tiles it replaces, rows independent of the
batch, quantized panels on the float panels' bits, and the switch back. The other panel tests run it too wherever K is
a multiple of 32; this file holds what only a CPU with AMX can show, and skips elsewhere."""

import os
import subprocess
import sys

import pytest
import torch

from paged_backend.ops.cpu import AMX_SWITCH, amx_tiles
from paged_backend.ops.panel_linear import PanelWeight, panel_linear_reference

pytestmark = pytest.mark.skipif(not amx_tiles(), reason="needs a CPU with AMX-BF16 and an OS that grants the tiles")

BF16_TOLERANCE = dict(rtol=1.6e-2, atol=1e-2)  # both accumulate in float32 and round once; their sum orders differ


def randn(*shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * 0.1).to(torch.bfloat16)


def on_vector_tiles(call):
    """`call()` on the AVX-512 tiles; the AMX tiles are on again after."""
    amx_tiles(False)
    try:
        return call()
    finally:
        assert amx_tiles(True)


# (N, K, rows): one row (streaming), a decode batch, a row tile of 16 and a partial one, past a chunk of 128 rows;
# partial panels (N = 49, 200) and group tails of 1 to 3 panels
CASES = [(576, 576, 1), (49, 1536, 16), (200, 64, 17), (3072, 576, 64), (96, 128, 150)]


@pytest.mark.parametrize("n, k, rows", CASES)
def test_amx_tiles_match_torch_and_the_vector_tiles(n, k, rows):
    weight, bias, x = randn(n, k, seed=1), randn(n, seed=2), randn(rows, k, seed=3)
    packed = PanelWeight(weight)
    tiles = packed(x, bias)
    vectors = on_vector_tiles(lambda: packed(x, bias))
    expected = panel_linear_reference(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(tiles.float(), expected.float(), **BF16_TOLERANCE)
    torch.testing.assert_close(tiles.float(), vectors.float(), **BF16_TOLERANCE)


def test_amx_rows_are_bitwise_independent_of_the_batch_and_of_strides():
    weight = randn(960, 576, seed=6)
    x = randn(40, 2 * 576, seed=7)[:, :576]  # strided rows: the A tiles load them with x's own stride
    packed = PanelWeight(weight)
    batch = packed(x)
    for start, stop in [(0, 1), (1, 3), (5, 21), (16, 17), (0, 40)]:
        assert torch.equal(packed(x[start:stop]), batch[start:stop])
    assert torch.equal(packed(x.contiguous()), batch)


@pytest.mark.parametrize("rows", [1, 16, 33])
def test_quantized_panels_on_amx_give_the_float_panels_bits(rows):
    """int8 (a scale per output) and int4 (a scale and an offset per group of 32) dequantize into the tiles exactly as
    the vector tiles dequantize: the float panels' bits on the dequantized weight."""
    generator = torch.Generator().manual_seed(rows)
    n, k = 72, 256
    x = randn(rows, k, seed=rows + 1)
    q8 = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
    scale8 = torch.rand(n, 1, generator=generator) * 0.02 + 1e-3
    assert torch.equal(PanelWeight.quantized(q8, scale8, 8, torch.bfloat16)(x),
                       PanelWeight((q8.float() * scale8).to(torch.bfloat16))(x))  # fmt: skip
    q4 = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    scale4 = (torch.rand(n, k // 32, generator=generator) * 0.02 + 1e-3).half().float()
    offset4 = (torch.rand(n, k // 32, generator=generator) * -0.15).half().float()
    dequantized = (q4.float() * scale4.repeat_interleave(32, 1) + offset4.repeat_interleave(32, 1)).to(torch.bfloat16)
    assert torch.equal(PanelWeight.quantized(q4, scale4, 4, torch.bfloat16, 32, offset4)(x), PanelWeight(dequantized)(x))


def test_the_switch_turns_the_tiles_off_and_odd_widths_stay_on_the_vector_tiles():
    weight, x = randn(64, 77, seed=8), randn(5, 77, seed=9)  # K not a multiple of 32: the vector tiles either way
    packed = PanelWeight(weight)
    off = on_vector_tiles(lambda: (not amx_tiles(), packed(x)))
    assert off[0]
    assert torch.equal(packed(x), off[1])


def test_the_environment_switch_turns_the_tiles_off_from_the_start():
    code = "from paged_backend.ops.cpu import amx_tiles; print(amx_tiles())"
    for value, expected in (("0", "False"), ("1", "True")):
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, AMX_SWITCH: value},
                              capture_output=True, text=True, check=True)  # fmt: skip
        assert done.stdout.strip() == expected
