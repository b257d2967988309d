"""A GGUF model's Q4_0/Q4_1/Q8_0 linear weights run on int4/int8 panels packed from their own blocks (`gguf_blocks`):
the same values as the float32 weights transformers dequantizes, so the engine's tokens equal HF generate on them,
and its logprobs equal the engine's on float panels of the same model bit for bit (float32 and bfloat16), from a
fifth to a quarter of the bytes. A block that does not give its weight's value is not used, nor one whose weight
changed since it was loaded."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="GGUF support needs the gguf package: pip install 'paged-backend[gguf]'")

from paged_backend.engine import LLM, SamplingParams  # noqa: E402
from paged_backend.worker import gguf_blocks, gguf_source  # noqa: E402
from paged_backend.worker.default_model import INSTALL_HINT, default_model_file  # noqa: E402
from paged_backend.worker.models import byte_tokenizer, load_model  # noqa: E402
from paged_backend.worker.packed_linear import panels_build  # noqa: E402
from tests._gguf_files import requantize, tiny_file  # noqa: E402
from tests._gguf_tiny import tiny_llama_gguf  # noqa: E402

pytestmark = pytest.mark.skipif(not panels_build(), reason="the panel kernel (csrc/cpu) does not build here")

PROMPTS = [[5, 6, 7, 8, 9, 10], [20 + i for i in range(18)]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.F32.gguf"
    tiny_llama_gguf(path, seed=5)
    return path


@pytest.fixture(scope="module", params=list(BITS))
def copy(request, tiny, tmp_path_factory):
    """The tiny Llama requantized as Q4_0, Q4_1 or Q8_0 (every linear weight: rows of 64 and 128 weights)."""
    qtype = request.param
    path = requantize(tiny, tmp_path_factory.mktemp(qtype) / f"tiny-llama.{qtype}.gguf",
                      getattr(gguf.GGMLQuantizationType, qtype))  # fmt: skip
    return qtype, path


def panels(llm: LLM) -> dict:
    return {module: forward.panel for module, (forward, _) in llm.engine.runner.packed.layers.items()}


def run(llm: LLM) -> list[tuple[list[int], list]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def hf_greedy(model, prompt: list[int], new_tokens: int = 8) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_runs_the_blocks_and_gives_the_float_weights_tokens_and_logprobs(copy, dtype):
    qtype, path = copy
    llm = LLM(str(path), device="cpu", dtype=dtype, num_blocks=32, block_size=4)
    held = panels(llm)
    quantized = [panel for panel in held.values() if panel.scales is not None]
    stored = [t for t in gguf.GGUFReader(path).tensors if t.tensor_type.name == qtype and len(t.shape) == 2]
    assert len(quantized) == len(held) == len(stored) - 1  # every linear weight; the embedding is no linear layer
    assert all(panel.bits == BITS[qtype] and panel.group_size == 32 for panel in quantized)
    ours = run(llm)
    # The same weights as float panels: the model object loaded from the conversion, which carries no blocks.
    model, _ = load_model(str(gguf_source.cache_entry(path)), device="cpu", dtype=dtype)
    float_llm = LLM(model, tokenizer=byte_tokenizer(), device="cpu", num_blocks=32, block_size=4)
    assert all(panel.scales is None for panel in panels(float_llm).values())
    assert ours == run(float_llm)  # tokens and logprobs, bit for bit
    if dtype == "float32":
        assert [tokens for tokens, _ in ours] == [hf_greedy(model, p) for p in PROMPTS]
    float_bytes = sum(panel.packed.nbytes for panel in panels(float_llm).values())
    block_bytes = sum(panel.packed.nbytes + panel.scales.nbytes for panel in quantized)
    # int4: 4 bits and 2 x 32 float32 bits per 32 weights; int8: 8 and 32 (a fifth or a third of float32's bytes)
    float_bits = 32 if dtype == "float32" else 16
    assert block_bytes / float_bytes == pytest.approx((6 if BITS[qtype] == 4 else 9) / float_bits, rel=0.02)
    for engine in (llm.engine, float_llm.engine):
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - 1


def test_blocks_that_do_not_give_the_loaded_weight_are_not_used(copy, capsys):
    qtype, path = copy
    LLM(str(path), device="cpu", dtype="float32", num_blocks=8, block_size=4)  # converts once
    entry = gguf_source.cache_entry(path)
    model, _ = load_model(str(entry), device="cpu", dtype="float32")  # the directory: no blocks attached
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    assert not any(gguf_blocks.source_of(module.weight) for module in linears)
    every = len(linears)  # q, k, v, o, gate, up and down per layer, and the LM head
    assert gguf_blocks.attach(model, entry) == f"{every} linear weights run on their GGUF blocks ({every} {qtype})"
    for module in linears:
        gguf_blocks.drop(module.weight)
    layer = model.model.layers[0]
    with torch.no_grad():
        layer.self_attn.q_proj.weight.data[0, 0] += 1.0  # another value than its blocks give
    capsys.readouterr()
    assert gguf_blocks.attach(model, entry) == f"{every - 1} linear weights run on their GGUF blocks ({every - 1} {qtype})"
    assert "1 saved GGUF block tensors do not give the loaded weights" in capsys.readouterr().err
    assert gguf_blocks.source_of(layer.self_attn.q_proj.weight) is None
    with torch.no_grad():
        layer.mlp.up_proj.weight.mul_(1.0)  # an in-place write moves the version: the blocks no longer count
    assert gguf_blocks.source_of(layer.mlp.up_proj.weight) is None
    gate = layer.mlp.gate_proj.weight
    gate.data = gate.data[: gate.shape[0] // 2].clone()  # a shard of it under the same object (tensor parallelism)
    assert gguf_blocks.source_of(gate) is None
    assert gguf_blocks.source_of(layer.mlp.down_proj.weight) is not None


def test_blocks_are_kept_only_where_panels_run_them(copy):
    """float16 has no panels: no blocks are attached. With packing off, the engine frees the blocks it got."""
    _, path = copy
    model, _ = load_model(str(path), device="cpu", dtype="float16")
    assert not any(hasattr(weight, "gguf_blocks") for weight in model.parameters())
    llm = LLM(str(path), device="cpu", dtype="float32", num_blocks=8, block_size=4, prepack_weights=False)
    assert llm.engine.runner.packed is None
    assert not any(hasattr(weight, "gguf_blocks") for weight in llm.engine.model.parameters())


def test_k_quant_layers_q4_k_and_q6_k_run_on_the_panels_and_equal_hf_generate(tmp_path):
    """llama.cpp's Q4_K_M mix: Q4_K (groups of 32 with six-bit scales and minimums under a float16 pair) on int4
    panels, Q6_K (groups of 16, six-bit signed values) on int8 panels; rows of 264 weights stay float32."""
    q4_k, q6_k = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    types = {f"blk.0.{name}.weight": q4_k for name in ("attn_q", "attn_k", "attn_output", "ffn_gate")}
    types |= {"blk.0.attn_v.weight": q6_k, "blk.0.ffn_up.weight": q6_k}
    path = tiny_file(tmp_path / "tiny.Q4_K_M.gguf", types=types)
    llm = LLM(str(path), device="cpu", dtype="float32", num_blocks=16, block_size=4)
    layer = llm.engine.model.model.layers[0]
    held = panels(llm)
    expected = {"q_proj": (4, 32), "k_proj": (4, 32), "v_proj": (8, 16), "o_proj": (4, 32)}
    for name, kind in expected.items():
        panel = held[getattr(layer.self_attn, name)]
        assert (panel.bits, panel.group_size) == kind, name
    assert (held[layer.mlp.gate_proj].bits, held[layer.mlp.up_proj].bits) == (4, 8)
    assert held[layer.mlp.down_proj].scales is None  # float32 in the file
    prompts = [[2, 3, 4, 5], [6, 7, 2, 3, 4, 5, 6]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    model, _ = load_model(str(gguf_source.cache_entry(path)), device="cpu", dtype="float32")
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(model, p) for p in prompts]


# llama.cpp's mixes. Q4_K_M on rows that are a multiple of 256: Q4_K with a Q6_K v and down (q|k|v then do not
# stack). On rows that are not (SmolLM2's 576) the K-quants fall back: Q4_K_M makes q, k, o, gate and up Q5_0, v Q5_0
# or Q8_0; Q5_K_M the same with Q5_1; Q3_K_M Q4_0 q, k, gate and up beside a Q5_0 v and o. Each mix here has every
# kind it names in one layer.
MIXES = {
    "q4_k_m": {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
               "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    "q4_k_m-576": {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q5_0",
                   "ffn_up": "Q5_0", "ffn_down": "Q4_K"},
    "q5_k_m": {"attn_q": "Q5_K", "attn_k": "Q5_1", "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q5_1",
               "ffn_up": "Q5_0", "ffn_down": "Q6_K"},
    "q3_k_m": {"attn_q": "Q2_K", "attn_k": "Q3_K", "attn_v": "Q5_0", "attn_output": "Q4_K", "ffn_gate": "Q4_0",
               "ffn_up": "Q5_1", "ffn_down": "Q5_K"},
    "iq4_xs": {"attn_q": "IQ4_XS", "attn_k": "IQ4_XS", "attn_v": "IQ4_NL", "attn_output": "IQ4_XS",
               "ffn_gate": "IQ4_XS", "ffn_up": "IQ4_XS", "ffn_down": "IQ4_NL"},
}  # fmt: skip
KINDS = {"Q5_K": (8, 32, True), "Q5_1": (8, 32, True), "Q5_0": (8, 32, False), "Q8_0": (8, 32, False),
         "Q6_K": (8, 16, False), "Q2_K": (4, 16, True), "Q3_K": (4, 16, True), "Q4_K": (4, 32, True),
         "Q4_0": (4, 32, True), "IQ4_NL": (4, 32, False), "IQ4_XS": (4, 32, False)}  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_mixed_layers_run_in_the_native_loop_with_the_float_weights_bits(mix, dtype, tmp_path, monkeypatch):
    """Each weight on its own kind of panel (Q5_0/Q5_1/Q5_K on int8 with or without offsets, Q2_K/Q3_K on int4,
    groups of 16 or 32, IQ4's indices on int4 panels that read its 16 non-uniform levels); q|k|v and gate|up stack
    when their bits agree (the finest group, offsets for all), else go side by side; one layer mixing them all runs
    in the C++ layer loop. Tokens and logprobs are the float panels' bit for bit, and HF's greedy tokens in float32."""
    from paged_backend.ops.decoder_layers import DecoderLayers

    types = {f"blk.0.{name}.weight": getattr(gguf.GGMLQuantizationType, kind) for name, kind in MIXES[mix].items()}
    path = tiny_file(tmp_path / f"tiny.{mix}.gguf", types=types, feed_forward=256)
    loops = []
    native_call = DecoderLayers.__call__
    monkeypatch.setattr(DecoderLayers, "__call__", lambda self, *args: loops.append(1) or native_call(self, *args))
    llm = LLM(str(path), device="cpu", dtype=dtype, num_blocks=16, block_size=4)
    prompts = [[2, 3, 4, 5], [6, 7, 2, 3, 4, 5, 6]]
    sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)

    def generate(engine_llm):
        outputs = engine_llm.generate([{"prompt_token_ids": p} for p in prompts], sampling)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

    ours = generate(llm)
    assert len(loops) >= 8  # every step in the C++ loop
    layer, held = llm.engine.model.model.layers[0], panels(llm)  # (stacked at the first step)
    modules = {"attn_q": layer.self_attn.q_proj, "attn_k": layer.self_attn.k_proj, "attn_v": layer.self_attn.v_proj,
               "attn_output": layer.self_attn.o_proj, "ffn_gate": layer.mlp.gate_proj, "ffn_up": layer.mlp.up_proj,
               "ffn_down": layer.mlp.down_proj}  # fmt: skip
    bits = {name: KINDS[kind][0] for name, kind in MIXES[mix].items()}
    for name, kind in MIXES[mix].items():
        panel = held[modules[name]]
        stacked_with = [other for other in (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up")) if name in other]
        if stacked_with and len({bits[other] for other in stacked_with[0]}) == 1:  # regrouped to the finest
            group = min(KINDS[MIXES[mix][other]][1] for other in stacked_with[0])
            offsets = any(KINDS[MIXES[mix][other]][2] for other in stacked_with[0])
            assert (panel.bits, panel.group_size, panel.offsets) == (KINDS[kind][0], group, offsets), name
        else:
            assert (panel.bits, panel.group_size, panel.offsets) == KINDS[kind], name
    model, _ = load_model(str(gguf_source.cache_entry(path)), device="cpu", dtype=dtype)
    float_llm = LLM(model, tokenizer=byte_tokenizer(), device="cpu", num_blocks=16, block_size=4)
    assert all(panel.scales is None for panel in panels(float_llm).values())
    assert ours == generate(float_llm)
    if dtype == "float32":
        assert [tokens for tokens, _ in ours] == [hf_argmax(model, p) for p in prompts]


@torch.no_grad()
def hf_argmax(model, prompt: list[int], new_tokens: int = 8) -> list[int]:
    """Greedy tokens from HF's forward, past EOS as `ignore_eos` goes (HF generate's min_new_tokens bans EOS
    instead, and the IQ4 file's first prompt meets EOS as its argmax)."""
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.skipif(default_model_file() is None, reason=f"the default model is not installed ({INSTALL_HINT})")
def test_the_default_model_runs_its_q4_1_layers_and_q8_0_head_as_they_ship():
    """SmolLM2's file: 210 Q4_1 linear weights and a Q8_0 embedding, tied to the LM head: the embedding's rows come
    from the head's int8 panels, and no float copy of the matrix stays."""
    llm = LLM(device="cpu", dtype="float32", num_blocks=16)
    held = panels(llm)
    bits = sorted(panel.bits for panel in held.values())
    assert bits == [4] * 210 + [8] and all(panel.group_size == 32 for panel in held.values())
    head = held[llm.engine.model.lm_head]
    assert head.bits == 8 and head.out_features == llm.engine.model.config.vocab_size
    assert llm.engine.model.model.embed_tokens.weight.numel() == 0 and llm.engine.runner.fused is not None
    assert sum(p.numel() for p in llm.engine.model.parameters()) < 100_000  # the norms alone
