"""Prepacked CPU linear layers (panels, or oneDNN without the csrc/cpu library): the same products as `F.linear`,
swapped in for the engine's forwards only, a caller's model left as it was, a loaded model's dense weights given up
for the packed ones, and sibling layers stacked into one call."""

from __future__ import annotations

import pytest
import torch
from _engine_helpers import ragged_prompts
from _hf_models import tiny_model as hf_tiny_model
from torch import nn

from paged_backend.engine import LLM, SamplingParams
from paged_backend.worker.models import byte_tokenizer, load_model, tiny_model
from paged_backend.worker.packed_linear import PackedLinears, packable, packs, panels_build

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_computes_what_the_dense_one_does(dtype, bias):
    layer = nn.Linear(96, 160, bias=bias, dtype=dtype)
    packed = PackedLinears(layer)
    assert len(packed) == (1 if packs(dtype) else 0)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    inputs = [torch.randn(1, 96), torch.randn(7, 96), torch.randn(1, 5, 96), torch.randn(6, 192)[:, ::2]]
    with torch.no_grad():
        for x in (x.to(dtype) for x in inputs):
            dense = layer(x)
            with packed.active():
                assert ("forward" in layer.__dict__) == packs(dtype)
                torch.testing.assert_close(layer(x), dense, **tolerance)
            assert "forward" not in layer.__dict__  # back to nn.Linear's own forward
            torch.testing.assert_close(layer(x), dense, rtol=0, atol=0)


class OwnForward(nn.Linear):
    def forward(self, x):  # e.g. a quantized layer's own kernel
        return super().forward(x) * 2


def test_only_plain_cpu_linears_in_float32_or_bfloat16_pack():
    assert packable(nn.Linear(8, 8))
    assert packs(torch.float32)
    assert packable(nn.Linear(8, 8, dtype=torch.bfloat16)) == packs(torch.bfloat16)
    assert not packable(nn.Linear(8, 8, dtype=torch.float16))
    assert not packable(OwnForward(8, 8))
    hooked = nn.Linear(8, 8)
    hooked.forward = lambda x: x  # what accelerate's offload hooks do
    assert not packable(hooked)
    assert not packable(nn.Linear(8, 8, device="meta"))


def test_a_callers_model_keeps_its_weights_and_forward():
    model = tiny_model("qwen2", seed=5)  # qwen2: q/k/v carry biases
    weights = {name: (param, param.detach().clone()) for name, param in model.named_parameters()}
    llm = LLM(model, tokenizer=byte_tokenizer(), num_blocks=64)
    packed = llm.engine.runner.packed
    assert packed is not None and len(packed) == sum(isinstance(m, nn.Linear) for m in model.modules())
    prompts = ragged_prompts(6, seed=2)
    outputs = llm.generate(prompts, GREEDY)
    for name, (param, value) in weights.items():
        assert dict(model.named_parameters())[name] is param and torch.equal(param, value), name
    assert not any("forward" in module.__dict__ for module in model.modules())
    dense = LLM(model, tokenizer=byte_tokenizer(), num_blocks=64, prepack_weights=False)
    assert dense.engine.runner.packed is None
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert [o.outputs[0].token_ids for o in dense.generate(prompts, GREEDY)] == tokens
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks - 1


def saved_tied_model(path, arch: str = "llama") -> nn.Module:
    """A tiny model whose LM head shares the embedding, saved with its tokenizer to `path` (loaded: the engine's
    own)."""
    model = (tiny_model if arch == "llama" else hf_tiny_model)(arch, seed=6)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return model


LOGPROBS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


def _run(llm, prompts):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, LOGPROBS)]


@pytest.mark.skipif(not panels_build(), reason="the panel kernel (csrc/cpu) does not build here")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_loaded_model_gives_up_its_dense_weights_and_its_tied_embedding_reads_the_head_s_panels(tmp_path, dtype):
    """The tied matrix is held once: the embedding's rows come from the LM head's panels, the same values, so the
    same tokens and logprobs bit for bit as the same model packed with its weights kept (a caller's object)."""
    saved_tied_model(tmp_path)
    model, _ = load_model(str(tmp_path), device="cpu", dtype=dtype)  # as the engine loads it, a caller's object
    prompts = ragged_prompts(5, seed=3)
    reference = LLM(model, tokenizer=byte_tokenizer(), num_blocks=64, prepack_weights=False).generate(prompts, GREEDY)
    kept = LLM(model, tokenizer=byte_tokenizer(), num_blocks=64)  # packed, every weight kept

    llm = LLM(str(tmp_path), num_blocks=64, dtype=dtype)
    loaded = llm.engine.model
    linears = [m for m in loaded.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.weight.numel() == 0 for m in linears)  # the packed copies replaced them, head too
    assert loaded.model.embed_tokens.weight.numel() == 0 and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert llm.engine.runner.packed._watched == []  # nothing left to change
    assert "forward" in loaded.model.embed_tokens.__dict__ and llm.engine.runner.fused is not None
    ours = _run(llm, prompts)
    assert [tokens for tokens, _ in ours] == [o.outputs[0].token_ids for o in reference]
    assert ours == _run(kept, prompts)
    assert model.model.embed_tokens.weight.shape == (model.config.vocab_size, model.config.hidden_size)  # untouched
    for engine in (llm.engine, kept.engine):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - 1


