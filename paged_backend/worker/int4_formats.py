"""AWQ and GPTQ int4 checkpoints as their formats define them: the `quantization_config` they carry, and their
packed tensors unpacked into int4 values with per-group scales and zero points.

Both formats store a linear layer's weight as  weight[o, i] = (q[o, i] - zero[g(i), o]) * scale[g(i), o],  q and
zero in 0..15, eight 4-bit values to an int32 word, nibble j in bits 4j..4j+3. They differ in how they pack:

- AWQ GEMM: `qweight` [in, out/8] packs along the output dim with the interleaved column order
  (0, 2, 4, 6, 1, 3, 5, 7) within each word; `qzeros` [in/group, out/8] the same way; `scales` [in/group, out];
  groups are consecutive input channels.
- GPTQ: `qweight` [in/8, out] packs along the input dim in plain order; `qzeros` [groups, out/8] along the output
  dim in plain order; `scales` [groups, out]; `g_idx` [in] names each input channel's group (with act-order,
  desc_act, they need not be consecutive). GPTQ v1 (`checkpoint_format` "gptq") stores zero - 1, v2 the zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_backend.errors import InvalidRequest, UnsupportedModel

BITS = 4
NIBBLE_SHIFTS = torch.arange(0, 32, BITS, dtype=torch.int32)
AWQ_COLUMN_OF_NIBBLE = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column 8w + this[j]
AWQ_FORMATS = ("gemm",)  # gemv / gemv_fast / llm-awq interleave for their own GPU kernels
GPTQ_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what to add to a stored zero


def _setting(saved: dict, *names: str, default=None):
    """The first of `names` present in the config (exporters and transformers versions spell some keys differently)."""
    return next((saved[name] for name in names if saved.get(name) is not None), default)


def _format(saved: dict, method: str) -> str:
    keys = ("version", "format") if method == "awq" else ("checkpoint_format", "format")
    return str(_setting(saved, *keys, default="gemm" if method == "awq" else "gptq")).lower()


def saved_settings(config) -> dict:
    """A checkpoint config's `quantization_config` as a dict (transformers may hold it as a config object)."""
    saved = config.quantization_config
    return saved if isinstance(saved, dict) else saved.to_dict()


def is_marlin_format(saved: dict) -> bool:
    """Whether an AWQ/GPTQ config says its weights are repacked for the Marlin GPU kernel."""
    method = str(saved.get("quant_method", "")).lower()
    return bool(saved.get("is_marlin_format")) or _format(saved, method) == "marlin"


