"""Decode steps through the CUDA-graph buffers (worker/decode_graphs.py), run eagerly on CPU: padding, buffer
filling and the choice of steps are what a captured graph replays, so they are checked here against HF generate.
Capture and replay themselves run on a GPU (tests/test_engine_cuda.py)."""

from __future__ import annotations

import pytest
import torch
from _engine_helpers import MAX_TOKENS, hf_greedy, make_llm_fixture, ragged_prompts  # noqa: F401

from paged_backend.engine import SamplingParams
from paged_backend.errors import InvalidRequest
from paged_backend.worker.decode_graphs import capture_sizes
from paged_backend.worker.runner import SequenceRows

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def test_capture_sizes_are_vllms_and_end_at_the_largest():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def graphed_llm(make_llm, max_batch: int, **engine_kwargs):
    """An engine on transformers' forward (the torch attention oracle), its decode steps through the buffers."""
    llm = make_llm("llama", attention_backend="torch", **engine_kwargs)
    runner = llm.engine.runner
    runner.use_decode_graphs(max_batch, max_blocks=64, capture=False)
    return llm, runner.decode_graphs


@pytest.mark.parametrize(
    "engine_kwargs",
    [dict(max_num_seqs=11), dict(max_num_seqs=11, max_num_batched_tokens=16), dict(num_blocks=40, watermark=0.0)],
    ids=["padded-batches", "chunked-prefill", "recompute-preemption"],
)
def test_decode_steps_through_the_buffers_match_hf_generate(make_llm, engine_kwargs):
    prompts = ragged_prompts()
    llm, graphs = graphed_llm(make_llm, 12, **engine_kwargs)  # sizes 1, 2, 4, 8, 12: most steps padded
    outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy("llama", p) for p in prompts]
    assert 0 < graphs.steps < llm.engine.stats().num_steps  # decode steps took the buffers, prefill steps did not


def test_capture_all_runs_every_size_largest_first_on_padding_rows_that_write_no_kv(make_llm):
    llm, graphs = graphed_llm(make_llm, 12)
    pool = llm.engine.kv_cache
    layers = [pool.layer(i) for i in range(pool.num_layers)]
    before = [(key.clone(), value.clone()) for key, value in layers]
    forward, sizes = graphs.forward, []
    graphs.forward = lambda ids, *rest: sizes.append(ids.shape[1]) or forward(ids, *rest)
    graphs.capture_all()  # eagerly here: the forwards a GPU captures at startup
    assert sizes == [12, 8, 4, 2, 1] and graphs.steps == 0
    for (key_before, value_before), (key, value) in zip(before, layers, strict=True):
        assert torch.equal(key_before, key) and torch.equal(value_before, value)
    prompts = ragged_prompts()
    outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy("llama", p) for p in prompts]


def test_padding_rows_write_no_kv(make_llm):
    llm, graphs = graphed_llm(make_llm, 8)
    runner, pool = llm.engine.runner, llm.engine.kv_cache
    layers = [pool.layer(i) for i in range(pool.num_layers)]
    before = [(k.clone(), v.clone()) for k, v in layers]
    rows = [SequenceRows(token_ids=[7 + n], start=0, block_tables=[[block]]) for n, block in enumerate((3, 5, 9))]
    logits = runner.execute(rows)  # 3 rows, padded to 4
    assert graphs.steps == 1 and logits.shape[0] == 3
    for (key_before, value_before), (key, value) in zip(before, layers, strict=True):
        for old, new in ((key_before, key), (value_before, value)):
            written = (old != new).flatten(2).any(-1).nonzero().tolist()  # (block, offset) pairs
            assert written == [[3, 0], [5, 0], [9, 0]]


def test_graphs_are_refused_on_cpu_with_the_flag_to_drop(make_llm):
    with pytest.raises(InvalidRequest, match="need a CUDA device.*drop --max-cudagraph-capture-size"):
        make_llm("llama", attention_backend="torch", max_cudagraph_capture_size=8)
    assert make_llm("llama", max_cudagraph_capture_size=8, enforce_eager=True).engine.runner.decode_graphs is None


def test_the_fused_cpu_forward_has_no_graphs(make_llm):
    runner = make_llm("llama").engine.runner
    assert runner.fused is not None
    with pytest.raises(ValueError, match="fused CPU forward"):
        runner.use_decode_graphs(8, 64)
    assert torch.cuda.is_available() or runner.decode_graphs is None
