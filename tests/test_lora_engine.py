"""LoRA through the engine: one batch mixing three peft adapters and the base model equals peft's own greedy
generate per adapter; adapters never share prefix-cache KV; eviction under max_loras=1; bad adapters refused."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from _lora_helpers import ADAPTERS, DTYPE, PROMPTS, adapter_builder

from paged_backend.engine import LLM, SamplingParams
from paged_backend.errors import BadLoRAAdapter, InvalidRequest
from paged_backend.lora import LoRARequest
from paged_backend.worker.models import byte_tokenizer, tiny_model

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
LORA = dict(device="cpu", dtype=DTYPE, enable_lora=True, max_lora_rank=8)  # with peft's float32 reference


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Per architecture (built once): base model directory, a LoRARequest per adapter, peft's tokens."""
    return adapter_builder(tmp_path_factory, MAX_TOKENS)


@pytest.fixture(scope="module")
def llama(built):
    return built("llama")


def _mixed_batch(loras):
    """Every prompt under every adapter and the base model, interleaved so each step mixes all four."""
    pairs = [(prompt, name) for prompt in PROMPTS for name in [None, *loras]]
    return (
        [p for p, _ in pairs],
        [loras.get(n) for _, n in pairs],
        [(i, n) for i in range(len(PROMPTS)) for n in [None, *loras]],
    )


def _check(llm, loras, expected):
    prompts, requests, keys = _mixed_batch(loras)
    outputs = llm.generate(prompts, GREEDY, lora_request=requests)
    for (index, name), output in zip(keys, outputs, strict=True):
        assert output.outputs[0].token_ids == expected[name][index], (name, index)
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks - 1


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_batch_mixing_three_adapters_and_the_base_equals_peft(built, arch):
    model_dir, loras, expected = built(arch)
    assert len({tuple(expected[name][0]) for name in expected}) == 4  # each adapter really changes the tokens
    llm = LLM(str(model_dir), **LORA, max_loras=3, num_blocks=96, block_size=4)
    _check(llm, loras, expected)


def test_eviction_under_max_loras_1_with_three_adapters_in_flight(llama):
    model_dir, loras, expected = llama
    llm = LLM(str(model_dir), **LORA, max_loras=1, num_blocks=96, block_size=4)
    _check(llm, loras, expected)
    assert len(llm.engine.lora.slots) == 1


def test_the_prefix_cache_is_never_shared_across_adapters(llama):
    model_dir, loras, expected = llama
    llm = LLM(str(model_dir), **LORA, max_loras=2, num_blocks=96, block_size=4)
    manager = llm.engine.block_manager
    prompt = PROMPTS[0]  # 18 tokens: four full blocks of 4 could be reused
    reused = []
    for name in ["attn4", "all8", None, "attn4"]:
        hits = manager.prefix_hits
        [out] = llm.generate([prompt], GREEDY, lora_request=loras.get(name))
        assert out.outputs[0].token_ids == expected[name][0]
        reused.append(manager.prefix_hits - hits)
    assert reused == [0, 0, 0, 16]  # only the same adapter's second run reads cached KV


def test_the_callers_model_object_is_left_as_it_was(llama):
    _, loras, expected = llama
    model = tiny_model("llama", seed=3)
    llm = LLM(model, tokenizer=byte_tokenizer(), enable_lora=True, max_loras=1, max_lora_rank=8, num_blocks=64)
    [out] = llm.generate([PROMPTS[1]], GREEDY, lora_request=loras["all8"])
    assert out.outputs[0].token_ids == expected["all8"][1]
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():  # the adapter's hooks are inert outside the engine's own forwards
        plain = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False
        )
    assert plain[0, len(PROMPTS[1]) :].tolist() == expected[None][1]
    # A second engine on the same object (its own adapters, or none) never sees the first one's updates.
    other = LLM(model, tokenizer=byte_tokenizer(), enable_lora=True, max_loras=1, max_lora_rank=8, num_blocks=64)
    [base, adapted] = other.generate([PROMPTS[1]] * 2, GREEDY, lora_request=[None, loras["attn4"]])
    assert base.outputs[0].token_ids == expected[None][1] and adapted.outputs[0].token_ids == expected["attn4"][1]
    hooks = sum(len(module._forward_hooks) for module in model.modules())
    del llm, other
    gc.collect()
    assert hooks > 0 and sum(len(module._forward_hooks) for module in model.modules()) == 0  # gone with the engines


def _broken(tmp_path, source, name, edit):
    target = tmp_path / name
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    edit(target)
    return target


def _rename_module(directory):
    from safetensors.torch import load_file, save_file

    path = directory / "adapter_model.safetensors"
    tensors = {key.replace("q_proj", "qq_proj"): value for key, value in load_file(str(path)).items()}
    save_file(tensors, str(path))
    config = json.loads((directory / "adapter_config.json").read_text())
    (directory / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["qq_proj", "v_proj"]}))


def test_bad_adapters_get_a_clear_error_and_nothing_leaks(llama, tmp_path):
    model_dir, loras, _ = llama
    llm = LLM(str(model_dir), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=4, num_blocks=64)
    source = Path(loras["attn4"].lora_path)
    cases = {
        "no such directory": (tmp_path / "absent", "is not a directory"),
        "no weights": (
            _broken(tmp_path, source, "noweights", lambda d: (d / "adapter_model.safetensors").unlink()),
            "adapter_model.safetensors",
        ),
        "no config": (
            _broken(tmp_path, source, "noconfig", lambda d: (d / "adapter_config.json").unlink()),
            "adapter_config.json",
        ),
        "rank 8 > max 4": (loras["all8"].lora_path, "raise max_lora_rank"),
        "module not in model": (_broken(tmp_path, source, "badmodule", _rename_module), "qq_proj"),
    }
    for case, (path, words) in cases.items():
        with pytest.raises(BadLoRAAdapter, match=words):
            llm.generate(
                [PROMPTS[0], PROMPTS[1]], GREEDY, lora_request=[loras["attn4"], LoRARequest(case, 9, str(path))]
            )
    assert llm.engine.lora.adapters.keys() == {"attn4"}  # the bad ones were never registered
    assert not llm.engine.has_unfinished_requests()
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks - 1
    without = LLM(str(model_dir), device="cpu", num_blocks=16)
    with pytest.raises(InvalidRequest, match="enable_lora"):
        without.generate([PROMPTS[0]], GREEDY, lora_request=loras["attn4"])
    assert set(ADAPTERS) == set(loras)