@dataclass(frozen=True)
class Int4Scheme:
    """What an AWQ/GPTQ checkpoint's `quantization_config` says about its quantized linear layers."""

    method: str  # "awq" | "gptq"
    group_size: int  # input channels per group; -1: one group spans the whole input
    zero_offset: int  # added to each stored zero point (GPTQ v1 stores zero - 1)

    @classmethod
    def from_config(cls, saved: dict) -> Int4Scheme:
        """Read and check a checkpoint's `quantization_config`; what CPU cannot load is refused with a sentence."""
        method = str(saved.get("quant_method", "")).lower()
        bits = int(_setting(saved, "bits", "w_bit", default=BITS))
        if bits != BITS:
            raise UnsupportedModel(
                f"the checkpoint is {bits}-bit {method.upper()}; on CPU paged-backend loads 4-bit AWQ and GPTQ "
                f"checkpoints only (other widths need a CUDA GPU and gptqmodel)"
            )
        if str(saved.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
            raise UnsupportedModel(
                f"the checkpoint packs its int4 values into {saved['pack_dtype']}; on CPU paged-backend reads "
                f"int32-packed AWQ/GPTQ checkpoints only (re-export with pack_dtype=int32)"
            )
        layout = _format(saved, method)
        if method == "awq" and layout not in AWQ_FORMATS:
            raise UnsupportedModel(
                f"AWQ version {layout!r} packs its weights for a GPU kernel; on CPU paged-backend loads "
                f"GEMM-packed AWQ checkpoints (version 'gemm')"
            )
        if method == "gptq" and layout not in GPTQ_ZERO_OFFSETS:
            raise UnsupportedModel(
                f"GPTQ checkpoint_format {layout!r} is not one CPU can read; paged-backend loads "
                f"{' and '.join(map(repr, GPTQ_ZERO_OFFSETS))} GPTQ checkpoints"
            )
        group_size = int(_setting(saved, "group_size", "q_group_size", default=128))
        zero_offset = GPTQ_ZERO_OFFSETS[layout] if method == "gptq" else 0
        return cls(method, group_size, zero_offset)

    def unpack(self, layer: str, tensors: dict[str, torch.Tensor], in_features: int, out_features: int) -> Int4Weight:
        """A layer's `qweight`, `qzeros`, `scales` (and GPTQ's `g_idx`) -> its int4 values, zeros and scales.

        `layer` names it in the errors a malformed checkpoint gets."""
        for name in ("qweight", "qzeros", "scales"):
            if name not in tensors:
                raise InvalidRequest(
                    f"the checkpoint is malformed: {layer} has {', '.join(sorted(tensors))} but no {name}; "
                    f"a {self.method.upper()} layer needs qweight, qzeros and scales (re-export the model)"
                )
        group_size = in_features if self.group_size == -1 else self.group_size
        num_groups = -(-in_features // group_size)
        packed = out_features // 8
        if self.method == "awq":
            expected = {"qweight": (in_features, packed), "qzeros": (num_groups, packed)}
        else:
            expected = {"qweight": (in_features // 8, out_features), "qzeros": (num_groups, packed)}
        expected["scales"] = (num_groups, out_features)
        if self.method == "gptq" and "g_idx" in tensors:
            expected["g_idx"] = (in_features,)
        for name, shape in expected.items():
            if tuple(tensors[name].shape) != shape:
                raise InvalidRequest(
                    f"the checkpoint is malformed: {layer}.{name} has shape {tuple(tensors[name].shape)}, but a "
                    f"{in_features}->{out_features} layer in {self.method.upper()} int4 with group size "
                    f"{group_size} needs {shape}"
                )
        consecutive = torch.arange(in_features) // group_size
        if self.method == "awq":
            values, zeros = _awq_columns(tensors["qweight"]).T, _awq_columns(tensors["qzeros"])
            groups = consecutive
        else:
            values, zeros = _nibbles(tensors["qweight"].T), _nibbles(tensors["qzeros"])
            groups = tensors["g_idx"].long() if "g_idx" in tensors else consecutive
            if groups.min() < 0 or groups.max() >= num_groups:
                raise InvalidRequest(
                    f"the checkpoint is malformed: {layer}.g_idx names groups outside 0..{num_groups - 1}"
                )
        return Int4Weight(values, zeros.int() + self.zero_offset, tensors["scales"], groups)


@dataclass(frozen=True)
class Int4Weight:
    """One linear layer's int4 weight: weight[o, i] = (values[o, i] - zeros[groups[i], o]) * scales[groups[i], o]."""

    values: torch.Tensor  # [out, in] uint8, 0..15
    zeros: torch.Tensor  # [num_groups, out] int32 (a GPTQ v1 zero already has its offset added, so it may be 16)
    scales: torch.Tensor  # [num_groups, out], the checkpoint's float dtype
    groups: torch.Tensor  # [in] int64: each input channel's group

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [out, in] of the nn.Linear, computed in float32 and rounded once to `dtype`."""
        zeros, scales = self.zeros[self.groups].T, self.scales[self.groups].T.float()
        return ((self.values.int() - zeros).float() * scales).to(dtype)

    def consecutive_group_size(self) -> int | None:
        """The group size when every group is a run of consecutive input channels of one size (what per-group int4
        kernels need), else None (GPTQ act-order)."""
        in_features, num_groups = self.values.shape[1], self.scales.shape[0]
        if in_features % num_groups:
            return None
        size = in_features // num_groups
        return size if torch.equal(self.groups, torch.arange(in_features) // size) else None


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 words [..., n] -> their 4-bit values [..., 8n] as uint8, nibble j of word w at 8w + j."""
    values = (packed.int().unsqueeze(-1) >> NIBBLE_SHIFTS) & 0xF
    return values.flatten(-2).to(torch.uint8)


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's words [rows, out/8] -> values [rows, out] in column order, undoing the interleave within each word."""
    nibbles = _nibbles(packed).unflatten(-1, (-1, 8))
    columns = torch.empty_like(nibbles)
    columns[..., list(AWQ_COLUMN_OF_NIBBLE)] = nibbles
    return columns.flatten(-2)
