"""Tiny seeded models of architectures beyond the core set, for the architecture sweep (hidden 64, 2 layers)."""

from __future__ import annotations

import torch
import transformers

VOCAB, EOS = 256, 254
_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    eos_token_id=EOS,
    bos_token_id=253,
    pad_token_id=255,
    tie_word_embeddings=False,
)
_GQA = dict(num_key_value_heads=2)
# Architecture -> (class name prefix, config overrides: GQA where the architecture has it, names it spells differently).
SWEEP = {
    "olmo2": ("Olmo2", _GQA),
    "granite": ("Granite", _GQA),
    "starcoder2": ("Starcoder2", {**_GQA, "sliding_window": None}),
    "gpt_neox": ("GPTNeoX", {}),
    "falcon": ("Falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    "qwen3_moe": (
        "Qwen3Moe",
        {**_GQA, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
    ),
    "gemma3": (
        "Gemma3Text",
        {**_GQA, "head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "cohere": ("Cohere", _GQA),
    "phi": ("Phi", _GQA),
    "gpt_bigcode": ("GPTBigCode", {"n_positions": 128, "multi_query": True}),
    "opt": ("OPT", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    "bloom": ("Bloom", {"n_head": 4, "n_layer": 2}),
    "smollm3": ("SmolLM3", _GQA),
    "glm4": ("Glm4", {**_GQA, "head_dim": 16}),
    "exaone4": ("Exaone4", {**_GQA, "head_dim": 16}),
}


def sweep_model(arch: str, seed: int = 0):
    """A float32 model of `arch` with plain sdpa (else eager) attention, identical for equal seeds."""
    prefix, overrides = SWEEP[arch]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_name = "Gemma3ForCausalLM" if prefix == "Gemma3Text" else f"{prefix}ForCausalLM"
    config = config_cls(**{**_SHAPE, **overrides})
    model_cls = getattr(transformers, model_name)
    attention = "sdpa" if model_cls._supports_sdpa else "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls._from_config(config, attn_implementation=attention, dtype=torch.float32)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 255
    return model.eval()
