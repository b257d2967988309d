"""Which models the fused CPU forward takes, and that it gives transformers' forward's tokens and logprobs.

Greedy equality with HF generate on the fused path is also checked by every engine test on Llama, Qwen2, Qwen3 and
Mistral (test_engine_greedy.py, test_sliding_window.py, ...), which now run it by default."""

import zlib

import pytest
import torch
from _engine_helpers import MAX_TOKENS, hf_greedy, make_llm_fixture, ragged_prompts, reference_model  # noqa: F401
from _hf_models import tiny_model as hf_tiny_model
from torchao.quantization import quantize_

from paged_backend.engine import SamplingParams
from paged_backend.ops.decoder_layers import DecoderLayers
from paged_backend.worker.fused_forward import NATIVE_SWITCH, SWITCH, FusedForward
from paged_backend.worker.models import tiny_model
from paged_backend.worker.quantization import torchao_config

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)


def run(llm, prompts):
    outputs = llm.generate(prompts, GREEDY)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [
        [step[t] for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)] for o in outputs
    ]
    return tokens, torch.tensor(sum(logprobs, []))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_llama_family_runs_fused_and_equals_transformers_forward(arch, make_llm, monkeypatch):
    prompts = ragged_prompts(12, longest=30)
    fused = make_llm(arch, max_num_batched_tokens=32)  # chunked prefill beside decodes
    assert fused.engine.runner.fused is not None, fused.engine.runner.unfused_reason
    monkeypatch.setenv(SWITCH, "0")
    plain = make_llm(arch, max_num_batched_tokens=32)
    assert plain.engine.runner.fused is None and plain.engine.runner.unfused_reason == f"{SWITCH}=0"
    fused_tokens, fused_logprobs = run(fused, prompts)
    plain_tokens, plain_logprobs = run(plain, prompts)
    assert fused_tokens == plain_tokens == [hf_greedy(arch, p) for p in prompts]
    torch.testing.assert_close(fused_logprobs, plain_logprobs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("native", ["1", "0"])
def test_an_fp8_pool_runs_fused_and_equals_transformers_forward_over_it(cache_dtype, native, make_llm, monkeypatch):
    """The rotary kernel stores k / k_scale and v / v_scale as the pool's write does, and attention reads them back
    times the scales. With --calculate-kv-scales the first step runs transformers' forward, which hands the cache
    the keys the scales come from; the steps after it run fused, with those scales, in the C++ loop or in Python."""
    monkeypatch.setenv(NATIVE_SWITCH, native)
    prompts = ragged_prompts(8, longest=30)
    options = dict(cache_dtype=cache_dtype, calculate_kv_scales=True, max_num_batched_tokens=32)
    fused = make_llm("qwen2", **options)
    assert fused.engine.runner.fused is not None, fused.engine.runner.unfused_reason
    monkeypatch.setenv(SWITCH, "0")
    plain = make_llm("qwen2", **options)
    assert plain.engine.runner.fused is None
    fused_tokens, fused_logprobs = run(fused, prompts)
    plain_tokens, plain_logprobs = run(plain, prompts)
    assert fused.engine.kv_cache.k_scales == plain.engine.kv_cache.k_scales != [1.0] * 2  # the same calibration
    assert fused_tokens == plain_tokens
    torch.testing.assert_close(fused_logprobs, plain_logprobs, rtol=1e-4, atol=1e-5)


def test_an_fp8_pool_with_heads_wider_than_the_staging_buffer_runs_transformers_forward(make_llm):
    model = tiny_model("llama", hidden_size=1024, num_heads=1, num_kv_heads=1, intermediate_size=64)
    llm = make_llm(model=model, cache_dtype="fp8", num_blocks=16)
    assert llm.engine.runner.fused is None and llm.engine.runner.unfused_reason == "head_dim 1024 over 512 with an fp8 pool"
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids) == MAX_TOKENS


