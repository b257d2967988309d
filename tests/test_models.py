"""Model loading: the embedded default, tiny models for tests, and real loading from a local directory."""

from pathlib import Path

import pytest
import torch

from paged_backend.engine import LLM, SamplingParams
from paged_backend.errors import InvalidRequest
from paged_backend.worker import models
from paged_backend.worker.models import (
    ARCHITECTURES,
    byte_tokenizer,
    cpu_auto_dtype,
    embedded_model,
    load_model,
    resolve_dtype,
    tiny_model,
)
from paged_backend.worker.packed_linear import dtype_packs


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
    loaded, loaded_tokenizer = load_model(str(tmp_path), device="cpu", dtype="float32")  # as saved (auto: maybe bf16)
    assert type(loaded).__name__ == "Qwen2ForCausalLM" and loaded.dtype == torch.float32
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert loaded_tokenizer.decode(loaded_tokenizer("héllo").input_ids) == "héllo"
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_blocks=32, block_size=4)  # the saved model's dtype
    from_path = llm.generate(["abc"], greedy)[0]
    from_object = LLM(model, tokenizer=tokenizer, num_blocks=32, block_size=4).generate(["abc"], greedy)[0]
    assert from_path.outputs[0].token_ids == from_object.outputs[0].token_ids


def test_a_bad_tokenizer_is_blamed_on_the_tokenizer_not_the_model(tmp_path):
    model_dir, empty = tmp_path / "model", tmp_path / "empty"
    tiny_model().save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    empty.mkdir()
    with pytest.raises(InvalidRequest, match=r"tokenizer '.*missing' not found: no such directory \(--tokenizer\)"):
        load_model(str(model_dir), tokenizer=str(tmp_path / "missing"), device="cpu")
    with pytest.raises(InvalidRequest, match=r"tokenizer '.*empty' .*\(--tokenizer\)") as refused:
        load_model(str(model_dir), tokenizer=str(empty), device="cpu")
    assert "model path" not in str(refused.value)


def test_load_with_explicit_dtype(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    loaded, _ = load_model(str(tmp_path), dtype="bfloat16", device="cpu")
    assert loaded.dtype == torch.bfloat16
    with pytest.raises(InvalidRequest, match="dtype"):
        load_model(str(tmp_path), dtype="int3", device="cpu")


def test_dtype_auto_on_cpu_is_bfloat16_exactly_where_the_cores_compute_it(monkeypatch, capsys):
    """`--dtype auto` on CPU: bfloat16 when /proc/cpuinfo lists amx_bf16 or avx512_bf16 and oneDNN packs bfloat16
    here, float32 otherwise; the choice is stated on stderr. This machine first, then every case of the rule."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    flags = set(next((line for line in lines if line.startswith("flags")), "").split())
    native = bool({"amx_bf16", "avx512_bf16"} & flags) and dtype_packs(torch.bfloat16)
    expected = torch.bfloat16 if native else torch.float32
    assert cpu_auto_dtype()[0] == expected
    capsys.readouterr()
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    assert f"paged-backend: --dtype auto: {str(expected).removeprefix('torch.')} (" in capsys.readouterr().err
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32 and capsys.readouterr().err == ""
    for cpu_flags, packs, chosen in [
        ("flags : fpu avx512f amx_bf16 amx_tile", True, torch.bfloat16),
        ("flags : fpu avx512f avx512_bf16", True, torch.bfloat16),
        ("flags : fpu avx512f avx512_bf16", False, torch.float32),  # oneDNN cannot pack it: emulated
        ("flags : fpu avx2 avx512f avx512bw", True, torch.float32),  # no native bfloat16 arithmetic
    ]:
        monkeypatch.setattr(models, "cpu_signature", lambda cpu_flags=cpu_flags: cpu_flags)
        monkeypatch.setattr(models, "dtype_packs", lambda dtype, packs=packs: packs and dtype == torch.bfloat16)
        assert cpu_auto_dtype()[0] == chosen, (cpu_flags, packs)
        assert resolve_dtype("auto", torch.device("cpu")) == chosen
        assert f"--dtype auto: {str(chosen).removeprefix('torch.')} (" in capsys.readouterr().err


def test_model_object_without_tokenizer_is_rejected():
    with pytest.raises(InvalidRequest, match="tokenizer"):
        LLM(tiny_model())
