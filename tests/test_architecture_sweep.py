"""A sweep of 15 architectures on tiny seeded models: PagedCache under generate and the engine give HF's
greedy tokens, or the engine refuses the model at load with `UnsupportedModel` naming it.

A transformers release that changes one of these architectures shows up here as a named failure.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from _sweep_models import SWEEP, sweep_model

from paged_backend.engine import LLM, SamplingParams
from paged_backend.errors import UnsupportedModel
from paged_backend.hf import PagedCache
from paged_backend.worker.models import byte_tokenizer

NEW_TOKENS = 6
PROMPTS = [[5, 17, 42, 99, 7, 180, 33], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78]]
# Their attention is written inline, not through transformers' AttentionInterface.
REFUSED = {"falcon", "bloom"}


@cache
def model_of(arch: str):
    return sweep_model(arch, seed=11)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], cache=None) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        past_key_values=cache,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", sorted(SWEEP))
def test_paged_cache_matches_dynamic_cache(arch):
    model = model_of(arch)
    for prompt in PROMPTS:
        assert hf_greedy(model, prompt, PagedCache(model, max_tokens=64, block_size=4)) == hf_greedy(model, prompt)


@pytest.mark.parametrize("arch", sorted(SWEEP))
def test_engine_matches_hf_or_refuses_at_load(arch):
    model = model_of(arch)
    expected = [hf_greedy(model, prompt) for prompt in PROMPTS]
    if arch in REFUSED:
        with pytest.raises(UnsupportedModel, match=f"{type(model).__name__}.*AttentionInterface"):
            LLM(model, tokenizer=byte_tokenizer(), device="cpu", num_blocks=16, block_size=4)
        return
    llm = LLM(model, tokenizer=byte_tokenizer(), device="cpu", num_blocks=16, block_size=4)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks - 1