@pytest.mark.parametrize(
    "arch, overrides",
    [("smollm3", {}), ("phi3", {}), ("phi3", {"partial_rotary_factor": 0.5}), ("phi3", {"sliding_window": 6}),
     ("gemma3", {}), ("gemma3", {"final_logit_softcapping": 10.0}), ("gemma2", {"final_logit_softcapping": 10.0}),
     ("granite", {})],
    ids=["smollm3-nope-layer", "phi3-stacked-modules", "phi3-partial-rotary", "phi3-window", "gemma3",
         "gemma3-final-softcap", "gemma2-softcaps", "granite-multipliers"],
)
@torch.no_grad()
def test_other_llama_shaped_families_run_fused_and_equal_transformers_forward(arch, overrides, make_llm, monkeypatch):
    """SmolLM3 is Llama with no rotary on every n-th layer; Phi-3 keeps q|k|v and gate|up in one module each, and
    Phi-4-mini rotates only the leading dims of a head. Gemma 3 norms each branch's output too, with its own kind of
    norm, uses GELU-tanh, per-head q/k norms and two rotary bases (local, global layers). The fused forward gives
    transformers' tokens on each. Gemma 2 also soft-caps its attention scores (its tiny model's cap is 5); Granite
    multiplies its embeddings, each branch's output and its logits."""
    model = hf_tiny_model(arch, seed=5, attn_implementation="eager" if arch == "gemma2" else "sdpa", **overrides)
    _distinct_norms(model)
    prompts = [[token % 120 + 3 for token in prompt] for prompt in ragged_prompts(8, seed=2, longest=30)]
    fused = make_llm(model=model, max_num_batched_tokens=32)
    assert fused.engine.runner.fused is not None, fused.engine.runner.unfused_reason
    monkeypatch.setenv(SWITCH, "0")
    fused_tokens, fused_logprobs = run(fused, prompts)
    plain_tokens, plain_logprobs = run(make_llm(model=model, max_num_batched_tokens=32), prompts)
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False)
        expected.append(out[0, len(prompt) :].tolist())
    assert fused_tokens == plain_tokens == expected
    torch.testing.assert_close(fused_logprobs, plain_logprobs, rtol=1e-4, atol=1e-5)


def test_smollm3_tiny_model_has_a_nope_layer():
    assert [layer.self_attn.use_rope for layer in hf_tiny_model("smollm3").model.layers] == [1, 0]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_fused_forward_equals_transformers_forward(arch, make_llm, monkeypatch):
    model = tiny_model(arch, seed=7, hidden_size=128, intermediate_size=256, dtype=torch.bfloat16)
    prompts = ragged_prompts(8, seed=3, longest=24)
    fused = make_llm(model=model)
    assert fused.engine.runner.fused is not None
    monkeypatch.setenv(SWITCH, "0")
    fused_tokens, fused_logprobs = run(fused, prompts)
    plain_tokens, plain_logprobs = run(make_llm(model=model), prompts)
    # the kernels round every bf16 op as torch does; summation order can still move a logprob by a bf16 ulp
    assert fused_tokens == plain_tokens
    torch.testing.assert_close(fused_logprobs, plain_logprobs, rtol=0.05, atol=0.05)


def test_a_hooked_layer_runs_transformers_forward_and_says_why(make_llm):
    model = tiny_model("llama", seed=7)
    seen = []
    model.model.layers[1].mlp.register_forward_hook(lambda module, args, output: seen.append(output.shape))
    llm = make_llm(model=model)
    assert llm.engine.runner.fused is None and "hooks" in llm.engine.runner.unfused_reason
    prompt = ragged_prompts(1, seed=5)[0]
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_greedy("llama", prompt)
    assert seen  # the caller's hook ran, as it would under transformers


def test_gemma3_attention_softcapping_keeps_transformers_forward(make_llm):
    llm = make_llm(model=hf_tiny_model("gemma3", seed=7, attn_logit_softcapping=20.0))
    assert llm.engine.runner.fused is None and "softcapping" in llm.engine.runner.unfused_reason


def test_other_architectures_name_themselves_as_the_reason(make_llm):
    llm = make_llm(model=hf_tiny_model("gpt2", seed=7))
    assert llm.engine.runner.fused is None
    assert "GPT2LMHeadModel is not one of" in llm.engine.runner.unfused_reason


def test_a_hooked_head_norm_runs_transformers_forward(make_llm):
    """Qwen3's q/k norms are modules the fused forward bypasses too: a hook on one keeps transformers' forward."""
    model = tiny_model("qwen3", seed=7)
    model.model.layers[0].self_attn.k_norm.register_forward_hook(lambda module, args, output: None)
    llm = make_llm("qwen3", model=model)
    assert llm.engine.runner.fused is None and "hooks" in llm.engine.runner.unfused_reason


