"""Linear layers on weights packed into 16-column panels (csrc/cpu/panel_linear_cpu.cpp), and the torch oracle.

`PanelWeight(weight)` packs an `nn.Linear` weight `[N, K]` once; calling it with `(x, bias)` is `F.linear(x, weight,
bias)` on it, for float32 or bfloat16 on CPU, any number of rows. At one or two rows (a decode step) it streams
the weights at the core's memory bandwidth, ~1.6x oneDNN's prepacked sgemm; from a few rows up to prefill sizes
it matches oneDNN (`benchmarks/packed_linear.py`). Each output is one multiply-add chain over K in order, so a
row's result does not depend on the other rows in the call.

>>> packed = PanelWeight(layer.weight)     # doctest: +SKIP
>>> y = packed(x, layer.bias)              # == F.linear(x, layer.weight, layer.bias) up to summation order

On CPUs with AMX (Intel Sapphire Rapids and later) bfloat16 weights whose K is a multiple of 32 run on the tile unit,
at every row count (`ops.cpu.amx_tiles()`; `PAGED_BACKEND_CPU_AMX=0` keeps the AVX-512 tiles): its sums are its own, not
rounded after each multiply-add, so the bits differ from the AVX-512 tiles', yet a row's result still depends on
nothing but that row.

`PanelWeight.quantized(q, scale, bits, dtype, group_size, offset)` packs weight-only quantized weights for activations
of `dtype`: int8 (a byte per weight, a scale per output, torchao's int8_weight_only, or per output and group of K,
GGUF's Q8_0, Q6_K and Q5_0; and an offset per group, GGUF's Q5_1 and Q5_K) or int4 (0 to 15, two a byte, a scale and
an offset per output and group of K: GGUF's Q4_0, Q4_1, Q4_K, Q3_K and Q2_K, and torchao's int4_weight_only shifted by
8). The kernel dequantizes each line in registers, q * scale (+ offset) in one float32 rounding and then the
activations' dtype, as those formats' dequantization does: so the result has the bits of `PanelWeight(the dequantized
weight in dtype)`.
"""

from __future__ import annotations

import ctypes
import math
from functools import cache
from typing import NamedTuple

import torch
import torch.nn.functional as F

from paged_backend.ops._c_abi import I32, I64, PTR, check_status
from paged_backend.ops.cpu import QUERY_DTYPES, _library

PANEL_DTYPES = (torch.float32, torch.bfloat16)
LANES = 16  # outputs per panel (the kernel's kLanes)


@cache
def _panel() -> ctypes.CDLL:
    lib = _library()
    lib.pb_cpu_panel_packed_elements.argtypes = [I64, I64, I32]
    lib.pb_cpu_panel_packed_elements.restype = I64
    lib.pb_cpu_panel_pack.argtypes = [PTR, I64, I64, I32, PTR]
    lib.pb_cpu_panel_linear.argtypes = [PTR, I64, PTR, PTR, PTR, I64, I64, I64, I64, I32, I32]
    lib.pb_cpu_panel_pack_int8.argtypes = [PTR, I64, I64, I32, PTR]
    lib.pb_cpu_panel_pack_int4.argtypes = [PTR, I64, I64, I32, PTR]
    lib.pb_cpu_panel_linear_quantized.argtypes = [
        PTR, I64, PTR, I32, PTR, I64, I32, PTR, PTR, PTR, I64, I64, I64, I64, I32, I32
    ]
    lib.pb_cpu_panel_error_string.argtypes = [ctypes.c_int]
    lib.pb_cpu_panel_error_string.restype = ctypes.c_char_p
    return lib


def _check(status: int, what: str) -> None:
    check_status(status, _panel().pb_cpu_panel_error_string, what)


