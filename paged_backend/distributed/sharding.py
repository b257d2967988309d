"""Tensor parallelism for an already-loaded HF decoder: keep one rank's slice of every layer.

The layout is the model's own tensor-parallel plan (`config.base_model_tp_plan`, the one transformers'
`tp_plan="auto"` applies), or ours for architectures that ship none: column-parallel q/k/v/gate/up, row-parallel
o/down, an all-reduce after each row-parallel layer. We apply the plan with plain tensors instead of
transformers' DTensor path (`apply_tensor_parallelism`) because its even chunking cannot express one case we must
serve: fewer KV heads than ranks, where each rank keeps the one KV head its query heads read (vLLM's replication).
Checked on CPU + gloo with transformers 5.23: its path matches the whole model for 2 KV heads at TP=2, and for 1
KV head it splits that head's dimensions across the ranks and the attention reshape fails. Embeddings, norms and the
LM head stay whole on every rank, so each rank computes the same logits.

The attention function then sees only the rank's local heads, and a rank's KV pool holds only its local KV heads
(`core.kv_budget.kv_heads_per_rank`, the one rule for splitting or replicating KV heads).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from paged_backend.core.kv_budget import KVShape, kv_heads_per_rank
from paged_backend.errors import UnsupportedModel

if TYPE_CHECKING:
    from paged_backend.distributed.state import RankContext

# Llama-shaped decoders without a shipped plan get this one (the layout every Llama-family plan uses).
DEFAULT_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
COLWISE, ROWWISE = "colwise", "rowwise"
# Styles that keep a module whole on every rank (at inference these are plain replicas).
REPLICATED_STYLES = {"replicate", "replicated_with_grad_allreduce"}
QUERY, KEY_VALUE, OUTPUT = "q_proj", ("k_proj", "v_proj"), "o_proj"


def tp_plan(model: nn.Module) -> dict[str, str]:
    """The base model's plan: the shipped `base_model_tp_plan`, else `DEFAULT_TP_PLAN`."""
    return dict(getattr(model.config.get_text_config(), "base_model_tp_plan", None) or DEFAULT_TP_PLAN)


def _shape(config) -> tuple[int, int, int, int]:
    """(query heads, KV heads, head dim, intermediate size) of a decoder config."""
    text, kv = config.get_text_config(), KVShape.of(config)
    return text.num_attention_heads, kv.num_kv_heads, kv.head_dim, getattr(text, "intermediate_size", 0)


def check_shardable(model: nn.Module, tp_size: int) -> None:
    """Refuse, with a sentence, a model that cannot be split over `tp_size` ranks."""
    if tp_size < 1:
        raise UnsupportedModel(f"tensor_parallel_size must be at least 1, got {tp_size}")
    if tp_size == 1:
        return
    heads, kv_heads, _, intermediate = _shape(model.config)
    plan = tp_plan(model)
    unknown = {style for style in plan.values() if style not in (COLWISE, ROWWISE, *REPLICATED_STYLES)}
    if unknown:
        raise UnsupportedModel(
            f"{type(model).__name__}'s tensor-parallel plan uses {', '.join(sorted(unknown))}, which paged-backend "
            "does not shard (fused or expert layers); run it with tensor_parallel_size=1"
        )
    if heads % tp_size:
        raise UnsupportedModel(
            f"{heads} attention heads do not split over tensor_parallel_size={tp_size}; "
            f"choose a size that divides {heads}"
        )
    kv_heads_per_rank(kv_heads, tp_size)  # refuses KV heads that neither split over nor replicate onto the ranks
    if intermediate % tp_size:
        raise UnsupportedModel(
            f"MLP width {intermediate} does not split over tensor_parallel_size={tp_size}; choose a size dividing it"
        )
    names = {name for name, _ in model.named_modules()}
    for pattern in plan:
        regex = re.compile(rf"(^|\.){_pattern(pattern)}$")
        if not any(regex.search(name) for name in names):
            raise UnsupportedModel(
                f"{type(model).__name__} has no module matching its tensor-parallel plan {pattern!r}"
            )


def _pattern(key: str) -> str:
    return re.escape(key).replace(r"\*", r"\d+")


