"""GGUF files as --model: exact weights and greedy tokens (a seeded tiny Llama written as llama.cpp writes it, and
Q8_0 / F16 copies of the real model against HF generate), the conversion cache (hit, damaged entry rebuilt), and
clear refusals for truncated, foreign, incomplete and unsupported files.

Engines and loads compared with float32 values (the HF model, gguf's dequantization, HF generate) ask for
`dtype="float32"`: `--dtype auto` is bfloat16 on CPUs with AMX or AVX512-BF16."""

from __future__ import annotations

import shutil

import pytest
import torch
from typer.testing import CliRunner

gguf = pytest.importorskip("gguf", reason="GGUF support needs the gguf package: pip install 'paged-backend[gguf]'")

from paged_backend.cli import app as cli_app  # noqa: E402
from paged_backend.engine import LLM, SamplingParams  # noqa: E402
from paged_backend.engine.chat_template import render_chat  # noqa: E402
from paged_backend.errors import InvalidRequest, UnsupportedModel  # noqa: E402
from paged_backend.worker import gguf_source  # noqa: E402
from paged_backend.worker.default_model import INSTALL_HINT, default_model_file  # noqa: E402
from paged_backend.worker.models import byte_tokenizer, load_model  # noqa: E402
from tests._gguf_files import requantize, truncated, with_architecture, with_unsupported_tensor  # noqa: E402
from tests._gguf_tiny import tiny_llama_gguf  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10], [20 + i for i in range(18)]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path of the tiny Llama's GGUF file, the HF model it was written from)."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.F32.gguf"
    return path, tiny_llama_gguf(path, seed=7)


def hf_greedy(model, prompt: list[int], new_tokens: int = 8) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_a_gguf_file_loads_the_exact_weights_and_tokenizer_it_holds(tiny):
    path, reference = tiny
    model, tokenizer = load_model(str(path), device="cpu", dtype="float32")
    loaded, expected = model.state_dict(), reference.state_dict()
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
    text = "héllo <|eos|>"
    assert tokenizer(text).input_ids == byte_tokenizer()(text).input_ids
    assert tokenizer.chat_template == byte_tokenizer().chat_template


@pytest.mark.parametrize("as_directory", [False, True])
def test_engine_on_a_gguf_file_equals_hf_generate(tiny, as_directory):
    path, reference = tiny
    llm = LLM(str(path.parent if as_directory else path), device="cpu", dtype="float32", num_blocks=32, block_size=4)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p) for p in PROMPTS]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks - 1


def test_a_qwen3_gguf_file_runs_the_fused_forward_and_equals_hf_generate(tmp_path):
    """Qwen3's GGUF export (per-head q/k norms, no q/k permutation) loads through transformers' reader and runs on
    the fused CPU forward."""
    path = tmp_path / "tiny-qwen3.F32.gguf"
    reference = tiny_llama_gguf(path, seed=3, arch="qwen3")
    llm = LLM(str(path), device="cpu", dtype="float32", num_blocks=32, block_size=4)
    assert type(llm.engine.runner.model).__name__ == "Qwen3ForCausalLM"
    assert llm.engine.runner.fused is not None, llm.engine.runner.unfused_reason
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p) for p in PROMPTS]


@pytest.mark.parametrize("qtype", ["Q8_0", "F16"])
def test_other_tensor_types_load_gguf_s_own_dequantization_and_equal_hf_generate(tiny, tmp_path, qtype):
    path, reference = tiny
    copy = requantize(path, tmp_path / f"tiny-llama.{qtype}.gguf", getattr(gguf.GGMLQuantizationType, qtype))
    llm = LLM(str(copy), device="cpu", dtype="float32", num_blocks=32, block_size=4)
    [embedding] = [t for t in gguf.GGUFReader(copy).tensors if t.name == "token_embd.weight"]
    assert embedding.tensor_type.name == qtype
    values = torch.from_numpy(gguf.dequantize(embedding.data, embedding.tensor_type))
    assert torch.equal(llm.engine.model.get_input_embeddings().weight, values)
    assert not torch.equal(values, reference.get_input_embeddings().weight)  # requantized: not the F32 values
    converted = gguf_source.cache_entry(copy)
    model, _ = load_model(str(converted), device="cpu", dtype="float32")  # HF on the converted weights
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p) for p in PROMPTS]


def test_the_tokenizer_flag_overrides_the_files_tokenizer(tiny, tmp_path):
    path, _ = tiny
    other = byte_tokenizer()
    other.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    other.save_pretrained(tmp_path / "tokenizer")
    _, tokenizer = load_model(str(path), tokenizer=str(tmp_path / "tokenizer"), device="cpu")
    assert tokenizer.chat_template == other.chat_template


