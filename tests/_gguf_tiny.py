"""A seeded tiny Llama (or Qwen3) written as a GGUF file the way llama.cpp's converter writes one (a Llama's q/k rows
permuted for its rotary layout, a GPT-2 style byte-level vocabulary), so GGUF loading and its cache can be tested in a
second."""

from __future__ import annotations

from pathlib import Path

import gguf
import torch

from paged_backend.worker.models import CHAT_TEMPLATE, SPECIAL_TOKENS, _bytes_to_unicode, tiny_model
from tests._gguf_files import _finish

LAYER_TENSORS = {  # GGUF name -> HF name, per layer
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip
QWEN3_TENSORS = {**LAYER_TENSORS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores each head's q/k rows as interleaved rotary pairs; transformers undoes this on load."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def tiny_llama_gguf(path: Path, seed: int = 0, arch: str = "llama"):
    """Write `tiny_model(arch, seed)` (F32 tensors; arch "llama" or "qwen3") to `path`; returns that HF model, the
    expected weights."""
    model = tiny_model(arch, seed=seed)
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"paged-backend tiny {arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    byte_chars = _bytes_to_unicode()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([byte_chars[b] for b in range(253)] + list(SPECIAL_TOKENS))
    writer.add_token_types([gguf.TokenType.NORMAL] * 253 + [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS))
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * (253 + len(SPECIAL_TOKENS)))
    writer.add_bos_token_id(SPECIAL_TOKENS["<|bos|>"])
    writer.add_eos_token_id(SPECIAL_TOKENS["<|eos|>"])
    writer.add_pad_token_id(SPECIAL_TOKENS["<|pad|>"])
    writer.add_chat_template(CHAT_TEMPLATE)
    weights = {name: tensor.detach().float() for name, tensor in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"].numpy())
    for layer in range(config.num_hidden_layers):
        for gguf_name, hf_name in (QWEN3_TENSORS if arch == "qwen3" else LAYER_TENSORS).items():
            tensor = weights[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name in ("attn_q", "attn_k") and arch == "llama":  # llama.cpp permutes a Llama's alone
                heads = config.num_attention_heads if gguf_name == "attn_q" else config.num_key_value_heads
                tensor = llama_cpp_permute(tensor, heads)
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", tensor.contiguous().numpy())
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"].numpy())
    writer.add_tensor("output.weight", weights["lm_head.weight"].numpy())
    _finish(writer, path)
    return model