def _head_rows(name: str, rank: int, size: int, heads: int, kv_heads: int, head_dim: int, width: int) -> slice:
    """Rows (colwise) or columns (rowwise) of `name` that rank `rank` keeps."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in KEY_VALUE and kv_heads < size:  # replicated: the KV head this rank's query heads belong to
        head = rank * kv_heads // size
        return slice(head * head_dim, (head + 1) * head_dim)
    if leaf in (QUERY, OUTPUT, *KEY_VALUE):
        count = (kv_heads if leaf in KEY_VALUE else heads) // size
        return slice(rank * count * head_dim, (rank + 1) * count * head_dim)
    share = width // size
    return slice(rank * share, (rank + 1) * share)


class _AllReduce:
    """Forward hook of a row-parallel layer: sum the ranks' partial outputs over the rank's tensor-parallel group
    (looked up per call: the group lives in the RankContext alone, so closing it frees the group's threads)."""

    def __init__(self, ctx: RankContext | None) -> None:
        self.ctx = ctx

    def __call__(self, module, args, output):
        dist.all_reduce(output, group=None if self.ctx is None else self.ctx.tp_group)
        return output


def shard_lora(module: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a LoRA update `B @ A` of `module` (whole when the module is not sharded).

    Column-parallel: every rank needs all of `A [r, in]` and its output rows of `B`. Row-parallel: its input
    columns of `A` and all of `B`; each rank's `B @ (A_part @ x_part)` is partial and the layer's all-reduce sums it.
    """
    style, keep = getattr(module, "tp_shard", (None, None))
    if style == COLWISE:
        return lora_a, lora_b[keep]
    if style == ROWWISE:
        return lora_a[:, keep], lora_b
    return lora_a, lora_b


@torch.no_grad()
def shard_model(model: nn.Module, tp_rank: int, tp_size: int, ctx: RankContext | None = None) -> nn.Module:
    """Keep rank `tp_rank`'s slice of `model` (in place) and return it; row-parallel layers all-reduce over
    `ctx.tp_group` (default: the world). Every rank of the group must call this with the same full weights.

    Raises `UnsupportedModel` with a sentence when the model cannot be split over `tp_size` ranks.
    """
    check_shardable(model, tp_size)
    if tp_size == 1:
        return model
    if not 0 <= tp_rank < tp_size:
        raise UnsupportedModel(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    heads, kv_heads, head_dim, _ = _shape(model.config)
    plan = tp_plan(model)
    rules = [(re.compile(rf"(^|\.){_pattern(key)}$"), style) for key, style in plan.items()]
    for name, module in list(model.named_modules()):
        style = next((style for regex, style in rules if regex.search(name)), None)
        if style not in (COLWISE, ROWWISE):
            continue
        if not isinstance(module, nn.Linear):
            raise UnsupportedModel(f"{name} is a {type(module).__name__}, not a linear layer; it cannot be sharded")
        if style == COLWISE:
            keep = _head_rows(name, tp_rank, tp_size, heads, kv_heads, head_dim, module.out_features)
            module.tp_shard = (COLWISE, keep)  # what shard_lora keeps of an adapter's update
            module.weight = nn.Parameter(module.weight[keep].clone(), requires_grad=False)
            if module.bias is not None:
                module.bias = nn.Parameter(module.bias[keep].clone(), requires_grad=False)
            module.out_features = keep.stop - keep.start
        else:
            keep = _head_rows(name, tp_rank, tp_size, heads, kv_heads, head_dim, module.in_features)
            module.tp_shard = (ROWWISE, keep)
            module.weight = nn.Parameter(module.weight[:, keep].clone(), requires_grad=False)
            if module.bias is not None and tp_rank:  # the bias is added once, by rank 0, before the sum
                module.bias.zero_()
            module.in_features = keep.stop - keep.start
            module.register_forward_hook(_AllReduce(ctx))
    local_heads, local_kv = heads // tp_size, kv_heads_per_rank(kv_heads, tp_size)
    for module in model.modules():  # eager/sdpa attention repeats KV by this ratio: make it the local one
        if hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = local_heads // local_kv
    return model
