"""A Llama-family decoder stack run on fused CPU kernels: the runner's forward wherever the model allows it.

transformers' modeling code costs a few hundred microseconds of Python per layer and step (keyword plumbing, mask
and attention-interface dispatch, a cache update, a dozen small ops for norms, rotary and activations). A deep,
narrow model at one stream pays that thirty times per token, against ~1 ms of matmul per layer. This forward
keeps the model's own linear modules (so prepacked weights, LoRA and tensor-parallel hooks and quantized layers
all still apply) and does everything between them with `ops/fused_cpu.py`, with the step's attention and rotary
arguments prepared once (`AttentionPlan`, `RotaryCache`):

    residual = embed(ids); x = norm(residual)
    per layer: q, k, v = qkv(x); q = rotary_cache(q, k, v -> pool); o = o_proj(attention(q))
               x = add_rms_norm(o, residual); x = down(act_mul(*gate_up(x))); x = add_rms_norm(x, residual)

with what each family adds to that shape:
- Qwen3 and Gemma 3: rotary_cache RMS-norms each q and k head first;
- SmolLM3: its NoPE layers skip the rotary;
- Phi-3: q|k|v and gate|up are one module each; Phi-4-mini rotates part of each head;
- Granite: multipliers of the embeddings, of each branch's output before its add (in add_rms_norm), of the logits;
- Gemma 2 and 3: their norms scale by 1 + weight in fp32, add_rms_norm norms `o` and the MLP output before adding
  them (sandwich norms), the activation is GELU-tanh, and the logits may be soft-capped; Gemma 2's attention scores
  too, and Gemma 3's local and global layers rotate with two bases.

It takes the architectures whose layers are exactly that (`model_families.FAMILIES`) when nothing hooks the modules
it bypasses; anything else, or `PAGED_BACKEND_FUSED_FORWARD=0`, runs transformers' forward over the paged bridge.
When every layer's linear calls are panels, the per-layer loop is one call into C++ (`ops/decoder_layers.py`: the
same kernels in the same order, so the same bits; `PAGED_BACKEND_NATIVE_LAYERS=0` keeps it in Python).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from paged_backend.config.env import env_flag
from paged_backend.core.kv_cache import PagedKVCache
from paged_backend.ops import resolve_backend
from paged_backend.ops.cpu import AttentionPlan
from paged_backend.ops.decoder_layers import DecoderLayers, LayerParts
from paged_backend.ops.fused_cpu import (
    ACTIVATIONS,
    FUSED_DTYPES,
    MAX_STAGED_HEAD_DIM,
    RotaryCache,
    act_mul,
    add_rms_norm,
)
from paged_backend.ops.reference import is_fp8
from paged_backend.worker.attention import PagedMetadata
from paged_backend.worker.model_families import (
    FAMILIES,
    NORMS,
    activation_name,
    flat_linears,
    head_norm_modules,
    head_prep,
    layer_linears,
    norm_of,
    qkv_sizes,
)

SWITCH = "PAGED_BACKEND_FUSED_FORWARD"
NATIVE_SWITCH = "PAGED_BACKEND_NATIVE_LAYERS"  # "0": the layer loop in Python, not csrc/cpu/decoder_layers_cpu.cpp


class StepCut(Exception):
    """The forward stopped between two layers because its caller asked (`cut`); the step computed nothing usable."""


def _hooked(module: nn.Module) -> bool:
    """Hooks, or a forward of someone else's on the instance (the packer's own carry their `panel`: a tied embedding
    that reads the LM head's panels)."""
    own = getattr(module.__dict__.get("forward"), "panel", None) is not None
    return bool(module._forward_hooks or module._forward_pre_hooks or ("forward" in module.__dict__ and not own))


