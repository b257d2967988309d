"""The fused decoder-layer kernels of csrc/cpu/fused_ops_cpu.cpp, and their torch oracles.

`add_rms_norm`, `act_mul` and `RotaryCache` are what `worker/fused_forward.py` calls between a layer's linear
layers; each `*_reference` is the same step written with transformers' torch ops, which the tests hold the
kernels to. The kernels take rows with a unit stride along the hidden dimension; they run on CPU tensors in
float32, float16 or bfloat16.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache, cached_property

import torch

from paged_backend.ops._c_abi import I32, I64, PTR, check_layouts, check_status
from paged_backend.ops.cpu import KV_DTYPES, QUERY_DTYPES, _library
from paged_backend.ops.reference import is_fp8, to_fp8

FUSED_DTYPES = QUERY_DTYPES  # float32, float16, bfloat16
MAX_STAGED_HEAD_DIM = 512  # kMaxNormedHeadDim: heads normed or stored to fp8 go through a stack buffer this wide


class RotaryCacheArgs(ctypes.Structure):
    """Mirror of RotaryCacheArgs in csrc/cpu/fused_ops_cpu.cpp."""

    _fields_ = [
        ("query", PTR), ("q_stride", I64), ("key", PTR), ("k_stride", I64), ("value", PTR), ("v_stride", I64),
        ("cos", PTR), ("sin", PTR), ("query_out", PTR), ("key_cache", PTR), ("value_cache", PTR),
        ("k_stride_block", I64), ("k_stride_slot", I64), ("k_stride_head", I64),
        ("v_stride_block", I64), ("v_stride_slot", I64), ("v_stride_head", I64),
        ("slot_mapping", PTR),
        ("num_tokens", I32), ("num_q_heads", I32), ("num_kv_heads", I32), ("head_dim", I32),
        ("block_size", I32), ("num_threads", I32),
        ("q_norm", PTR), ("k_norm", PTR), ("q_norm_eps", ctypes.c_float), ("k_norm_eps", ctypes.c_float),
        ("skip_rotary", I32), ("rotary_dim", I32), ("unit_offset", I32), ("num_slots", I64),
        ("kv_dtype", I32), ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float),
    ]  # fmt: skip


@cache
def _fused() -> ctypes.CDLL:
    lib = _library()
    lib.pb_cpu_add_rms_norm.argtypes = [PTR, I64, PTR, ctypes.c_float, PTR, I64, PTR, PTR, I64, I32, I32, I32,
                                        ctypes.c_float, I32, I32]  # fmt: skip
    lib.pb_cpu_act_mul.argtypes = [PTR, I64, PTR, I64, PTR, I64, I32, I32, I32, I32, I32]
    lib.pb_cpu_rotary_cache.argtypes = [ctypes.POINTER(RotaryCacheArgs), I32]
    lib.pb_cpu_fused_error_string.argtypes = [ctypes.c_int]
    lib.pb_cpu_fused_error_string.restype = ctypes.c_char_p
    check_layouts(lib, {RotaryCacheArgs: "pb_cpu_rotary_cache_args_size"}, "csrc/cpu")
    return lib


def _check(status: int, what: str) -> None:
    check_status(status, _fused().pb_cpu_fused_error_string, what)


def add_rms_norm(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
    *, x_weight: torch.Tensor | None = None, x_scale: float = 1.0, unit_offset: bool = False,
) -> torch.Tensor:
    """`residual += x` in place (skipped when `x` is None; `x` RMS-normed with `x_weight` first where given, Gemma's
    post-norms, or times `x_scale`, Granite's residual multiplier), then `weight * rms_normalize(residual)` `[T, H]`.
    `unit_offset`: Gemma's norms, which scale by `1 + weight` in fp32 and round once, where Llama's round the
    normalized value, then multiply in the dtype."""
    rows, hidden = residual.shape
    out = torch.empty_like(residual) if out is None else out
    _check(
        _fused().pb_cpu_add_rms_norm(
            None if x is None else x.data_ptr(), 0 if x is None else x.stride(0),
            None if x_weight is None else x_weight.data_ptr(), x_scale,
            residual.data_ptr(), residual.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
            rows, hidden, QUERY_DTYPES[residual.dtype], eps, int(unit_offset), torch.get_num_threads(),
        ),
        "add_rms_norm",
    )  # fmt: skip
    return out


SILU, GELU_TANH = 0, 1  # PbCpuActivation
ACTIVATIONS = {"silu": SILU, "gelu_pytorch_tanh": GELU_TANH}  # by transformers' names (`hidden_act`)


def act_mul(gate: torch.Tensor, up: torch.Tensor, activation: int = SILU) -> torch.Tensor:
    """`act(gate) * up` for `[T, I]` rows: SiLU, or GELU with the tanh approximation (Gemma)."""
    rows, width = gate.shape
    out = torch.empty(rows, width, dtype=gate.dtype)
    _check(
        _fused().pb_cpu_act_mul(
            gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), out.stride(0),
            rows, width, QUERY_DTYPES[gate.dtype], activation, torch.get_num_threads(),
        ),
        "act_mul",
    )  # fmt: skip
    return out


Norm = tuple[torch.Tensor, float]  # an RMSNorm's (weight, eps)


@dataclass(frozen=True)
class HeadPrep:
    """What a layer does to each q and k head on the way to attention besides the step's rotary: Qwen3's and Gemma 3's
    per-head RMSNorms before it (q_norm, k_norm: (weight [D], eps); `unit_offset`: Gemma's kind, see `add_rms_norm`),
    and SmolLM3's NoPE layers, which skip it."""

    q_norm: Norm | None = None
    k_norm: Norm | None = None
    rotary: bool = True
    unit_offset: bool = False

    @cached_property  # read for every layer of every step on the Python loop: built once per prep
    def fields(self) -> dict:
        """This prep as the kernels' struct fields (RotaryCacheArgs, and each PbCpuDecoderLayer)."""
        (q_norm, q_eps), (k_norm, k_eps) = (
            (None, 0.0) if norm is None else (norm[0].data_ptr(), norm[1]) for norm in (self.q_norm, self.k_norm)
        )
        return dict(q_norm=q_norm, k_norm=k_norm, q_norm_eps=q_eps, k_norm_eps=k_eps, skip_rotary=int(not self.rotary),
                    unit_offset=int(self.unit_offset))  # fmt: skip


PLAIN = HeadPrep()  # Llama's: rotary only


class RotaryCache:
    """Rotary on q and k, and the pool write of k and v, for every layer of one step.

    The step's cos/sin `[T, R]`, slot mapping and shapes go into the kernel's argument struct once; each layer
    then sets only its own tensors, which keeps the per-layer cost to the call itself. The first R dims of each head
    rotate (R = `head_dim` unless the model's rotary is partial, as Phi-4-mini's), the rest pass."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
                 head_dim: int | None = None, num_slots: int = 0, kv_dtype: torch.dtype | None = None) -> None:  # fmt: skip
        """`num_slots` and `kv_dtype` (the pools'; None: cos's): for the C++ layer loop, which takes the struct as
        is (a call here reads both from the pools). The kernel refuses any slot at or past `num_slots`, so 0 refuses
        every write."""
        self._keep = (cos, sin, slot_mapping)  # the struct points into them
        self.args = RotaryCacheArgs(
            cos=cos.data_ptr(), sin=sin.data_ptr(), slot_mapping=slot_mapping.data_ptr(),
            num_tokens=cos.shape[0], head_dim=head_dim or cos.shape[1], block_size=block_size,
            num_threads=torch.get_num_threads(), rotary_dim=cos.shape[1], num_slots=num_slots,
            kv_dtype=KV_DTYPES[kv_dtype or cos.dtype],
        )  # fmt: skip
        self.dtype = QUERY_DTYPES[cos.dtype]

    def __call__(self, query, key, value, key_cache, value_cache, prep: HeadPrep = PLAIN,
                 kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:  # fmt: skip
        """Rotated `query [T, Hq, D]` (a new tensor) after storing rotated keys and the values in the pools; `prep`
        adds the layer's per-head norms first, or skips the rotary. fp8 pools store k / k_scale and v / v_scale
        (`kv_scales`), saturated and rounded as `reference.to_fp8`."""
        args, head_dim = self.args, self.args.head_dim
        args.kv_dtype, (args.k_scale, args.v_scale) = KV_DTYPES[key_cache.dtype], kv_scales
        for name, field in prep.fields.items():
            setattr(args, name, field)
        out = torch.empty(query.shape[0], query.shape[1] // head_dim, head_dim, dtype=query.dtype)
        args.query, args.q_stride = query.data_ptr(), query.stride(0)
        args.key, args.k_stride = key.data_ptr(), key.stride(0)
        args.value, args.v_stride = value.data_ptr(), value.stride(0)
        args.query_out, args.key_cache, args.value_cache = out.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr()
        args.k_stride_block, args.k_stride_slot, args.k_stride_head = key_cache.stride()[:3]
        args.v_stride_block, args.v_stride_slot, args.v_stride_head = value_cache.stride()[:3]
        args.num_q_heads, args.num_kv_heads = out.shape[1], key.shape[1] // head_dim
        args.num_slots = key_cache.shape[0] * key_cache.shape[1]
        _check(_fused().pb_cpu_rotary_cache(ctypes.byref(args), self.dtype), "rotary_cache")
        return out


# The torch oracles: transformers' Llama (and Gemma) modules, op for op.


def rms_norm_reference(x, weight, eps, unit_offset: bool = False) -> torch.Tensor:
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:  # Gemma: (x * (1 + w)) in fp32, then the dtype
        return (hidden * (1.0 + weight.float())).type_as(x)
    return weight * hidden.to(x.dtype)


def add_rms_norm_reference(x, residual, weight, eps, x_weight=None, unit_offset: bool = False,
                           x_scale: float = 1.0) -> torch.Tensor:  # fmt: skip
    if x is not None:
        if x_weight is not None:
            x = rms_norm_reference(x, x_weight, eps, unit_offset)
        residual.copy_(residual + (x * x_scale if x_scale != 1.0 else x))  # Granite: residual + out * multiplier
    return rms_norm_reference(residual, weight, eps, unit_offset)


def act_mul_reference(gate, up, activation: int = SILU) -> torch.Tensor:
    if activation == GELU_TANH:  # Gemma's MLP: up * act(gate), the same product
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    return torch.nn.functional.silu(gate) * up


def rotary_cache_reference(query, key, value, cos, sin, key_cache, value_cache, slot_mapping,
                           prep: HeadPrep = PLAIN, head_dim: int | None = None,
                           kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:  # fmt: skip
    def rotate(x):  # [T, H, D] with cos/sin [T, 1, R]: the first R dims rotate, the rest pass (partial rotary)
        if not prep.rotary:  # SmolLM3's NoPE layers
            return x
        x, rest = x[..., : cos.shape[-1]], x[..., cos.shape[-1] :]
        half = x.shape[-1] // 2
        turned = x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]
        return torch.cat((turned, rest), dim=-1)

    def normed(x, norm):  # Qwen3's and Gemma 3's q_norm/k_norm: an RMSNorm over each head
        return x if norm is None else rms_norm_reference(x, *norm, prep.unit_offset)

    head_dim = head_dim or cos.shape[1]
    q = rotate(normed(query.reshape(query.shape[0], -1, head_dim), prep.q_norm))
    k = rotate(normed(key.reshape(key.shape[0], -1, head_dim), prep.k_norm))
    v = value.reshape(value.shape[0], -1, head_dim)
    stored = slot_mapping >= 0
    for source, pool, scale in ((k, key_cache, kv_scales[0]), (v, value_cache, kv_scales[1])):
        if is_fp8(pool.dtype):  # index_put takes no fp8: the raw bytes
            rows = to_fp8(source[stored], pool.dtype, scale).view(torch.uint8)
            pool.view(torch.uint8).view(-1, *pool.shape[2:])[slot_mapping[stored]] = rows
        else:
            pool.view(-1, *pool.shape[2:])[slot_mapping[stored]] = source[stored]
    return q