def test_a_torch_attention_backend_keeps_the_oracle_path(make_llm):
    llm = make_llm(attention_backend="torch")
    assert llm.engine.runner.fused is None and "attention backend" in llm.engine.runner.unfused_reason


@pytest.mark.parametrize(
    "arch, overrides, dtype",
    [
        ("llama", {}, torch.float32),
        ("llama", {}, torch.bfloat16),
        ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1), torch.float32),  # 2 groups
        ("mistral", {}, torch.bfloat16),  # a window of 6
        ("qwen3", {}, torch.bfloat16),  # per-head q/k norms
        ("qwen3", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1), torch.float32),
        ("smollm3", {}, torch.bfloat16),  # a NoPE layer
        ("phi3", {"partial_rotary_factor": 0.5}, torch.bfloat16),  # stacked modules, partial rotary
        ("gemma3", {}, torch.bfloat16),  # sandwich norms, GELU-tanh, two rotary bases, windowed layers
        ("gemma2", {}, torch.float32),  # attention softcapping, windowed layers
        ("granite", {}, torch.bfloat16),  # multipliers
    ],
    ids=["llama-fp32", "llama-bf16", "qwen2-windowed-layer", "mistral-window-bf16", "qwen3-bf16",
         "qwen3-windowed-layer", "smollm3-nope-bf16", "phi3-partial-rotary-bf16", "gemma3-bf16",
         "gemma2-softcaps", "granite-bf16"],
)
def test_the_native_layer_loop_equals_the_python_loop_bitwise(arch, overrides, dtype, make_llm, monkeypatch):
    """csrc/cpu/decoder_layers_cpu.cpp calls the Python loop's kernels in its order: same tokens, same logprobs
    to the bit, over chunked prefills beside decodes, biases (Qwen2), q/k norms (Qwen3), NoPE layers (SmolLM3),
    stacked modules and partial rotary (Phi-3), windows and per-layer window groups."""
    model = hf_tiny_model(arch, seed=3, attn_implementation="eager" if arch == "gemma2" else "sdpa", **overrides)
    model = model.to(dtype)
    _distinct_norms(model)
    _native_equals_python(model, make_llm, monkeypatch)


@pytest.mark.parametrize(
    "arch, dtype, scheme, bits",
    [("llama", torch.bfloat16, "int8_weight_only", 8), ("qwen2", torch.float32, "int8_weight_only", 8),
     ("llama", torch.float32, "int4_weight_only", 4), ("qwen2", torch.bfloat16, "int4_weight_only", 4)],
)  # fmt: skip
def test_weight_only_layers_run_on_quantized_panels_in_both_loops_bitwise(arch, dtype, scheme, bits, make_llm,
                                                                         monkeypatch):  # fmt: skip
    """torchao's int8 and int4 weight-only layers pack into int8 / int4 panels: the native loop and the Python loop
    give the same bits, and a layer's outputs equal torchao's own forward (its dequantized weight) up to summation
    order."""
    model = hf_tiny_model(arch, seed=3).to(dtype)
    _distinct_norms(model)
    reference = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, reference.in_features).to(dtype)
    quantize_(model, torchao_config(scheme, torch.device("cpu")))
    expected = reference(x)  # torchao's forward: x times its dequantized weight
    llm = _native_equals_python(model, make_llm, monkeypatch)
    forward = llm.engine.runner.packed.layers[llm.engine.model.model.layers[0].mlp.down_proj][0]
    assert forward.panel.bits == bits and forward.panel.scales is not None
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(forward(x).float(), expected.float(), **tolerance)


def _native_equals_python(model, make_llm, monkeypatch):
    """The native loop ran every step, and the Python loop gave the same tokens and logprobs; the last LLM."""
    prompts = [[token % 120 + 3 for token in prompt] for prompt in ragged_prompts(12, seed=4, longest=30)]
    loops = []
    native_call = DecoderLayers.__call__
    monkeypatch.setattr(DecoderLayers, "__call__", lambda self, *args: loops.append(1) or native_call(self, *args))
    native_tokens, native_logprobs = run(make_llm(model=model, max_num_batched_tokens=32), prompts)
    native_steps = len(loops)
    monkeypatch.setenv(NATIVE_SWITCH, "0")
    llm = make_llm(model=model, max_num_batched_tokens=32)
    python_tokens, python_logprobs = run(llm, prompts)
    assert native_steps > MAX_TOKENS and len(loops) == native_steps  # every step went native, then none did
    assert native_tokens == python_tokens
    assert torch.equal(native_logprobs, python_logprobs)
    return llm


