"""A step's decoder layers in one call: csrc/cpu/decoder_layers_cpu.cpp, the fused forward's layer loop run in C++.

It calls the kernels `worker/fused_forward.py` calls between its layers (panel linear, rotary + cache write, paged
attention, add + RMSNorm, SiLU·mul) in the same order with the same arguments, so its output is bitwise that loop's;
what it saves is the ~7 µs ctypes costs per kernel call, eight calls per layer. `DecoderLayers` holds the layers'
packed weights, norms and pools as the loop reads them (built once per packing); calling it runs one step.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from paged_backend.ops._c_abi import F32, I32, I64, PTR, check_layouts
from paged_backend.ops.cpu import QUERY_DTYPES, AttentionArgs, AttentionPlan, _library
from paged_backend.ops.fused_cpu import PLAIN, SILU, HeadPrep, RotaryCache, RotaryCacheArgs, _fused
from paged_backend.ops.panel_linear import PanelWeight, _panel, _pointer, panel_bias


class PanelQuant(ctypes.Structure):
    """Mirror of PbCpuPanelQuant: how one of a layer's panels is quantized (`scales` null: a float panel)."""

    _fields_ = [("scales", PTR), ("bits", I32), ("group_size", I32), ("offsets", I32), ("levels", PTR)]

    @classmethod
    def of(cls, panel: PanelWeight) -> PanelQuant:
        return cls(_pointer(panel.scales), panel.bits, panel.group_size, int(panel.offsets), _pointer(panel.levels))


class LayerPanel(ctypes.Structure):
    """Mirror of PbCpuLayerPanel: one of a layer's panels, `outputs` columns of its linear's output (`panels` null:
    an unused slot)."""

    _fields_ = [("panels", PTR), ("bias", PTR), ("quant", PanelQuant), ("outputs", I64)]


class DecoderLayer(ctypes.Structure):
    """Mirror of PbCpuDecoderLayer."""

    _fields_ = [
        ("qkv", LayerPanel * 3), ("o", LayerPanel), ("gate_up", LayerPanel * 2), ("down", LayerPanel),
        ("attention_norm", PTR), ("mlp_norm", PTR),
        ("attention_eps", F32), ("mlp_eps", F32), ("key_cache", PTR), ("value_cache", PTR),
        ("k_stride_block", I64), ("k_stride_slot", I64), ("k_stride_head", I64),
        ("v_stride_block", I64), ("v_stride_slot", I64), ("v_stride_head", I64),
        ("group", I32), ("sliding_window", I32),
        ("q_norm", PTR), ("k_norm", PTR), ("q_norm_eps", F32), ("k_norm_eps", F32), ("skip_rotary", I32),
        ("post_attention_norm", PTR), ("post_mlp_norm", PTR), ("unit_offset", I32), ("activation", I32),
        ("residual_scale", F32), ("k_scale", F32), ("v_scale", F32),
    ]  # fmt: skip


STOP = ctypes.CFUNCTYPE(I32)


class DecoderStep(ctypes.Structure):
    """Mirror of PbCpuDecoderStep."""

    _fields_ = [
        ("layers", ctypes.POINTER(DecoderLayer)), ("num_layers", I32),
        ("rotary", ctypes.POINTER(RotaryCacheArgs)), ("attention", ctypes.POINTER(AttentionArgs)),
        ("residual", PTR), ("x", PTR), ("qkv", PTR), ("query", PTR), ("attention_out", PTR), ("o", PTR),
        ("gate_up", PTR), ("act", PTR), ("out", PTR),
        ("tokens", I64), ("hidden", I64), ("q_size", I64), ("kv_size", I64), ("intermediate", I64), ("head_dim", I64),
        ("dtype", I32), ("num_threads", I32), ("stop", STOP), ("failed", I32),
    ]  # fmt: skip


STOPPED = 1  # pb_cpu_decoder_layers: `stop` stopped the step before a layer


@cache
def _layers_library() -> ctypes.CDLL:
    lib = _library()
    lib.pb_cpu_decoder_layers.argtypes = [ctypes.POINTER(DecoderStep)]
    lib.pb_cpu_decoder_layers.restype = I32
    check_layouts(lib, {DecoderLayer: "pb_cpu_decoder_layer_size", DecoderStep: "pb_cpu_decoder_step_size"},
                  "csrc/cpu")  # fmt: skip
    return lib


def _error(kernel: int, status: int) -> str:
    """The failing kernel's own words (PbCpuLayerKernel: 1 linear, 2 rotary, 3 attention, 4 norm, 5 act_mul)."""
    if kernel == 1:
        return _panel().pb_cpu_panel_error_string(status).decode()
    if kernel == 3:
        return _library().pb_cpu_error_string(status).decode()
    return _fused().pb_cpu_fused_error_string(status).decode()


Panels = list[tuple[PanelWeight, "torch.Tensor | None"]]  # a linear's panels side by side, each with its bias or None


@dataclass
class LayerParts:
    """One layer as the loop reads it: q|k|v (stacked, or up to three panels where their kinds do not stack),
    o, gate|up (likewise, up to two) and down, each a list of (panel, bias or None); the two norms' (weight, eps),
    the layer's pools, its sliding window (None: off) and what it does to q and k heads besides the rotary
    (`HeadPrep`: Qwen3's norms, SmolLM3's NoPE layers). Gemma adds norms of the attention and MLP outputs before their
    residual adds (weights, or None), its kind of norm (`head_prep.unit_offset`) and GELU-tanh (`activation`); Granite
    scales each branch's output before its add (`residual_scale`)."""

    qkv: Panels
    o: Panels
    gate_up: Panels
    down: Panels
    attention_norm: tuple[torch.Tensor, float]
    mlp_norm: tuple[torch.Tensor, float]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    sliding_window: int | None
    head_prep: HeadPrep = PLAIN
    post_attention_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    activation: int = SILU
    residual_scale: float = 1.0
    kv_scales: tuple[float, float] = (1.0, 1.0)  # an fp8 pool's k_scale and v_scale for this layer


