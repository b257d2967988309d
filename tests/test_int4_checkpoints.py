"""AWQ (GEMM) and GPTQ (with and without act-order) int4 checkpoints on CPU, built here with the formats' own
packing (tests/_int4_checkpoints.py): unpacked weights equal a dequantization written from the format definition,
the paged engine's greedy tokens equal HF generate on the dequantized model, repacked layers stay 4-bit in memory,
and GPU-only or malformed checkpoints are refused with a sentence.

The loads and engines compared with the float32 weights and HF generate ask for `dtype="float32"`: `--dtype auto`
is bfloat16 on CPUs with AMX or AVX512-BF16."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

from paged_backend.cli import app as cli_app
from paged_backend.engine import LLM, SamplingParams
from paged_backend.errors import InvalidRequest, UnsupportedModel
from paged_backend.worker.int4_formats import Int4Scheme
from paged_backend.worker.models import load_model
from tests._int4_checkpoints import AWQ_ORDER, SHAPE, build_checkpoint

NEW_TOKENS = 8
PROMPTS = [[5, 6, 7, 8, 9, 10], [20 + i for i in range(18)]]
GROUP_SIZE = 32
CASES = {
    "awq": dict(method="awq", seed=11, modules_to_not_convert=("down_proj",)),
    "gptq": dict(method="gptq", seed=12),
    # act-order groups are not consecutive channels, which the int4 kernel needs: this one is dequantized
    "gptq-act-order": dict(method="gptq", seed=13, desc_act=True, sym=True, tied=True),
}
LAYER = "model.layers.0.self_attn.k_proj"  # 128 -> 64: small enough to dequantize in plain Python


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (directory, the float32 weights it stands for)."""
    built = {}
    for case, options in CASES.items():
        path = tmp_path_factory.mktemp(case)
        built[case] = (str(path), build_checkpoint(path, group_size=GROUP_SIZE, **options))
    return built