@torch.no_grad()
def _distinct_norms(model) -> None:
    """Norms start at ones (Gemma's at zeros): make each its own, so a swapped or skipped norm shows."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def test_calls_are_built_once_and_again_after_a_weight_or_hook_changes(make_llm, monkeypatch):
    """A step reuses the layer calls and the native loop until a layer is repacked (a weight written in place) or
    the pool is replaced; the next step then runs the new weights, and a hook added later runs too."""
    builds = []
    build = FusedForward._build_calls
    monkeypatch.setattr(FusedForward, "_build_calls", lambda self, native: builds.append(1) or build(self, native))
    llm = make_llm(model=tiny_model("llama", seed=7))
    model = llm.engine.runner.fused.model  # the engine's copy, which it packed
    prompts = ragged_prompts(4, seed=6, longest=20)
    before, _ = run(llm, prompts)
    assert len(builds) == 1  # every step of that run reused the first build
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(-1.0)
    changed_tokens, changed_logprobs = run(llm, prompts)
    assert len(builds) == 2
    fresh_tokens, fresh_logprobs = run(make_llm(model=model), prompts)
    assert changed_tokens == fresh_tokens != before
    assert torch.equal(changed_logprobs, fresh_logprobs)
    seen = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda module, args, output: seen.append(1))
    assert run(llm, prompts)[0] == fresh_tokens and seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [None, {"rope_type": "dynamic", "factor": 2.0}], ids=["table", "dynamic"])
def test_rotary_rows_are_the_rotary_modules_bits(dtype, rope, make_llm):
    """cos/sin come from a table by position, grown as positions pass its end, with the bits the model's rotary module
    gives for those positions; a rope that changes with the length is computed per step instead."""
    overrides = {} if rope is None else {"rope_scaling": rope, "max_position_embeddings": 64}
    fused = make_llm(model=hf_tiny_model("llama", seed=7, **overrides).to(dtype)).engine.runner.fused
    rotary, x = fused.base.rotary_emb, torch.zeros(1, 1, 8, dtype=dtype)
    for positions in ([[0, 1, 2]], [[4095]], [[17, 5000, 9000, 3]], [[12000]]):
        positions = torch.tensor(positions)
        expected = [t[0] for t in rotary(x, positions)]
        got = fused._rotary(x, positions)[None]  # one kind of layer
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert (not fused._rotary_tables) == (rope is not None)
    if rope is None:
        assert fused._rotary_tables[None][0].shape[0] >= 12001


def test_the_native_loop_refuses_a_slot_past_the_pool(make_llm):
    """The C++ loop's rotary + cache write checks each slot against the pool it was told of, as a direct call does:
    told of a one-block pool, the step's slots past block 0 are refused instead of written past it."""
    llm = make_llm(model=tiny_model("llama", seed=7))
    fused = llm.engine.runner.fused
    assert run(llm, [[5] * 40])[0]  # the native loop runs and writes its slots
    fused.kv_cache.num_blocks = 1  # what the struct says, not the pool: slots of block 1 on are now "past" it
    with pytest.raises(RuntimeError, match="decoder layer loop failed: .*a slot in slot_mapping lies past"):
        llm.generate([[6] * 40], GREEDY)


def test_a_bad_head_dim_is_refused_with_the_kernels_words():
    """The loop checks its shapes before any kernel runs (a zero head_dim would divide by zero)."""
    loop = DecoderLayers.__new__(DecoderLayers)
    loop.layers, loop.groups, loop.dtype = (), [], torch.float32
    loop.q_size, loop.kv_size, loop.head_dim, loop.hidden, loop.intermediate = 64, 32, 0, 64, 128
    rows = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="decoder layer loop failed: bad shape .*even head_dim"):
        loop(rows, rows.clone(), [], [], [])