class DecoderLayers:
    """The layers' structs for the C++ loop, and `__call__` for one step. `q_size`/`kv_size` are the q and k (or v)
    widths of the stacked qkv output; the dtype is the panels' (float32 or bfloat16). It holds the weights but only
    the addresses of the pools: valid while they stay where they were (`FusedForward` keys it on them)."""

    def __init__(self, parts: list[LayerParts], q_size: int, kv_size: int, head_dim: int) -> None:
        first = parts[0]
        self.dtype = first.qkv[0][0].dtype
        self.hidden, self.intermediate = first.o[0][0].out_features, first.down[0][0].in_features
        self.q_size, self.kv_size, self.head_dim = q_size, kv_size, head_dim
        self.keep = []  # everything the structs point into
        layers = []
        for part in parts:
            slots = [self._slots(panels, size) for panels, size in
                     ((part.qkv, 3), (part.o, 1), (part.gate_up, 2), (part.down, 1))]  # fmt: skip
            k_strides, v_strides = part.key_cache.stride()[:3], part.value_cache.stride()[:3]
            layers.append(DecoderLayer(
                *slots, part.attention_norm[0].data_ptr(), part.mlp_norm[0].data_ptr(), part.attention_norm[1],
                part.mlp_norm[1], part.key_cache.data_ptr(), part.value_cache.data_ptr(), *k_strides, *v_strides,
                0, part.sliding_window or 0,
                **part.head_prep.fields,  # its unit_offset is the layer's one kind of norm, q/k norms included
                post_attention_norm=_pointer(part.post_attention_norm), post_mlp_norm=_pointer(part.post_mlp_norm),
                activation=part.activation, residual_scale=part.residual_scale, k_scale=part.kv_scales[0],
                v_scale=part.kv_scales[1],
            ))  # fmt: skip
            # The weights are kept alive here; the pools are not (sleep mode frees them): the caller rebuilds this
            # when a pool moves.
            self.keep += [part.attention_norm[0], part.mlp_norm[0], part.head_prep, part.post_attention_norm,
                          part.post_mlp_norm]  # fmt: skip
        self.layers = (DecoderLayer * len(layers))(*layers)

    def _slots(self, panels: Panels, size: int) -> LayerPanel | ctypes.Array:
        """A linear's panels as the struct's `size` slots (one slot: the struct itself), unused ones null."""
        if not 1 <= len(panels) <= size:
            raise ValueError(f"a layer's linear takes 1 to {size} panels side by side, not {len(panels)}")
        slots = []
        for panel, bias in panels:
            bias = panel_bias(bias, self.dtype)
            self.keep += [panel, bias]
            slots.append(LayerPanel(panel.packed.data_ptr(), _pointer(bias), PanelQuant.of(panel), panel.out_features))
        return slots[0] if size == 1 else (LayerPanel * size)(*slots)

    def __call__(self, residual: torch.Tensor, x: torch.Tensor, groups: list[int], rotaries: list[RotaryCache],
                 plans: list[AttentionPlan], stop=None) -> torch.Tensor | None:  # fmt: skip
        """Run every layer on `residual [T, hidden]` (updated in place) and the first layer's normed input `x`;
        layer i uses `rotaries[groups[i]]` and `plans[groups[i]]`. Returns the last layer's MLP output `[T, hidden]`,
        or None when `stop()` turned true before a layer."""
        tokens, dtype = residual.shape[0], self.dtype
        if residual.dtype != dtype or not (residual.is_contiguous() and x.is_contiguous()):
            raise ValueError(f"the layer loop takes contiguous {dtype} rows, not {residual.dtype}")
        for layer, group in zip(self.layers, groups, strict=True):
            layer.group = group
        empty = lambda width: torch.empty(tokens, width, dtype=dtype)  # noqa: E731
        qkv_width = self.q_size + 2 * self.kv_size
        buffers = qkv, query, attention_out, o, gate_up, act, out = (
            empty(qkv_width), empty(self.q_size), empty(self.q_size), empty(self.hidden), empty(2 * self.intermediate),
            empty(self.intermediate), empty(self.hidden),
        )  # fmt: skip
        step = DecoderStep(
            self.layers, len(self.layers), (RotaryCacheArgs * len(rotaries))(*(r.args for r in rotaries)),
            (AttentionArgs * len(plans))(*(p.args for p in plans)), residual.data_ptr(), x.data_ptr(),
            *(buffer.data_ptr() for buffer in buffers), tokens, self.hidden, self.q_size, self.kv_size,
            self.intermediate, self.head_dim, QUERY_DTYPES[dtype], torch.get_num_threads(),
            STOP(lambda: int(stop())) if stop is not None else STOP(), 0,
        )  # fmt: skip
        status = _layers_library().pb_cpu_decoder_layers(ctypes.byref(step))
        if status == STOPPED:
            return None
        if status != 0:
            raise RuntimeError(f"decoder layer loop failed: {_error(step.failed, status)}")
        return out