def test_only_the_layers_that_kept_their_weights_are_watched(tmp_path):
    """A loaded model's released layers are not checked each step. A tied head whose embedding does more than a
    lookup (Gemma's scales its rows) keeps the embedding's weight, and is still watched with it."""
    model = saved_tied_model(tmp_path, "gemma3")
    llm = LLM(str(tmp_path), num_blocks=64, dtype="float32")
    packed = llm.engine.runner.packed
    loaded = llm.engine.model
    assert packed._watched == [loaded.lm_head]
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied, still whole
    assert loaded.lm_head.weight.shape == (loaded.config.vocab_size, loaded.config.hidden_size)
    prompts = [[token % 120 + 3 for token in prompt] for prompt in ragged_prompts(4, seed=4)]  # (a 128-token vocab)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert packed.generation == 0
    rows = torch.linspace(0.2, 3.0, model.config.vocab_size)[:, None]  # favours the last ids in the head
    with torch.no_grad():
        loaded.model.embed_tokens.weight.mul_(rows.to(loaded.dtype))  # the head's weight too: it is one tensor
    assert llm.reset_prefix_cache()
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(rows)
    reference = LLM(model, tokenizer=byte_tokenizer(), num_blocks=64, prepack_weights=False).generate(prompts, GREEDY)
    assert after == [o.outputs[0].token_ids for o in reference] and after != before
    assert packed.generation == 1  # the head alone was packed again
    x = torch.randn(3, model.config.hidden_size, dtype=loaded.dtype)
    torch.testing.assert_close(packed.forwards()[loaded.lm_head](x), nn.functional.linear(x, loaded.lm_head.weight))


def test_weights_the_caller_changes_between_calls_are_packed_again():
    model, other = tiny_model("llama", seed=7), tiny_model("llama", seed=8)
    prompts = ragged_prompts(4, seed=4)
    llm = LLM(model, tokenizer=byte_tokenizer(), num_blocks=64)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    model.load_state_dict(other.state_dict())  # in place, as a weight sync or an optimizer step writes
    assert llm.reset_prefix_cache()  # cached prompt blocks hold KV of the old weights (as in vLLM)
    expected = LLM(other, tokenizer=byte_tokenizer(), num_blocks=64, prepack_weights=False).generate(prompts, GREEDY)
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert after == [o.outputs[0].token_ids for o in expected] and after != before
    with torch.no_grad():  # a replaced Parameter is packed again too
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.flip(0))  # the head reads no KV: no reset needed
    flipped = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    reference = LLM(model, tokenizer=byte_tokenizer(), num_blocks=64, prepack_weights=False).generate(prompts, GREEDY)
    assert flipped == [o.outputs[0].token_ids for o in reference]


@pytest.mark.skipif(not panels_build(), reason="stacking needs the panel kernel (the csrc/cpu library)")
@pytest.mark.parametrize("bias", [False, True])
def test_sibling_layers_stack_into_one_call_until_one_is_packed_again(bias):
    siblings = nn.ModuleList([nn.Linear(64, n, bias=bias) for n in (64, 32, 32)])  # q, k, v
    packed = PackedLinears(siblings)
    x = torch.randn(3, 64)
    with torch.no_grad():
        dense = torch.cat([layer(x) for layer in siblings], dim=-1)
        forwards = packed.forwards()
        stacked = packed.stacked(tuple(siblings))
        torch.testing.assert_close(stacked(x), dense, rtol=1e-5, atol=1e-5)
        assert packed.stacked(tuple(siblings)) is stacked  # built once
        for layer in siblings:  # each layer alone still answers from its slice of the stack
            torch.testing.assert_close(forwards[layer](x), layer(x), rtol=1e-5, atol=1e-5)
        siblings[1].weight.mul_(2)  # an in-place change: packed again, and stacked again
        packed.forwards()
        restacked = packed.stacked(tuple(siblings))
        assert restacked is not stacked
        torch.testing.assert_close(restacked(x)[:, 64:96], siblings[1](x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not panels_build(), reason="stacking needs the panel kernel (the csrc/cpu library)")
def test_layers_that_cannot_stack_say_so():
    partial = nn.ModuleList([nn.Linear(16, 40), nn.Linear(16, 32)])  # the first ends in a partial panel
    packed = PackedLinears(partial)
    packed.forwards()
    assert packed.stacked(tuple(partial)) is None
    unpacked = nn.ModuleList([nn.Linear(16, 32), nn.Linear(16, 32, dtype=torch.float16)])
    packed = PackedLinears(unpacked)
    packed.forwards()
    assert packed.stacked(tuple(unpacked)) is None