class QuantizedWeight(NamedTuple):
    """A weight-only quantized weight as the quantized panels take it: each weight q * scale (+ offset), rounded once
    in float32 (see `PanelWeight.quantized` for the shapes)."""

    bits: int  # 8: int8 q; 4: uint8 q from 0 to 15
    q: torch.Tensor  # [N, K]
    scale: torch.Tensor  # [N] (group_size 0) or [N, K / group_size]
    group_size: int
    offset: torch.Tensor | None = None  # like scale, or none
    levels: torch.Tensor | None = None  # 4 bits: the 16 values q stands for (IQ4's), or none: q itself

    def panels(self, dtype: torch.dtype) -> PanelWeight:
        """Packed for activations of `dtype`."""
        return PanelWeight.quantized(self.q, self.scale, self.bits, dtype, self.group_size, self.offset, self.levels)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight `[N, K]` the panels compute with (what a check compares with a model's own weight)."""
        rows, columns = self.q.shape
        groups = columns // self.group_size if self.group_size else 1
        q = self.q.float() if self.levels is None else self.levels.float()[self.q.long()]
        q = q.view(rows, groups, -1)
        scale = self.scale.float().reshape(rows, groups, 1)
        if self.offset is None:
            return (q * scale).view(rows, columns)
        return torch.addcmul(self.offset.float().reshape(rows, groups, 1), q, scale).view(rows, columns)


class PanelWeight:
    """A weight `[N, K]` packed into panels; calling it with `x [..., K]` gives `[..., N]`."""

    # Quantized weights: their float32 scales [panel][group][16] (with `offsets`, always for int4:
    # [panel][group][2][16], scales then offsets; zero past the last output), `bits` (8 or 4) and the weights along K
    # per group (0: one group, a scale per output).
    scales: torch.Tensor | None = None
    bits: int = 0
    group_size: int = 0
    offsets: bool = False
    levels: torch.Tensor | None = None  # int4: the 16 float32 values of q (IQ4's levels); none: 0 to 15

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype not in PANEL_DTYPES or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"panel linear packs 2-D CPU float32/bfloat16 weights, not {weight.dtype} {weight.shape}")
        self.out_features, self.in_features = weight.shape
        self.dtype, self.code = weight.dtype, QUERY_DTYPES[weight.dtype]
        self.packed = torch.empty(_packed_elements(*weight.shape, weight.dtype), dtype=weight.dtype)
        source = weight.detach().contiguous()
        _check(_panel().pb_cpu_panel_pack(source.data_ptr(), *weight.shape, self.code, self.packed.data_ptr()), "pack")

    @classmethod
    def quantized(cls, q: torch.Tensor, scale: torch.Tensor, bits: int, dtype: torch.dtype, group_size: int = 0,
                  offset: torch.Tensor | None = None, levels: torch.Tensor | None = None) -> PanelWeight:  # fmt: skip
        """Weight-only quantized weights `q [N, K]` for activations of `dtype`, each weight q * scale (+ offset):
        - `bits` 8: int8 q, a byte per weight; `scale` one float per output (`group_size` 0, torchao's
          int8_weight_only) or `[N, K / group_size]`, one per output and group of K (GGUF's Q8_0); `offset` none, or
          like `scale` (GGUF's Q5_1);
        - `bits` 4: uint8 q from 0 to 15, two a byte; `scale` (and `offset`) `[N, K / group_size]` (GGUF's Q4_1);
          `levels`: 16 values q stands for instead of itself (IQ4_NL's non-uniform ones), levels[q] * scale."""
        if bits not in (8, 4):  # (before anything that reads the bits)
            raise ValueError(f"quantized panels hold 8 or 4 bits a weight, not {bits}")
        storage = torch.int8 if bits == 8 else torch.uint8
        if q.dtype != storage or q.device.type != "cpu" or q.dim() != 2 or dtype not in PANEL_DTYPES:
            raise ValueError(f"int{bits} panels pack 2-D CPU {str(storage)[6:]} weights{' (0 to 15)' * (bits == 4)} "
                             f"for float32/bfloat16 activations, not {q.dtype} {tuple(q.shape)} for {dtype}")  # fmt: skip
        if bits == 4 and group_size == 0:
            raise ValueError("int4 panels take a scale per output and group of K: give a group size")
        if levels is not None and (bits != 4 or levels.numel() != 16):
            raise ValueError(f"levels are the 16 values of an int4 q, not {levels.numel()} for int{bits}")
        out_features, in_features = q.shape
        for name, tensor in (("scales", scale), ("offsets", offset)):
            if group_size == 0 and tensor is not None and tensor.numel() != out_features:
                raise ValueError(f"int{bits} panels take one scale per output: {tensor.numel()} {name} for "
                                 f"{out_features} outputs")  # fmt: skip
        if group_size and (group_size < 2 or group_size % 2 or in_features % group_size):
            raise ValueError(f"int{bits} panels take an even group size dividing K = {in_features}, not {group_size}")
        groups = in_features // group_size if group_size else 1
        for name, tensor in (("scales", scale), ("offsets", offset)):
            if group_size and tensor is not None and tuple(tensor.shape) != (out_features, groups):
                raise ValueError(f"int{bits} panels take {name} [{out_features}, {groups}] (outputs, groups), not "
                                 f"{tuple(tensor.shape)}")  # fmt: skip
        elements = _packed_elements(out_features, in_features, dtype)
        packed = torch.empty(elements * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8)
        pack = _panel().pb_cpu_panel_pack_int8 if bits == 8 else _panel().pb_cpu_panel_pack_int4
        source = q.detach().contiguous()
        _check(pack(source.data_ptr(), out_features, in_features, QUERY_DTYPES[dtype], packed.data_ptr()),
               f"pack int{bits}")  # fmt: skip
        parts = [scale] if offset is None else [scale, offset]
        scales = _panel_scales([part.reshape(out_features, groups) for part in parts])
        levels = None if levels is None else levels.detach().float().contiguous().reshape(16)
        return cls._over(packed, out_features, in_features, dtype, scales, bits, group_size, offset is not None, levels)

    @classmethod
    def _over(cls, packed: torch.Tensor, out_features: int, in_features: int, dtype: torch.dtype | None = None,
              scales: torch.Tensor | None = None, bits: int = 0, group_size: int = 0, offsets: bool = False,
              levels: torch.Tensor | None = None) -> PanelWeight:  # fmt: skip
        """A weight over panels packed already (a slice of a stacked group); quantized ones with their scales."""
        weight = cls.__new__(cls)
        weight.out_features, weight.in_features, weight.packed, weight.scales = out_features, in_features, packed, scales
        weight.bits, weight.group_size, weight.offsets, weight.levels = bits, group_size, offsets, levels
        weight.dtype = dtype or packed.dtype  # the activations' dtype: int8 panels serve float32 or bfloat16 rows
        weight.code = QUERY_DTYPES[weight.dtype]
        return weight

    @classmethod
    def stack(cls, parts: list[PanelWeight]) -> PanelWeight | None:
        """One weight for layers that read the same input (q, k and v; gate and up), so a step calls one kernel
        instead of several: their panels concatenated, each part re-pointed at its own slice of them (the group costs
        no memory). Quantized parts of one width but other groups or offsets (a GGUF file's Q5_1 q and k beside a
        Q8_0 v) first take the finest group and offsets (`_regrouped`: the same values). None when the parts cannot
        stack: another width, dtype or bits, or a part other than the last ending in a partial panel (its padding
        would sit inside the group's output)."""
        first = parts[0]
        kinds = {(part.in_features, part.dtype, part.packed.dtype, part.bits, _values(part.levels)) for part in parts}
        if len(kinds) > 1 or any(part.out_features % LANES for part in parts[:-1]):
            return None
        group_size, offsets = first.group_size, first.offsets
        if first.scales is not None:
            sizes = [part.group_size for part in parts]  # (0: a scale per output, one group of all K)
            group_size = math.gcd(*(size or first.in_features for size in sizes)) if any(sizes) else 0
            offsets = any(part.offsets for part in parts)
            for part in parts:
                part._regrouped(group_size, offsets)
        scales = None if first.scales is None else torch.cat([part.scales for part in parts])
        group = cls._over(torch.cat([part.packed for part in parts]), sum(p.out_features for p in parts),
                          first.in_features, first.dtype, scales, first.bits, group_size, offsets,
                          first.levels)  # fmt: skip
        offset, scale_offset = 0, 0
        for part in parts:
            size = part.packed.numel()
            part.packed = group.packed[offset : offset + size]
            offset += size
            if scales is not None:
                part.scales = scales[scale_offset : scale_offset + part.scales.numel()]
                scale_offset += part.scales.numel()
        return group

    def _regrouped(self, group_size: int, offsets: bool) -> None:
        """The same quantized weight with scales per `group_size` weights (a divisor of this one's: each group's
        scale repeated) and, with `offsets`, an offset per group: -0 where it had none, and q * scale + -0 is q *
        scale to the bit."""
        if (group_size, offsets) == (self.group_size, self.offsets):
            return
        groups = self.in_features // self.group_size if self.group_size else 1
        scales = self.scales.view(_panels(self.out_features), groups, 1 + self.offsets, LANES)
        if offsets and not self.offsets:
            scales = torch.cat([scales, torch.full_like(scales, -0.0)], dim=2)
        if group_size != self.group_size:
            scales = scales.repeat_interleave((self.group_size or self.in_features) // group_size, dim=1)
        self.scales, self.group_size, self.offsets = scales.contiguous().view(-1), group_size, offsets

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight (`[...]` -> `[..., K]`, the activations' dtype) as the kernel computes with them:
        the panels' values, dequantized to q * scale (+ offset) in float32 where quantized (what an embedding tied to
        this weight reads instead of holding its own copy). Only the panels holding those rows are read."""
        flat = ids.reshape(-1).long()
        panel, lane = flat // LANES, flat % LANES
        pair = 2 if self.dtype == torch.bfloat16 else 1  # k values per 32-bit lane in the layout
        k_len = -(-self.in_features // pair) * pair
        panels = _panels(self.out_features)
        if self.bits == 4:  # lines of 32 values in 16 bytes: value i in byte i % 16, the high half from 16 on
            held, which = panel.unique(return_inverse=True)  # each panel unpacked once, however many of its rows
            lines = self.packed.view(panels, k_len * LANES // 32, 16)[held]
            values = torch.cat([lines & 15, lines >> 4], dim=-1).view(-1, k_len // pair, LANES, pair)
            values = values[which, :, lane]
            if self.levels is not None:
                values = self.levels[values.long()]
        else:
            values = self.packed.view(panels, k_len // pair, LANES, pair)[panel, :, lane]  # [n, k_len / pair, pair]
        values = values.reshape(-1, k_len)[:, : self.in_features]
        if self.scales is not None:
            groups = self.in_features // self.group_size if self.group_size else 1
            scales = self.scales.view(panels, groups, 1 + self.offsets, LANES)[panel, :, :, lane]  # [n, groups, parts]
            weights = values.float().view(flat.numel(), groups, -1) * scales[..., :1]
            if self.offsets:
                weights = weights + scales[..., 1:]  # (the product is exact wherever a GGUF offset follows it)
            values = weights.view(-1, self.in_features).to(self.dtype)
        return values.view(*ids.shape, self.in_features)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != self.dtype or x.shape[-1] != self.in_features:
            raise ValueError(f"input {x.dtype} [..., {x.shape[-1]}] for a {self.dtype} weight of {self.in_features}")
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype)
        bias = panel_bias(bias, x.dtype)
        shape = (rows.shape[0], self.out_features, self.in_features, self.code, torch.get_num_threads())
        bias_pointer = None if bias is None else bias.data_ptr()
        if self.scales is None:
            status = _panel().pb_cpu_panel_linear(rows.data_ptr(), rows.stride(0), self.packed.data_ptr(),
                                                  bias_pointer, out.data_ptr(), out.stride(0), *shape)  # fmt: skip
        else:
            status = _panel().pb_cpu_panel_linear_quantized(rows.data_ptr(), rows.stride(0), self.packed.data_ptr(),
                                                            self.bits, self.scales.data_ptr(), self.group_size,
                                                            int(self.offsets), _pointer(self.levels), bias_pointer,
                                                            out.data_ptr(), out.stride(0), *shape)  # fmt: skip
        _check(status, "panel linear")
        return out.view(*x.shape[:-1], self.out_features)


def panel_bias(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The bias as the kernel reads it: contiguous, in the weights' dtype (nn.Linear's own bias passes as is)."""
    if bias is None or (bias.dtype == dtype and bias.is_contiguous()):
        return bias
    return bias.detach().to(dtype).contiguous()


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _values(levels: torch.Tensor | None) -> tuple | None:
    """Levels as a comparable value (parts stack only with the same ones)."""
    return None if levels is None else tuple(levels.tolist())


def _panels(out_features: int) -> int:
    return -(-out_features // LANES)


def _panel_scales(parts: list[torch.Tensor]) -> torch.Tensor:
    """Scales (and offsets) `[N, groups]` as the kernel reads them: float32 `[panel][group][part][16]`, zero past the
    last output."""
    out_features, groups = parts[0].shape
    padded = torch.zeros(_panels(out_features) * LANES, groups, len(parts))
    padded[:out_features] = torch.stack([part.detach().float() for part in parts], dim=-1)
    return padded.view(-1, LANES, groups, len(parts)).permute(0, 2, 3, 1).contiguous().view(-1)


def _packed_elements(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    return _panel().pb_cpu_panel_packed_elements(out_features, in_features, QUERY_DTYPES[dtype])


def panel_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: torch's own linear layer."""
    return F.linear(x, weight, bias)
