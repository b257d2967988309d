"""Model loading: the embedded default, tiny models for tests, and real loading from a local directory."""

import pytest
import torch

from paged_backend.engine import LLM, SamplingParams
from paged_backend.errors import InvalidRequest
from paged_backend.worker.models import ARCHITECTURES, byte_tokenizer, embedded_model, load_model, tiny_model


def test_byte_tokenizer_round_trips_any_text_with_256_ids():
    tokenizer = byte_tokenizer()
    text = "naïve café ✓ 日本"
    ids = tokenizer(text).input_ids
    assert len(tokenizer) == 256 and max(ids) < 253
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|eos|>" and tokenizer.eos_token_id == 254


def test_byte_tokenizer_has_a_chat_template():
    prompt = byte_tokenizer().apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|bos|>user\nhi<|eos|>\n<|bos|>assistant\n"


def test_embedded_model_is_deterministic_and_llama_shaped():
    first, tokenizer = embedded_model()
    second, _ = embedded_model()
    assert type(first).__name__ == "LlamaForCausalLM"
    assert first.config.hidden_size == 256 and first.config.num_hidden_layers == 4
    assert first.config.num_key_value_heads < first.config.num_attention_heads
    assert first.config.vocab_size == len(tokenizer)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_tiny_models_of_every_architecture_generate(arch):
    llm = LLM(tiny_model(arch), tokenizer=byte_tokenizer(), num_blocks=32, block_size=4)
    out = llm.generate(["hi"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_tiny_model_rejects_unknown_architecture():
    with pytest.raises(InvalidRequest, match="architecture"):
        tiny_model("transformer-xl")


def test_load_from_local_directory_matches_the_saved_model(tmp_path):
    model, tokenizer = tiny_model("qwen2", seed=3), byte_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_model(str(tmp_path), device="cpu")
    assert type(loaded).__name__ == "Qwen2ForCausalLM" and loaded.dtype == torch.float32
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert loaded_tokenizer.decode(loaded_tokenizer("héllo").input_ids) == "héllo"
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    from_path = LLM(str(tmp_path), device="cpu", num_blocks=32, block_size=4).generate(["abc"], greedy)[0]
    from_object = LLM(model, tokenizer=tokenizer, num_blocks=32, block_size=4).generate(["abc"], greedy)[0]
    assert from_path.outputs[0].token_ids == from_object.outputs[0].token_ids


def test_load_with_explicit_dtype(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    loaded, _ = load_model(str(tmp_path), dtype="bfloat16", device="cpu")
    assert loaded.dtype == torch.bfloat16
    with pytest.raises(InvalidRequest, match="dtype"):
        load_model(str(tmp_path), dtype="int3", device="cpu")


def test_model_object_without_tokenizer_is_rejected():
    with pytest.raises(InvalidRequest, match="tokenizer"):
        LLM(tiny_model())
