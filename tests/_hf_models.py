"""Tiny seeded decoder models (2 layers, hidden 64, vocab 128, float32) of every architecture PagedCache serves."""

from __future__ import annotations

import torch
import transformers

PAD, EOS = 0, 2
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=256, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=1,
               initializer_range=0.2)
_GQA = dict(num_key_value_heads=2)
_SLIDING_GQA = dict(num_key_value_heads=2, sliding_window=6)  # shorter than the test sequences: windows slide

ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, _GQA),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, _SLIDING_GQA),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, _GQA),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {**_GQA, "head_dim": 16}),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               {**_SLIDING_GQA, "head_dim": 16, "attn_logit_softcapping": 5.0}),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               {**_SLIDING_GQA, "head_dim": 16, "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, _GQA),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM,  # Granite 3's multipliers
                {**_GQA, "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0625,
                 "logits_scaling": 8.0}),
    # Llama with NoPE layers: with 2 layers and an interval of 2, layer 1 has no rotary
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, {**_GQA, "no_rope_layer_interval": 2}),
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel, {"n_positions": 256}),
}


def tiny_model(arch: str, attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    """A randomly initialised model of `arch`, identical for equal seeds and overrides."""
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    config = config_cls(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model.eval()


def prompts(padded: bool, rows: int = 2, width: int = 9) -> dict[str, torch.Tensor]:
    """A batch of prompts; with `padded`, every row is left-padded (to different lengths)."""
    g = torch.Generator().manual_seed(7)
    lengths = [width - 2 * (r + 1) for r in range(rows)] if padded else [width] * rows
    input_ids = torch.full((rows, width), PAD)
    attention_mask = torch.zeros(rows, width, dtype=torch.long)
    for r, n in enumerate(lengths):
        input_ids[r, width - n :] = torch.randint(3, 128, (n,), generator=g)
        attention_mask[r, width - n :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}
