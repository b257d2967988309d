"""The KV-memory replay: paged waste stays under 4% where contiguous buffers waste most of their memory."""

from _benchmark_modules import load_benchmark

kv_memory = load_benchmark("kv_memory")


def test_paged_pool_wastes_under_4_percent_and_fits_more_requests():
    workload = kv_memory.make_workload(200, max_len=2048, seed=1)
    contiguous = kv_memory.replay_contiguous(workload, budget_tokens=16384, max_len=2048)
    paged = kv_memory.replay_paged(workload, budget_tokens=16384, block_size=16)  # asserts no leak itself
    assert paged.waste_pct < 4.0
    assert contiguous.waste_pct > 50.0
    assert paged.peak_concurrent >= 3 * contiguous.peak_concurrent