def unfused_reason(model: nn.Module, kv_cache: PagedKVCache, attention_backend: str | None) -> str | None:
    """None when `FusedForward` runs this model over this pool, else why transformers' forward runs instead."""
    env_flag(NATIVE_SWITCH, True)  # checked at load: a step reads it again and must not fail on it
    if not env_flag(SWITCH, True):
        return f"{SWITCH}=0"
    family = FAMILIES.get(type(model).__name__)
    if family is None:
        return f"{type(model).__name__} is not one of {', '.join(FAMILIES)}"
    config, dtype = model.config, model.dtype
    if kv_cache.device.type != "cpu" or model.device.type != "cpu":
        return "the fused kernels run on CPU"
    if dtype not in FUSED_DTYPES or (kv_cache.dtype != dtype and not is_fp8(kv_cache.dtype)):
        return f"model {dtype} with a {kv_cache.dtype} pool (the fused path stores the model's dtype, or fp8)"
    if is_fp8(kv_cache.dtype) and kv_cache.head_dim > MAX_STAGED_HEAD_DIM:
        return f"head_dim {kv_cache.head_dim} over {MAX_STAGED_HEAD_DIM} with an fp8 pool"
    if activation_name(config) not in ACTIVATIONS:
        return f"activation {activation_name(config)!r} (fused: {', '.join(ACTIVATIONS)})"
    if getattr(config, "attn_logit_softcapping", None) is not None and not family.softcapped_attention:
        return "attention logit softcapping, which transformers' forward of this model does not apply"
    if resolve_backend(attention_backend, kv_cache.device) != "cpu":
        return "an attention backend other than the cpu kernel was asked for"
    base = model.model
    layers = list(base.layers)
    if len(layers) != config.num_hidden_layers or len(layers) != kv_cache.num_layers:
        return "the model's layers do not match its pool (pipeline stages run transformers' forward)"
    bypassed = [model, base, base.embed_tokens, base.norm, base.rotary_emb]
    for layer in layers:
        bypassed += [layer, layer.self_attn, layer.mlp, *head_norm_modules(layer.self_attn),
                     *(getattr(layer, name) for name in NORMS if hasattr(layer, name))]
    if any(_hooked(module) for module in bypassed):
        return "hooks on modules the fused forward bypasses (offloading, or a caller's own)"
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return "global module hooks are registered"
    return None


