"""`LLM(model_object)` must leave the caller's object as it was: the side-by-side comparison any user runs
(HF generate and the engine on one model object, in one process, in either order) works and agrees."""

from __future__ import annotations

import torch

from paged_backend.engine import LLM, SamplingParams
from paged_backend.worker.models import byte_tokenizer, tiny_model

PROMPT = [5, 17, 99, 3, 42, 7, 250, 11]


def _hf_generate(model, max_new_tokens: int = 10) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False)
    return out[0, len(PROMPT):].tolist()


def test_generate_before_and_after_the_engine_on_one_object():
    model = tiny_model("llama", seed=3)
    model.set_attn_implementation("sdpa")
    before = _hf_generate(model)
    llm = LLM(model, tokenizer=byte_tokenizer(), num_blocks=32)
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert out.outputs[0].token_ids == before
    # Nothing visible changed: the attention implementation and the mode are the caller's, and plain
    # generate (no PagedCache) still runs and gives the same tokens.
    assert model.config._attn_implementation == "sdpa"
    assert _hf_generate(model) == before
    [again] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert again.outputs[0].token_ids == before
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks - 1


def test_a_model_in_train_mode_is_given_back_in_train_mode():
    model = tiny_model("qwen2", seed=4)
    model.train()
    llm = LLM(model, tokenizer=byte_tokenizer(), num_blocks=32)
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 6
    assert model.training and all(module.training for module in model.modules())
    model.eval()
    assert _hf_generate(model, 6) == out.outputs[0].token_ids
