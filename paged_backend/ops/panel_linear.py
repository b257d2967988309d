"""Linear layers on weights packed into 16-column panels (csrc/cpu/panel_linear_cpu.cpp), and the torch oracle.

`PanelWeight(weight)` packs an `nn.Linear` weight `[N, K]` once; calling it with `(x, bias)` is `F.linear(x, weight,
bias)` on it, for float32 or bfloat16 on CPU, any number of rows. At one or two rows (a decode step) it streams
the weights at the core's memory bandwidth, ~1.6x oneDNN's prepacked sgemm; from a few rows up to prefill sizes
it matches oneDNN (`benchmarks/packed_linear.py`). Each output is one multiply-add chain over K in order, so a
row's result does not depend on the other rows in the call.

>>> packed = PanelWeight(layer.weight)     # doctest: +SKIP
>>> y = packed(x, layer.bias)              # == F.linear(x, layer.weight, layer.bias) up to summation order
"""

from __future__ import annotations

import ctypes
from functools import cache

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
    lib.pb_cpu_panel_error_string.argtypes = [ctypes.c_int]
    lib.pb_cpu_panel_error_string.restype = ctypes.c_char_p
    return lib


def _check(status: int, what: str) -> None:
    check_status(status, _panel().pb_cpu_panel_error_string, what)


class PanelWeight:
    """A weight `[N, K]` packed into panels; calling it with `x [..., K]` gives `[..., N]`."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype not in PANEL_DTYPES or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"panel linear packs 2-D CPU float32/bfloat16 weights, not {weight.dtype} {weight.shape}")
        self.out_features, self.in_features = weight.shape
        self.dtype, self.code = weight.dtype, QUERY_DTYPES[weight.dtype]
        self.packed = torch.empty(_packed_elements(*weight.shape, weight.dtype), dtype=weight.dtype)
        source = weight.detach().contiguous()
        _check(_panel().pb_cpu_panel_pack(source.data_ptr(), *weight.shape, self.code, self.packed.data_ptr()), "pack")

    @classmethod
    def _over(cls, packed: torch.Tensor, out_features: int, in_features: int) -> PanelWeight:
        """A weight over panels packed already (a slice of a stacked group)."""
        weight = cls.__new__(cls)
        weight.out_features, weight.in_features, weight.packed = out_features, in_features, packed
        weight.dtype, weight.code = packed.dtype, QUERY_DTYPES[packed.dtype]
        return weight

    @classmethod
    def stack(cls, parts: list[PanelWeight]) -> PanelWeight | None:
        """One weight for layers that read the same input (q, k and v; gate and up), so a step calls one kernel
        instead of several: their panels concatenated, each part re-pointed at its own slice of them (the group costs
        no memory). None when the parts cannot stack: another width or dtype, or a part other than the last
        ending in a partial panel (its padding would sit inside the group's output)."""
        first = parts[0]
        if any(part.in_features != first.in_features or part.dtype != first.dtype for part in parts):
            return None
        if any(part.out_features % LANES for part in parts[:-1]):
            return None
        group = cls._over(torch.cat([part.packed for part in parts]), sum(p.out_features for p in parts),
                          first.in_features)  # fmt: skip
        offset = 0
        for part in parts:
            size = part.packed.numel()
            part.packed = group.packed[offset : offset + size]
            offset += size
        return group

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != self.dtype or x.shape[-1] != self.in_features:
            raise ValueError(f"input {x.dtype} [..., {x.shape[-1]}] for a {self.dtype} weight of {self.in_features}")
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype)
        bias = panel_bias(bias, x.dtype)
        _check(
            _panel().pb_cpu_panel_linear(
                rows.data_ptr(), rows.stride(0), self.packed.data_ptr(), None if bias is None else bias.data_ptr(),
                out.data_ptr(), out.stride(0), rows.shape[0], self.out_features, self.in_features, self.code,
                torch.get_num_threads(),
            ),
            "panel linear",
        )  # fmt: skip
        return out.view(*x.shape[:-1], self.out_features)


def panel_bias(bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The bias as the kernel reads it: contiguous, in the weights' dtype (nn.Linear's own bias passes as is)."""
    if bias is None or (bias.dtype == dtype and bias.is_contiguous()):
        return bias
    return bias.detach().to(dtype).contiguous()


def _packed_elements(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    return _panel().pb_cpu_panel_packed_elements(out_features, in_features, QUERY_DTYPES[dtype])


def panel_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle: torch's own linear layer."""
    return F.linear(x, weight, bias)