def test_the_second_start_loads_from_the_cache_and_a_damaged_entry_is_rebuilt(tiny, capsys):
    path, reference = tiny
    entry = gguf_source.cache_entry(path)
    shutil.rmtree(entry, ignore_errors=True)
    older = entry.with_name(entry.name.rsplit("-v", 1)[0] + "-v1")  # an entry of an older cache format
    (older / "model.safetensors").parent.mkdir(parents=True, exist_ok=True)
    (older / "model.safetensors").write_bytes(b"old")
    load_model(str(path), device="cpu")
    assert "converting tiny-llama.F32.gguf once" in capsys.readouterr().err
    assert not older.exists()  # replaced, not left to take disk
    load_model(str(path), device="cpu")
    assert "converting" not in capsys.readouterr().err  # the cache answered
    weights = entry / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside a tensor: safetensors itself would not notice
    weights.write_bytes(bytes(data))
    model, _ = load_model(str(path), device="cpu", dtype="float32")
    assert "damaged; rebuilding" in capsys.readouterr().err
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(),
                                                 strict=True))  # fmt: skip
    (entry / "manifest.json").write_text("{not json")
    load_model(str(path), device="cpu")
    assert "damaged; rebuilding" in capsys.readouterr().err


def test_truncated_foreign_and_missing_files_are_refused_clearly(tiny, tmp_path):
    path, _ = tiny
    with pytest.raises(InvalidRequest, match="truncated or corrupt"):
        load_model(str(truncated(path, tmp_path / "cut.gguf")), device="cpu")
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(InvalidRequest, match="is not a GGUF file"):
        load_model(str(tmp_path / "text.gguf"), device="cpu")
    with pytest.raises(InvalidRequest, match="no such .gguf file"):
        load_model(str(tmp_path / "absent.gguf"), device="cpu")
    shutil.copy(path, tmp_path / "second.gguf")
    with pytest.raises(InvalidRequest, match="several GGUF files"):
        load_model(str(tmp_path), device="cpu")


def test_unsupported_architectures_tensor_types_and_incomplete_files_are_named(tmp_path):
    with pytest.raises(UnsupportedModel, match="rwkv6"):
        load_model(str(with_architecture(None, tmp_path / "rwkv6.gguf", "rwkv6")), device="cpu")
    with pytest.raises(InvalidRequest, match="no tensors for .* mamba model's weights"):  # llama tensors, mamba label
        load_model(str(with_architecture(None, tmp_path / "mamba.gguf", "mamba")), device="cpu")
    with pytest.raises(UnsupportedModel, match=r"Q8_K|Q8_1"):
        load_model(str(with_unsupported_tensor(tmp_path / "q8k.gguf")), device="cpu")


def test_run_reports_a_bad_gguf_file_without_a_traceback(tiny, tmp_path):
    path, _ = tiny
    cut = truncated(path, tmp_path / "cut.gguf")
    result = CliRunner().invoke(cli_app, ["run", "--model", str(cut), "--no-progress"], input="Hello\n")
    assert result.exit_code == 2 and "truncated or corrupt" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.skipif(default_model_file() is None, reason=f"the default model is not installed ({INSTALL_HINT})")
@pytest.mark.parametrize("qtype, as_directory", [("Q8_0", True)])  # F16: the tiny file's test above (time)
def test_other_quant_types_of_the_real_model_load_their_own_values_and_equal_hf_generate(tmp_path, qtype, as_directory):
    """Q8_0 and F16 copies of the shipped Q4_1 file. The conversion is transformers' own GGUF load (its exact
    round trip through the cache is the tiny file's test above), so HF generate runs on the converted weights."""
    from transformers import AutoModelForCausalLM

    path = requantize(default_model_file(), tmp_path / f"SmolLM2-135M-Instruct.{qtype}.gguf",
                      getattr(gguf.GGMLQuantizationType, qtype))  # fmt: skip
    try:
        llm = LLM(str(tmp_path if as_directory else path), device="cpu", dtype="float32", num_blocks=32)
        [embedding] = [t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight"]
        assert embedding.tensor_type.name == qtype  # the engine's embedding is this file's, dequantized by gguf
        values = gguf.dequantize(embedding.data, embedding.tensor_type)
        every_id = torch.arange(values.shape[0])  # (the tied embedding reads its rows from the head's panels)
        with torch.no_grad():
            assert torch.equal(llm.engine.model.get_input_embeddings()(every_id), torch.from_numpy(values))
        ids = render_chat(llm.engine.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
        [output] = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=16))
        reference = AutoModelForCausalLM.from_pretrained(str(gguf_source.cache_entry(path)), dtype=torch.float32)
        with torch.no_grad():
            expected = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
        assert output.outputs[0].token_ids == expected.tolist() and "Paris" in output.outputs[0].text
    finally:
        shutil.rmtree(gguf_source.cache_entry(path), ignore_errors=True)  # 540 MB each: not left in the cache
