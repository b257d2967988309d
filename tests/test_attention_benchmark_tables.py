"""benchmarks/attention.py --tables engine: decode tables laid out by the real BlockManager, every block once."""

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
