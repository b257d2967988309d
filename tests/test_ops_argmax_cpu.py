"""The greedy argmax kernel (csrc/cpu/argmax_cpu.cpp) against torch.argmax: the first maximum of each row, the first
NaN of a row that has one, infinities, ties within and across the kernel's chunks and vector lanes, odd widths,
strided rows, and torch's own path for what the kernel does not take."""

import pytest
import torch

from paged_backend.ops.argmax_cpu import _argmax, argmax_rows

pytestmark = pytest.mark.skipif(_argmax() is None, reason="the csrc/cpu library does not build here")


@pytest.mark.parametrize("cols", [1, 15, 16, 17, 255, 257, 49152])
def test_random_rows_match_torch(cols):
    logits = torch.randn(16, cols, generator=torch.Generator().manual_seed(cols))
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_ties_nan_and_infinities_pick_what_torch_picks():
    cols = 1000
    logits = torch.randn(8, cols, generator=torch.Generator().manual_seed(1))
    logits[0, [700, 3, 300]] = 9.0  # ties in three chunks: the first wins
    logits[1, [18, 17]] = 9.0  # ties in one vector
    logits[2, 999] = 9.0  # the scalar tail
    logits[3, [500, 40]] = float("nan")  # a NaN beats every number, the first NaN wins
    logits[4, 998] = float("nan")
    logits[5] = float("-inf")  # nothing allowed: index 0, as torch
    logits[6, [600, 601]] = float("inf")
    logits[7, [5, 6]] = torch.tensor([-0.0, 0.0]) + 50  # equal values of either sign
    expected = logits.argmax(dim=-1)
    assert torch.equal(argmax_rows(logits), expected)
    assert expected[:5].tolist() == [3, 17, 999, 40, 998]


def test_strided_rows_and_other_inputs_go_where_they_should():
    wide = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))
    rows = wide[:, 20:277]  # a stride of 300 between rows
    assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))
    for other in (wide.double(), wide.to(torch.bfloat16), wide[:, ::2], wide.reshape(2, 2, 300)):
        assert torch.equal(argmax_rows(other), other.argmax(dim=-1))  # torch's path
