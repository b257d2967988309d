"""vLLM's `LLM` calls that user scripts make besides generate / chat: `llm_engine`, `get_tokenizer` /
`set_tokenizer`, `get_default_sampling_params` (the model's generation_config), `sleep` / `wake_up`; and a LoRA
adapter folder given as the model, refused with what to do instead."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tokenizers import processors
from transformers import AutoModelForCausalLM, GenerationConfig

from paged_backend.engine import LLM, SamplingParams
from paged_backend.errors import InvalidRequest
from paged_backend.lora import LoRARequest
from paged_backend.worker.default_model import TINY_MODEL
from paged_backend.worker.models import SPECIAL_TOKENS, byte_tokenizer, tiny_model

PROMPT = "A paged KV cache keeps each sequence in fixed-size blocks, so "  # longer than one 16-token block
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY_MODEL, device="cpu", num_blocks=64, dtype="float32", enable_sleep_mode=True)


def greedy(llm: LLM) -> list[int]:
    return llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids


def test_llm_engine_and_get_tokenizer_are_the_engines(llm):
    assert llm.llm_engine is llm.engine
    tokenizer = llm.get_tokenizer()
    [out] = llm.generate(PROMPT, GREEDY)
    assert out.prompt_token_ids == tokenizer.encode(PROMPT)
    assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_set_tokenizer_tokenizes_detokenizes_and_stops_with_the_new_one():
    llm = LLM(TINY_MODEL, device="cpu", num_blocks=64, dtype="float32")
    ids = {"prompt_token_ids": [72, 105, 33, 10, 65, 66]}
    tokens = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    stop_at = next(k for k in range(1, len(tokens)) if tokens[k] not in tokens[:k])
    other = byte_tokenizer()  # the same ids, but a BOS before every prompt and one of the model's tokens as EOS
    other.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", SPECIAL_TOKENS["<|bos|>"])]
    )
    other.eos_token = other.convert_ids_to_tokens(tokens[stop_at])
    llm.set_tokenizer(other)
    assert llm.get_tokenizer() is other
    [out] = llm.generate(PROMPT, GREEDY)
    assert out.prompt_token_ids == [SPECIAL_TOKENS["<|bos|>"], *byte_tokenizer().encode(PROMPT)]
    assert out.outputs[0].text == other.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    stopped = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert stopped.token_ids == tokens[: stop_at + 1] and stopped.finish_reason == "stop"


def test_default_sampling_params_come_from_the_generation_config(llm, tmp_path):
    assert llm.get_default_sampling_params() == SamplingParams()  # the tiny model's sets no sampling field
    model = tiny_model(seed=5)
    # top_k=1 keeps the argmax after the repetition penalty: greedy with that penalty, whatever the temperature
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=0.6, top_p=0.9, top_k=1, min_p=0.05, repetition_penalty=1.3, max_new_tokens=5,
        eos_token_id=SPECIAL_TOKENS["<|eos|>"],
    )  # fmt: skip
    model.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    configured = LLM(str(tmp_path), device="cpu", num_blocks=64, dtype="float32")
    defaults = configured.get_default_sampling_params()
    assert defaults == SamplingParams(temperature=0.6, top_p=0.9, top_k=1, min_p=0.05, repetition_penalty=1.3,
                                      max_tokens=5)  # fmt: skip
    [out] = configured.generate(PROMPT)  # no sampling params: the defaults, as vLLM's generate
    expected = configured.generate(PROMPT, SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=5))
    assert out.outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    [answer] = configured.chat([{"role": "user", "content": "Hi"}])
    assert len(answer.outputs[0].token_ids) <= 5


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_memory_and_wake_up_gives_the_same_greedy_tokens(llm, level):
    before = greedy(llm)
    assert greedy(llm) == before  # from the prefix cache
    llm.sleep(level)
    assert llm.llm_engine.kv_cache.total_bytes == 0
    assert all(p.is_meta for p in llm.llm_engine.model.parameters()) == (level == 2)
    with pytest.raises(InvalidRequest, match=rf"asleep \(level {level}\); call wake_up\(\) first"):
        llm.generate(PROMPT, GREEDY)
    llm.wake_up()
    hits = llm.llm_engine.stats().prefix_cache_hits
    assert greedy(llm) == before
    assert llm.llm_engine.stats().prefix_cache_hits == hits  # the cached prefixes were forgotten


def test_wake_up_tags_bring_back_the_weights_then_the_kv_cache(llm):
    before = greedy(llm)
    llm.sleep(2)
    llm.wake_up(tags=["weights"])
    assert not any(p.is_meta for p in llm.llm_engine.model.parameters())
    with pytest.raises(InvalidRequest, match=r"asleep \(level 1\)"):  # the KV pool is still released
        llm.generate(PROMPT, GREEDY)
    llm.wake_up(tags=["kv_cache"])
    assert greedy(llm) == before
    with pytest.raises(InvalidRequest, match="sleep level 3 does not exist"):
        llm.sleep(3)


def test_a_lora_adapter_given_as_the_model_names_its_base_and_how_to_serve_it(tmp_path):
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "sql-adapter"
    tiny_model(seed=3).save_pretrained(base_dir)
    byte_tokenizer().save_pretrained(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir)  # so the adapter records base_model_name_or_path
    torch.manual_seed(0)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(adapter_dir)
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_dir)
    with pytest.raises(InvalidRequest) as refused:
        LLM(str(adapter_dir), device="cpu", num_blocks=64)
    message = str(refused.value)
    assert f"'{adapter_dir}' is a LoRA adapter, not a model; its base model is '{base_dir}'" in message
    assert f"--model {base_dir} --enable-lora --lora-modules sql-adapter={adapter_dir}" in message
    assert "enable_lora=True" in message and "LoRARequest('sql-adapter', 1, " in message
    # what it says to do runs
    fixed = LLM(str(base_dir), device="cpu", num_blocks=64, enable_lora=True)
    [out] = fixed.generate(PROMPT, GREEDY, lora_request=LoRARequest("sql-adapter", 1, str(adapter_dir)))
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens

    settings = json.loads((adapter_dir / "adapter_config.json").read_text())
    settings["base_model_name_or_path"] = None
    (adapter_dir / "adapter_config.json").write_text(json.dumps(settings))
    with pytest.raises(InvalidRequest, match=r"its base model is not named .*--model BASE_MODEL --enable-lora"):
        LLM(str(adapter_dir), device="cpu", num_blocks=64)


def test_chat_outputs_carry_the_prompt_the_template_wrote(llm):
    [answer] = llm.chat([{"role": "user", "content": "Hello there"}], GREEDY)
    assert "Hello there" in answer.prompt and answer.prompt != "Hello there"  # the template's frame around it
    assert llm.get_tokenizer().decode(answer.prompt_token_ids) == answer.prompt