class FusedForward:
    """`forward(ids, positions, metadata, rows)` of `ModelRunner`, on the fused kernels (see the module doc).

    `linears` is the runner's swap-in for the linear layers (`PackedLinears`, the batch-invariant tiles, or None).
    Packed layers are called straight through their packed forwards when no layer has hooks, q/k/v and gate/up as
    one stacked call each where their panels stack; otherwise (LoRA, a caller's hooks, batch-invariant tiles) each
    layer is called as a module inside `linears.active()`."""

    def __init__(self, model: nn.Module, kv_cache: PagedKVCache, linears=None) -> None:
        self.model, self.kv_cache, self.linears = model, kv_cache, linears
        self.base = model.model
        self.layers = list(self.base.layers)
        family = FAMILIES[type(model).__name__]
        self.modules = [layer_linears(layer, family.linears) for layer in self.layers]
        self.lm_head = model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        self.softcap = getattr(attn, "attn_logit_softcapping", None) if family.softcapped_attention else None
        config = model.config
        self.logit_softcap = getattr(config, "final_logit_softcapping", None)
        # Granite's multipliers (1 elsewhere): of the embeddings, of each branch's output before its add, of the logits
        self.embedding_scale = getattr(config, "embedding_multiplier", 1.0)
        self.residual_scale = getattr(config, "residual_multiplier", 1.0)
        self.logits_scaling = getattr(config, "logits_scaling", 1.0)
        self.activation = ACTIVATIONS[activation_name(config)]
        # Mistral keeps its window on the config; Qwen2 per layer (None on full-attention layers)
        self.windows = [
            getattr(layer.self_attn, "sliding_window", getattr(config, "sliding_window", None)) for layer in self.layers
        ]
        # the norms before each layer's attention and MLP, (weight, eps); the final norm follows the last MLP
        gemma = self.unit_offset = family.gemma_norms
        mlp_norm = "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
        self.norms = [(norm_of(layer.input_layernorm), norm_of(getattr(layer, mlp_norm))) for layer in self.layers]
        # Gemma's norms of the attention and MLP outputs, before their residual adds: weights, or None
        self.post_norms = [
            (layer.post_attention_layernorm.weight, layer.post_feedforward_layernorm.weight) if gemma else (None, None)
            for layer in self.layers
        ]
        self.final_norm = norm_of(self.base.norm)
        self.head_preps = [head_prep(layer.self_attn, gemma) for layer in self.layers]
        self.qkv_sizes = qkv_sizes(self.modules[0][0], config)
        self.gate_up_sizes = [sum(module.out_features for module in self.modules[0][2]) // 2] * 2
        self._built, self._built_key = None, None  # _calls()'s result, and the generations it was built at
        self._rotary_tables: dict = {}  # cos and sin by position, per kind of layer (_rotary)
        # Gemma 3's local and global layers rotate with two bases: the rotary module takes the layer type
        by_type = "layer_type" in inspect.signature(self.base.rotary_emb.forward).parameters
        self.rope_kinds = list(config.layer_types) if by_type else [None] * len(self.layers)
        self._rope_kind_args = {kind: {} if kind is None else {"layer_type": kind} for kind in set(self.rope_kinds)}
        # a rope that changes with the sequence length cannot be tabled
        rope_type = str(getattr(self.base.rotary_emb, "rope_type", "default"))
        self._rope_varies = any(kind in rope_type for kind in ("dynamic", "longrope"))
        # the forward hooks of every module the calls bypass, checked each step (a caller's, LoRA's as it loads)
        bypassed = [*(module for layer in self.modules for module in flat_linears(layer)), self.lm_head]
        self._hook_dicts = [
            hooks for module in bypassed for hooks in (module._forward_hooks, module._forward_pre_hooks)
        ]

    def _calls(self) -> tuple[list[tuple], object, DecoderLayers | None] | None:
        """This step's callable for each layer's linear layers and for the LM head, and the C++ layer loop when
        every layer can run in it; None when they must run as modules inside `active()`. A step checks hooks and
        repacks what changed; the calls are built again only when a layer was repacked or the pool replaced.
        (Rebuilding them and checking every layer's weights each step cost ~0.8 ms of a 7-18 ms one-stream step on
        the real model, its module objects cold in cache.)"""
        if self.linears is not None and not hasattr(self.linears, "forwards"):
            return None  # a swap-in that only works through active()
        if any(self._hook_dicts):
            return None
        native = env_flag(NATIVE_SWITCH, True)
        cache = self.kv_cache  # the C++ loop's layers carry their fp8 scales, which calibration sets after load
        key = (self.linears.refresh() if self.linears is not None else None, cache.generation, native,
               tuple(cache.k_scales), tuple(cache.v_scales))  # fmt: skip
        if key != self._built_key:
            self._built, self._built_key = self._build_calls(native), key
        return self._built

    def _build_calls(self, native: bool) -> tuple[list[tuple], object, DecoderLayers | None]:
        packed = self.linears.forwards() if self.linears is not None else {}
        stacked = getattr(self.linears, "stacked", None)
        forward_of = lambda module: packed.get(module) or module.forward  # noqa: E731 (no hooks: checked by _calls)
        layers, natives = [], []
        for qkv_modules, o, gate_up_modules, down in self.modules:
            qkv_call, qkv = _one_call(qkv_modules, forward_of, stacked, self.qkv_sizes)
            gate_up_call, gate_up = _one_call(gate_up_modules, forward_of, stacked, self.gate_up_sizes)
            o, down = forward_of(o), forward_of(down)
            layers.append((qkv_call, o, gate_up_call, down))
            natives.append((qkv, (o,), gate_up, (down,)))
        return layers, packed.get(self.lm_head) or self.lm_head.forward, self._native_loop(natives) if native else None

    def _native_loop(self, forwards: list[tuple]) -> DecoderLayers | None:
        """The C++ loop over these layers' packed forwards (q|k|v, o, gate|up and down: each a tuple of forwards,
        one when stacked) and the pool's layers; None where a layer is not all panels. Each panel brings its own kind
        (float, int8 or int4, groups, offsets): a GGUF file mixes them within a layer, even within q|k|v."""
        if any(getattr(forward, "panel", None) is None for layer in forwards for linear in layer for forward in linear):
            return None
        panels = lambda linear: [(forward.panel, forward.bias) for forward in linear]  # noqa: E731
        parts = [
            LayerParts(*map(panels, layer), *self.norms[index], *self.kv_cache.layer(index), self.windows[index],
                       self.head_preps[index], *self.post_norms[index], self.activation, self.residual_scale,
                       self._kv_scales(index))
            for index, layer in enumerate(forwards)
        ]  # fmt: skip
        return DecoderLayers(parts, *self.qkv_sizes[:2], self.head_dim)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, metadata: PagedMetadata, rows: list[int],
                 cut: Callable[[], bool] | None = None):  # fmt: skip
        """Float32 logits of the packed `rows` (the runner's `forward` contract); StepCut once `cut()` is true
        between two layers."""
        calls = self._calls()
        if calls is not None:
            return self._run(*calls, ids, positions, metadata, rows, cut)
        modules = [(_one_call(qkv, _module, None, self.qkv_sizes)[0], o,
                    _one_call(gate_up, _module, None, self.gate_up_sizes)[0], down)
                   for qkv, o, gate_up, down in self.modules]  # fmt: skip
        with self.linears.active() if self.linears is not None else nullcontext():
            return self._run(modules, self.lm_head, None, ids, positions, metadata, rows, cut)

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> dict:
        """cos and sin `[T, D]` of the step's positions for each kind of layer (Gemma 3's local and global layers
        rotate differently; other families have one kind, None): rows of a table the model's rotary module computed
        once for positions 0..n (elementwise, so the same bits as computing them per step, which cost ~0.1 ms); a
        rope that changes with the sequence length (dynamic, longrope) is computed per step."""
        rotary, kinds = self.base.rotary_emb, self._rope_kind_args
        if self._rope_varies:
            return {kind: tuple(t[0].contiguous() for t in rotary(x, positions, **args))
                    for kind, args in kinds.items()}  # fmt: skip
        needed = int(positions.max()) + 1
        table = next(iter(self._rotary_tables.values()), None)
        if table is None or table[0].shape[0] < needed or table[0].dtype != x.dtype:
            size = max(needed, 2 * (table[0].shape[0] if table is not None else 0), 4096)
            every = torch.arange(size, device=x.device)[None]
            self._rotary_tables = {kind: tuple(t[0] for t in rotary(x, every, **args)) for kind, args in kinds.items()}
        rows = positions[0]
        return {kind: tuple(t.index_select(0, rows) for t in table) for kind, table in self._rotary_tables.items()}

    def _step_groups(self, metadata: PagedMetadata, rotary: dict, dtype) -> tuple[list[int], list, list]:
        """The step's rotary and attention arguments per layer group (sliding-window layers keep their own tables
        and slots: `metadata.for_layer`) and kind of rotary: each layer's group index, and each group's RotaryCache
        and AttentionPlan."""
        head_dim, block_size = self.head_dim, self.kv_cache.block_size
        q_width, kv_width = self.qkv_sizes[:2]
        index_of, groups, rotaries, plans = {}, [], [], []
        for layer, kind in enumerate(self.rope_kinds):
            group = metadata.for_layer(layer)
            key = id(group), kind
            if key not in index_of:
                index_of[key] = len(rotaries)
                rotaries.append(RotaryCache(*rotary[kind], group.slot_mapping, block_size, head_dim,
                                             self.kv_cache.num_blocks * block_size, self.kv_cache.dtype))  # fmt: skip
                plans.append(AttentionPlan(
                    group.block_tables, group.seq_lens, group.query_start_loc, num_q_heads=q_width // head_dim,
                    num_kv_heads=kv_width // head_dim, head_dim=head_dim, block_size=block_size, dtype=dtype,
                    kv_dtype=self.kv_cache.dtype, scale=self.scale, softcap=self.softcap,
                ))  # fmt: skip
            groups.append(index_of[key])
        return groups, rotaries, plans

    def _run(self, calls, lm_head, native, ids, positions, metadata: PagedMetadata, rows: list[int], cut):
        base = self.base
        residual = base.embed_tokens(ids)  # [1, T, H] (Gemma's module scales it)
        if self.embedding_scale != 1.0:  # Granite's model scales them after the module, in their dtype
            residual = residual * self.embedding_scale
        rotary = self._rotary(residual, positions)
        residual = residual[0]
        x = add_rms_norm(None, residual, *self.norms[0][0], unit_offset=self.unit_offset)
        groups = self._step_groups(metadata, rotary, x.dtype)
        if native is not None:
            out = native(residual, x, *groups, cut)
            if out is None:
                raise StepCut("stopped between two layers")
        else:
            out = self._python_layers(calls, residual, x, *groups, cut)
        # only the kept rows need the last residual add, the final norm and the LM head
        kept = torch.tensor(rows, dtype=torch.long)
        x = add_rms_norm(out.index_select(0, kept), residual.index_select(0, kept), *self.final_norm,
                         x_weight=self.post_norms[-1][1], x_scale=self.residual_scale,
                         unit_offset=self.unit_offset)  # fmt: skip
        logits = lm_head(x)
        if self.logits_scaling != 1.0:  # Granite's, in the model's dtype as transformers does
            logits = logits / self.logits_scaling
        if self.logit_softcap:  # Gemma's, in the model's dtype as transformers does
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits.float()

    def _kv_scales(self, layer: int) -> tuple[float, float]:
        """The layer's fp8 scales (1.0 for other pools): its K and V are stored over them, read back times them."""
        return self.kv_cache.k_scales[layer], self.kv_cache.v_scales[layer]

    def _python_layers(self, calls, residual, x, groups, rotaries, plans, cut) -> torch.Tensor:
        cache, last = self.kv_cache, len(self.layers) - 1
        for index, (qkv_proj, o_proj, gate_up_proj, down_proj) in enumerate(calls):
            if cut is not None and cut():
                raise StepCut(f"stopped before layer {index}")
            q, k, v = qkv_proj(x)
            rotary, plan = rotaries[groups[index]], plans[groups[index]]
            key_cache, value_cache = cache.layer(index)
            scales = self._kv_scales(index)
            q = rotary(q, k, v, key_cache, value_cache, self.head_preps[index], scales)
            out = o_proj(plan(q, key_cache, value_cache, self.windows[index], *scales).view(q.shape[0], -1))
            post_attention, post_mlp = self.post_norms[index]
            x = add_rms_norm(out, residual, *self.norms[index][1], x_weight=post_attention,
                             x_scale=self.residual_scale, unit_offset=self.unit_offset)  # fmt: skip
            out = down_proj(act_mul(*gate_up_proj(x), self.activation))
            if index < last:
                x = add_rms_norm(out, residual, *self.norms[index + 1][0], x_weight=post_mlp,
                                 x_scale=self.residual_scale, unit_offset=self.unit_offset)  # fmt: skip
        return out


def _module(module: nn.Module) -> nn.Module:
    return module  # called as a module: its hooks run (LoRA's, a caller's)


def _one_call(modules: tuple, call_of: Callable, stacked, sizes: list[int]):
    """One call for the layers that read the same input (q, k and v; gate and up), giving their outputs apart, and the
    forwards the C++ loop takes side by side: the family's own stacked module (Phi-3), their panels stacked, or else
    each layer called in turn (kinds of panels that do not stack). `call_of(module)` is what calls one layer."""
    if len(modules) == 1:
        call = call_of(modules[0])
        return _split(call, sizes), (call,)
    group = stacked(modules) if stacked is not None else None
    if group is not None:
        return _split(group, sizes), (group,)
    calls = tuple(map(call_of, modules))
    return _each(*calls), calls


def _each(*projections):
    """Layers that read one input, called one by one: their outputs as a tuple."""
    return lambda x: tuple(projection(x) for projection in projections)


def _split(stacked, sizes: list[int]):
    """A stacked call (`PackedLinears.stacked`) whose output is cut back into its layers' (views, row-strided)."""
    return lambda x: stacked(x).split(sizes, dim=-1)
