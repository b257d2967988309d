"""benchmarks/attention.py: --tables engine lays decode tables out with the real BlockManager, every block once;
--cpu-kv-dtype puts the pools in fp8 and gives the baselines the same values."""

import pytest
import torch
from _benchmark_modules import load_benchmark

attention_bench = load_benchmark("attention")


def test_engine_tables_hold_every_block_once_with_each_prompt_in_ascending_order():
    batch, context, block_size = 8, 512, 16
    tables = attention_bench.engine_tables(batch, context, block_size)
    assert tables.shape == (batch, context // block_size)
    assert sorted(tables.flatten().tolist()) == list(range(1, batch * context // block_size + 1))  # 0 is null
    prompt_blocks = (context - attention_bench.DECODED) // block_size
    for row in tables.tolist():
        assert row[:prompt_blocks] == sorted(row[:prompt_blocks])  # one allocation: ascending (BlockPool.take_ids)
    # the decoded blocks were taken a step at a time across the batch: interleaved, not one run per sequence
    decoded = tables[:, prompt_blocks:]
    assert (decoded[:, 1:] - decoded[:, :-1] != 1).any()


@pytest.mark.parametrize("fp8", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pools_hold_what_the_contiguous_baseline_reads_and_their_bytes_are_counted(monkeypatch, fp8):
    monkeypatch.setattr(attention_bench, "KV_DTYPE", attention_bench.FP8_DTYPES[fp8])
    b = attention_bench.make_batch(2, 64, 16, torch.bfloat16, "cpu")
    assert b.key_cache.dtype == b.value_cache.dtype == attention_bench.FP8_DTYPES[fp8]
    assert b.contiguous_key.dtype == torch.bfloat16
    assert b.kv_bytes == 2 * 2 * 64 * attention_bench.NUM_KV_HEADS * attention_bench.HEAD_DIM  # one byte a value
    tokens = b.value_cache[b.block_tables[1].long()].flatten(0, 1)  # sequence 1's values in order, [64, Hkv, D]
    want = (tokens.float() * attention_bench.KV_SCALE).to(torch.bfloat16).transpose(0, 1)
    assert torch.equal(b.contiguous_value[1], want)
    # the kernel reads them with the scales: it matches SDPA over the baseline's values
    out = attention_bench.paged(b, "cpu")()
    dense = attention_bench.sdpa_contiguous(b)().view_as(out)
    torch.testing.assert_close(out.float(), dense.float(), atol=2e-2, rtol=2e-2)