def dequantize_by_definition(method: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """weight[o][i] = (q - z) * s, each nibble read from its packed word one at a time, as each format defines it."""
    qweight, qzeros, scales = (tensors[k].tolist() for k in ("qweight", "qzeros", "scales"))
    out_features = len(scales[0])
    in_features = len(qweight) if method == "awq" else 8 * len(qweight)
    g_idx = tensors["g_idx"].tolist() if method == "gptq" else [i // GROUP_SIZE for i in range(in_features)]
    weight = [[0.0] * in_features for _ in range(out_features)]
    for o in range(out_features):
        for i in range(in_features):
            g = g_idx[i]
            if method == "awq":  # qweight [in, out/8], qzeros [groups, out/8], columns interleaved within a word
                shift = 4 * AWQ_ORDER.index(o % 8)
                q, z = (qweight[i][o // 8] >> shift) & 0xF, (qzeros[g][o // 8] >> shift) & 0xF
            else:  # qweight [in/8, out] packs inputs; qzeros [groups, out/8] packs outputs; v1 stores zero - 1
                q = (qweight[i // 8][o] >> (4 * (i % 8))) & 0xF
                z = ((qzeros[g][o // 8] >> (4 * (o % 8))) & 0xF) + 1
            weight[o][i] = (q - z) * scales[g][o]
    return torch.tensor(weight, dtype=torch.float32)


def layer_tensors(path: str, layer: str) -> dict[str, torch.Tensor]:
    state = load_file(f"{path}/model.safetensors")
    return {name.removeprefix(f"{layer}."): t for name, t in state.items() if name.startswith(f"{layer}.")}


def dense_weight(module: torch.nn.Linear) -> torch.Tensor:
    """A layer's weight as its forward uses it: a repacked int4 weight read back through its own kernel."""
    weight = module.weight
    if type(weight.data) is torch.Tensor:
        return weight.data
    return torch.nn.functional.linear(torch.eye(module.in_features), weight).T


def hf_greedy(path: str, reference: dict[str, torch.Tensor]) -> list[list[int]]:
    """HF generate (DynamicCache, sdpa) on a plain model built from the checkpoint's config with its meaning loaded."""
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(reference, strict=True)
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False)[0, len(p) :].tolist()
            for p in PROMPTS
        ]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_unpacked_weights_equal_the_format_definition(checkpoints, case):
    path, reference = checkpoints[case]
    tensors = layer_tensors(path, LAYER)
    expected = dequantize_by_definition(CASES[case]["method"], tensors)
    assert torch.equal(expected, reference[f"{LAYER}.weight"])  # the builder packed what it meant
    saved = json.loads(open(f"{path}/config.json").read())["quantization_config"]
    unpacked = Int4Scheme.from_config(saved).unpack(LAYER, tensors, SHAPE["hidden_size"], expected.shape[0])
    assert torch.equal(unpacked.dequantize(torch.float32), expected)


@pytest.mark.parametrize("case", CASES)
def test_loaded_layers_compute_the_checkpoint_weights(checkpoints, case, capfd):
    path, reference = checkpoints[case]
    model, _ = load_model(path, device="cpu", dtype="float32")
    startup = capfd.readouterr().err
    repacks = not CASES[case].get("desc_act")
    assert ("repacked to torchao's CPU int4 layout" in startup) == repacks
    assert ("dequantized to float32 because their act-order groups" in startup) == (not repacks)
    for name, module in model.named_modules():  # each layer's forward multiplies by exactly the checkpoint's weight
        if isinstance(module, torch.nn.Linear):
            assert torch.equal(dense_weight(module), reference[f"{name}.weight"]), name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == bool(CASES[case].get("tied"))


@pytest.mark.parametrize("case", CASES)
def test_engine_matches_hf_generate_on_the_dequantized_model(checkpoints, case):
    path, reference = checkpoints[case]
    llm = LLM(path, device="cpu", dtype="float32", num_blocks=64, block_size=4)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(path, reference)


def test_repacked_weights_are_int4_in_memory(checkpoints):
    model, _ = load_model(checkpoints["awq"][0], device="cpu", dtype="float32")
    module = model.model.layers[0].mlp.up_proj  # 128 -> 256, groups of 32
    weight = module.weight.data
    assert type(weight).__name__ == "Int4OpaqueTensor"
    names, _ = weight.__tensor_flatten__()
    stored = sum(getattr(weight, n).numel() * getattr(weight, n).element_size() for n in names)
    int4_bytes, scale_and_zero_bytes = 128 * 256 // 2, (128 // GROUP_SIZE) * 256 * 2 * 4
    assert stored == int4_bytes + scale_and_zero_bytes  # 0.75 bytes a weight here, against 4 in float32
    assert type(model.model.layers[0].mlp.down_proj.weight.data) is torch.Tensor  # modules_to_not_convert


def test_run_command_serves_an_awq_checkpoint(checkpoints, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\n")
    args = ["run", "--model", checkpoints["awq"][0], "--device", "cpu", "--num-blocks", "32", "--max-tokens", "4",
            "--input", str(prompts)]  # fmt: skip
    result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 0, result.output


def rewritten(source: str, target, *, config_change: dict | None = None, drop: str | None = None) -> str:
    """A copy of a built checkpoint with its quantization_config changed or one tensor left out."""
    target.mkdir()
    config = json.loads(open(f"{source}/config.json").read())
    config["quantization_config"].update(config_change or {})
    (target / "config.json").write_text(json.dumps(config))
    state = load_file(f"{source}/model.safetensors")
    save_file({k: v for k, v in state.items() if k != drop}, str(target / "model.safetensors"))
    return str(target)


def test_gpu_only_and_malformed_checkpoints_are_refused_with_a_sentence(checkpoints, tmp_path):
    gptq, awq = checkpoints["gptq"][0], checkpoints["awq"][0]
    marlin = rewritten(gptq, tmp_path / "marlin", config_change={"checkpoint_format": "marlin"})
    with pytest.raises(UnsupportedModel, match="quantized with 'marlin' needs a CUDA GPU .* for Marlin kernels"):
        load_model(marlin, device="cpu")
    three_bit = rewritten(gptq, tmp_path / "bits", config_change={"bits": 3})
    with pytest.raises(UnsupportedModel, match="3-bit GPTQ; on CPU paged-backend loads 4-bit AWQ and GPTQ"):
        load_model(three_bit, device="cpu")
    gemv = rewritten(awq, tmp_path / "gemv", config_change={"version": "gemv"})
    with pytest.raises(UnsupportedModel, match="AWQ version 'gemv' packs its weights for a GPU kernel"):
        load_model(gemv, device="cpu")
    no_zeros = rewritten(awq, tmp_path / "no-zeros", drop=f"{LAYER}.qzeros")
    with pytest.raises(InvalidRequest, match=f"malformed: {LAYER} has qweight, scales but no qzeros"):
        load_model(no_zeros, device="cpu")
    with pytest.raises(InvalidRequest, match="quantized with 'awq' but quantization='gptq'"):
        load_model(awq, device="cpu", quantization="gptq")
