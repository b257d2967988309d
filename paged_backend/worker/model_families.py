"""What each architecture the fused CPU forward takes looks like, beyond what its config says: where its linear
layers are, its kind of norm, whether its attention soft-caps, and how to read its per-layer parts (norms, q/k head
norms, rotary) off the model. `worker/fused_forward.py` runs them; adding a family is a row in `FAMILIES` when its
layers differ from Llama's only in what these describe."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paged_backend.ops.fused_cpu import HeadPrep

# Where a family keeps each layer's linear layers: those reading the attention's input (q, k and v apart, or one
# module stacking them), o, those reading the MLP's input (gate and up, or one stacked module), down.
APART = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.o_proj",
         ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj")  # fmt: skip
STACKED = (("self_attn.qkv_proj",), "self_attn.o_proj", ("mlp.gate_up_proj",), "mlp.down_proj")


@dataclass(frozen=True)
class Family:
    """What the fused forward needs to know of an architecture beyond its config: where its linear layers are,
    whether its norms are Gemma's (scale by 1 + weight in fp32, and norm each branch's output before its add), and
    whether its attention soft-caps the scores when the config asks (Gemma 2's does; Gemma 3's ignores the setting)."""

    linears: tuple = APART
    gemma_norms: bool = False
    softcapped_attention: bool = False


FAMILIES = {
    "LlamaForCausalLM": Family(), "MistralForCausalLM": Family(), "Qwen2ForCausalLM": Family(),
    "Qwen3ForCausalLM": Family(), "SmolLM3ForCausalLM": Family(), "Phi3ForCausalLM": Family(STACKED),
    "Gemma2ForCausalLM": Family(gemma_norms=True, softcapped_attention=True),
    "Gemma3ForCausalLM": Family(gemma_norms=True), "GraniteForCausalLM": Family(),
}  # fmt: skip
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def head_norm_modules(attention: nn.Module) -> tuple[nn.Module, ...]:
    """Qwen3's and Gemma 3's per-head RMSNorms of q and k (before rotary), or () for the families without them."""
    return (attention.q_norm, attention.k_norm) if hasattr(attention, "q_norm") else ()


def norm_of(module: nn.Module) -> tuple[torch.Tensor, float]:
    """An RMSNorm module's (weight, eps): Llama's keeps eps as `variance_epsilon`, Gemma's as `eps`."""
    return module.weight, getattr(module, "variance_epsilon", getattr(module, "eps", None))


def activation_name(config) -> str | None:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)  # Gemma's: the first


def head_prep(attention: nn.Module, unit_offset: bool) -> HeadPrep:
    """The layer's q/k norms (Qwen3, Gemma 3: an RMSNorm over each head, before rotary) and whether it has rotary at
    all (SmolLM3's NoPE layers have none)."""
    norms = [norm_of(norm) for norm in head_norm_modules(attention)] or [None, None]
    return HeadPrep(*norms, rotary=bool(getattr(attention, "use_rope", True)), unit_offset=unit_offset)


def qkv_sizes(modules: tuple, config) -> list[int]:
    """The q, k and v widths of a layer's projections as they are here (a tensor-parallel rank holds its share of
    the heads): each module's own, or a stacked module's split in the config's ratio of q to kv heads."""
    if len(modules) > 1:
        return [module.out_features for module in modules]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    q_size = modules[0].out_features * heads // (heads + 2 * kv_heads)
    return [q_size, *[(modules[0].out_features - q_size) // 2] * 2]


def layer_linears(layer: nn.Module, names: tuple) -> tuple:
    """(the q|k|v modules, o, the gate|up modules, down) of `layer`, by its family's names."""
    qkv, o, gate_up, down = names
    return (tuple(map(layer.get_submodule, qkv)), layer.get_submodule(o), tuple(map(layer.get_submodule, gate_up)),
            layer.get_submodule(down))  # fmt: skip


def flat_linears(linears: tuple) -> list[nn.Module]:
    qkv, o, gate_up, down = linears
    return [*qkv, o, *gate_up, down]
