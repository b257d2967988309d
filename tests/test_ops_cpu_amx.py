"""The CPU attention kernel's bf16 decode on AMX tiles (csrc/cpu/attention_tiles.h), on CPUs that have them (Intel
Sapphire Rapids and later): against the oracle and against the AVX-512 path it replaces, over head dims of two to
eight tile steps, one to 64 rows per kv head, blocks narrower than sixteen keys and partial groups, a softcap, a
window and split contexts, bf16 and fp8 caches, with every slot outside the contexts poisoned with NaN (`build_case`); and a row's bits
independent of the batch. The other bf16 kernel tests run it too wherever head_dim is a multiple of 32; this file
holds what only a CPU with AMX can show, and skips elsewhere."""

from __future__ import annotations

import pytest
import torch

from paged_backend.ops import cpu, reference
from tests._ops_cases import AttentionCase, build_case, tolerance

pytestmark = pytest.mark.skipif(not cpu.amx_tiles(), reason="needs a CPU with AMX-BF16 and an OS that grants the tiles")

BF16 = torch.bfloat16
CASES = [
    # Llama-3-8B's heads: four rows per kv head, a whole group, partial last groups, 4 tile steps
    AttentionCase("d128-g4", q_lens=(1, 1, 1), seq_lens=(16, 45, 300), group=4, head_dim=128, dtype=BF16),
    # short drafts: one, three and seven rows per kv head (slices of four, the last padded), 2 tile steps
    AttentionCase("d64-g1-drafts", q_lens=(1, 3, 7), seq_lens=(20, 50, 90), group=1, head_dim=64, dtype=BF16),
    # 9-16 rows per kv head: the values in three or four slices of four rows, a last partial one padded with zeros
    AttentionCase("d128-g4-9-to-16-rows", q_lens=(3, 4, 1), seq_lens=(40, 130, 77), group=4, head_dim=128,
                  dtype=BF16),
    AttentionCase("d64-g8-two-tokens", q_lens=(2, 1), seq_lens=(50, 33), group=8, head_dim=64, dtype=BF16,
                  softcap=4.0),
    AttentionCase("d96-g2-ten-rows-bs8", q_lens=(5,), seq_lens=(61,), group=2, head_dim=96, block_size=8, dtype=BF16),
    # prefill tiles of 30 and 64 rows per kv head: scores in passes of 16 rows, values in slices of 4, the last of
    # each padded
    AttentionCase("d64-g1-prefill-30-rows", q_lens=(30,), seq_lens=(100,), group=1, head_dim=64, dtype=BF16),
    AttentionCase("d128-g4-prefill-64-rows", q_lens=(40, 1), seq_lens=(90, 20), group=4, head_dim=128, dtype=BF16,
                  sliding_window=50),
    # blocks of eight keys: every group partial, copied and zero-padded; 3 tile steps
    AttentionCase("d96-g2-bs8", q_lens=(1, 3), seq_lens=(23, 61), group=2, head_dim=96, block_size=8, dtype=BF16),
    # 8 tile steps (two passes of four value C tiles), seven rows per kv head, a softcap
    AttentionCase("d256-g7-bs32-softcap", q_lens=(1, 1), seq_lens=(33, 100), group=7, head_dim=256, block_size=32,
                  dtype=BF16, softcap=5.0),
    # contexts cut into parts and merged, a window starting inside one
    AttentionCase("d128-split-window", q_lens=(1, 1), seq_lens=(4500, 2100), group=4, head_dim=128, dtype=BF16,
                  sliding_window=1500),
    # fp8 caches under a bf16 query: each group of sixteen keys widened to bf16 (exactly) before the tiles; decode,
    # a prefill tile of 64 rows per kv head, partial groups of blocks of eight keys, and split contexts
    AttentionCase("fp8-d128-g4", q_lens=(1, 1, 1), seq_lens=(16, 45, 300), group=4, head_dim=128, dtype=BF16,
                  kv_dtype=torch.float8_e4m3fn, k_scale=0.05, v_scale=0.02),
    AttentionCase("fp8-d64-g4-prefill-64-rows", q_lens=(16, 1), seq_lens=(70, 20), group=4, head_dim=64, dtype=BF16,
                  kv_dtype=torch.float8_e4m3fn, k_scale=0.1, v_scale=0.1, softcap=5.0),
    AttentionCase("fp8-d96-g2-bs8", q_lens=(1, 3), seq_lens=(23, 61), group=2, head_dim=96, block_size=8, dtype=BF16,
                  kv_dtype=torch.float8_e4m3fn, k_scale=0.05, v_scale=0.05),
    AttentionCase("fp8-d128-split-window", q_lens=(1, 1), seq_lens=(4500, 2100), group=4, head_dim=128, dtype=BF16,
                  kv_dtype=torch.float8_e4m3fn, k_scale=0.05, v_scale=0.05, sliding_window=1500),
]


def on_vector_code(call):
    """`call()` on the AVX-512 path; the AMX tiles are on again after."""
    cpu.amx_tiles(False)
    try:
        return call()
    finally:
        assert cpu.amx_tiles(True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tiles_match_the_oracle_and_the_vector_path(case: AttentionCase):
    built = build_case(case)
    kwargs = dict(sliding_window=case.sliding_window, softcap=case.softcap, k_scale=case.k_scale,
                  v_scale=case.v_scale)
    tiles = cpu.paged_attention(*built.attention_args(), **kwargs)
    vectors = on_vector_code(lambda: cpu.paged_attention(*built.attention_args(), **kwargs))
    expected = reference.paged_attention(*built.attention_args(), **kwargs)
    assert not tiles.float().isnan().any()  # no NaN from the poisoned slots past a partial group
    torch.testing.assert_close(tiles.float(), expected.float(), **tolerance(case))
    torch.testing.assert_close(tiles.float(), vectors.float(), **tolerance(case))
    if case.name in ("d128-g4", "fp8-d128-g4"):  # the tiles did run: they sum in another order than the vectors
        assert not torch.equal(tiles, vectors)


def test_a_rows_bits_do_not_depend_on_the_batch():
    """Each decode row alone gives the bits it gets beside the others (contexts under 512 keys: no split, whose cut
    follows the batch outside batch-invariant mode)."""
    case = AttentionCase("batch", q_lens=(1, 1, 1, 1), seq_lens=(16, 75, 200, 500), group=4, head_dim=128, dtype=BF16)
    built = build_case(case)
    batch = cpu.paged_attention(*built.attention_args())
    for i in range(len(case.seq_lens)):
        alone = cpu.paged_attention(built.query[i : i + 1], built.key_cache, built.value_cache,
                                    built.block_tables[i : i + 1], built.seq_lens[i : i + 1],
                                    torch.tensor([0, 1], dtype=torch.int32), built.scale)  # fmt: skip
        assert torch.equal(alone, batch[i : i + 1])
