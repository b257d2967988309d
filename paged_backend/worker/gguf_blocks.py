"""A GGUF model's block-quantized linear weights, run as they ship.

`gguf_source` converts a GGUF file once into float32 safetensors, the exact values transformers' loader dequantizes,
and the model loads from them. The linear weights the file stores in blocks of a kind the panels take (DECODERS:
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS; SmolLM2's file: Q4_1 layers and a
Q8_0 embedding tied to the LM head; llama.cpp's Q4_K_M of it: Q5_0 and Q8_0 layers, Q4_K and Q6_K down projections)
are kept beside them too (`save`, into `BLOCKS_FILE`, rows in the HF weight's order). At load, `attach` hangs each
weight's blocks on it, and the panel packer (`packed_linear`) packs them into int4 panels (values of 2 to 4 bits, and
IQ4's indices into its 16 levels) or int8 panels (5 to 8 bits): a sixth to a quarter of the float32 bytes, the same
values, so the same tokens, bit for bit.

A block holds 32 weights of a row: a float16 scale d (Q4_1, Q5_1: and a minimum m) and 32 values q, a weight being
d * q + m (Q4_1, Q5_1), d * (q - 8) (Q4_0), d * (q - 16) (Q5_0) or d * q (Q8_0, q signed). The K-quants hold 256 in
groups of 32 (Q4_K, Q5_K) or 16 (Q2_K, Q3_K, Q6_K), each group's scale (and minimum) a float16 times a small integer,
exact in float32. The panels take q * scale (+ offset) rounded once, which is each of these to the bit (gguf-py's
dequantization rounds once too: d * q is exact where an offset follows). Blocks are used only where their
dequantization equals the loaded weight in its own dtype (checked at conversion and again at each load, ~0.5 s for
SmolLM2): a model never runs on values other than the ones it loaded. `packed_linear.pack_linears` frees them once
the layers are packed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from paged_backend.ops.panel_linear import QuantizedWeight

if TYPE_CHECKING:
    from gguf import GGUFReader

BLOCKS_FILE = "gguf_blocks.safetensors"  # beside model.safetensors in a conversion; transformers does not read it
BLOCK = 32  # weights per block in Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (the K-quants: 256)


def save(model: nn.Module, reader: GGUFReader, out: Path) -> None:
    """Write the blocks of a GGUF file (its `reader`; the DECODERS' kinds) that `model` (transformers' float32 load
    of it) holds as linear weights, keyed by the weights' names, into `out` (nothing when there are none). A weight whose
    tensor transformers cannot map or process on its own (an architecture gguf-py names otherwise, MoE experts that
    need the whole load) is left out: it runs on float panels, as every GGUF weight did before."""
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    stored = {tensor.name: tensor for tensor in reader.tensors if tensor.tensor_type.name in DECODERS}
    if not stored:
        return
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    try:
        names = get_gguf_hf_weights_map(model, processor)
    except (NotImplementedError, KeyError, ValueError):  # raised for an architecture gguf-py names otherwise
        return
    weights = _linear_weights(model)
    blocks, kinds = {}, {}
    for gguf_name, tensor in stored.items():
        if names.get(gguf_name) not in weights:
            continue
        try:  # llama's q/k rows back in HF's order; the rows of a block tensor permute like those of its values
            processed = processor.process(weights=np.asarray(tensor.data), name=gguf_name)
        except Exception:  # noqa: BLE001 - a processor that needs the whole load's context (MoE experts)
            continue
        name, rows = names.get(processed.name), processed.weights
        if name not in weights:
            continue
        kind = tensor.tensor_type.name
        if _matching(kind, rows, weights[name]) is not None:
            blocks[name] = torch.from_numpy(np.array(rows, dtype=np.uint8))
            kinds[name] = kind
    if blocks:
        save_file(blocks, str(out), metadata={"kinds": json.dumps(kinds)})


def attach(model: nn.Module, directory: Path) -> str | None:
    """Hang the blocks saved in `directory` on the CPU linear weights of `model` (loaded from that directory) whose
    value they give; a sentence saying how many, or None when there are none."""
    from safetensors import safe_open

    file = Path(directory) / BLOCKS_FILE
    if not file.is_file():
        return None
    weights = _linear_weights(model)
    used: dict[str, int] = {}
    refused = 0
    with safe_open(str(file), framework="pt") as blocks:
        kinds = json.loads(blocks.metadata()["kinds"])
        for name, kind in kinds.items():
            weight = weights.get(name)
            if weight is None or weight.device.type != "cpu":
                continue
            quantized = _matching(kind, blocks.get_tensor(name).numpy(), weight)
            if quantized is None:
                refused += 1
                continue
            weight.gguf_blocks = quantized, _fingerprint(weight)
            used[kind] = used.get(kind, 0) + 1
    if refused:
        print(f"paged-backend: {refused} saved GGUF block tensors do not give the loaded weights; those run as float "
              f"weights", file=sys.stderr)  # fmt: skip
    kinds_used = ", ".join(f"{count} {kind}" for kind, count in sorted(used.items()))
    return f"{sum(used.values())} linear weights run on their GGUF blocks ({kinds_used})" if used else None


def _linear_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's parameters by name (tied ones under each name) that are some linear layer's weight."""
    linear = {id(module.weight) for module in model.modules() if isinstance(module, nn.Linear)}
    return {name: p for name, p in model.named_parameters(remove_duplicate=False) if id(p) in linear}


def _matching(kind: str, rows: np.ndarray, weight: torch.Tensor) -> QuantizedWeight | None:
    """`rows`' blocks as the panels take them, if they fit `weight` and dequantize to its exact value in its dtype."""
    quantized = decoded(kind, rows, tuple(weight.shape))
    if quantized is None or not torch.equal(quantized.dequantized().to(weight.dtype), weight.detach()):
        return None
    return quantized


def source_of(weight: torch.Tensor) -> QuantizedWeight | None:
    """The blocks `attach` hung on `weight`, while the weight is unchanged since: no in-place write (its version),
    and the same storage, dtype and shape (a tensor-parallel shard or a cast replaces the data under the object)."""
    attached = getattr(weight, "gguf_blocks", None)
    if attached is None or attached[1] != _fingerprint(weight):
        return None
    return attached[0]


def _fingerprint(weight: torch.Tensor) -> tuple:
    return weight._version, weight.data_ptr(), weight.dtype, tuple(weight.shape)


def drop(weight: torch.Tensor) -> None:
    """Free `weight`'s blocks (after packing: a later repack follows a change, which they no longer match)."""
    if getattr(weight, "gguf_blocks", None) is not None:
        del weight.gguf_blocks


def decoded(kind: str, rows: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight | None:
    """A weight `[N, K]`'s blocks (`rows` [N, bytes]) as the panels take them, or None if they do not fit `shape`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    out_features, in_features = shape
    weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]  # per block
    if in_features % weights or rows.shape != (out_features, in_features // weights * size):
        return None
    bits, q, scale, group, offset, *levels = DECODERS[kind](np.array(rows, dtype=np.uint8).reshape(-1, size))

    def by_row(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values).reshape(out_features, -1))

    offset = None if offset is None else by_row(offset)
    return QuantizedWeight(bits, by_row(q), by_row(scale), group, offset, *map(torch.from_numpy, levels))


# Each decoder: blocks [n, bytes] -> (bits, q [n, weights], scale [n, groups], group size, offset [n, groups] or None,
# and for IQ4 the 16 levels q stands for), the layouts and arithmetic of gguf-py's dequantize_blocks (ggml's own),
# written as the panels' q * scale + offset.


def _half(field: np.ndarray) -> np.ndarray:
    """A float16 field of each block ([n, 2] bytes) as float32 [n, 1]."""
    return np.ascontiguousarray(field).view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray, run: int) -> np.ndarray:
    """Bytes [n, b] -> 4-bit values [n, 2b]: each run of `run` bytes gives its low nibbles, then its high ones."""
    halves = packed.reshape(packed.shape[0], -1, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (halves & 15).reshape(packed.shape[0], -1)


def _q4_0(blocks):  # d * (q - 8)
    d = _half(blocks[:, :2])
    return 4, _nibbles(blocks[:, 2:], 16), d, BLOCK, d * -8


def _q4_1(blocks):  # d * q + m
    return 4, _nibbles(blocks[:, 4:], 16), _half(blocks[:, :2]), BLOCK, _half(blocks[:, 2:4])


def _q8_0(blocks):  # d * q, q signed
    return 8, np.ascontiguousarray(blocks[:, 2:]).view(np.int8), _half(blocks[:, :2]), BLOCK, None


def _q4_k(blocks):  # 256 weights in 8 groups of 32: (d * sc) * q - dmin * m, six-bit sc and m per group
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    scale, offset = _half(blocks[:, :2]) * sc.astype(np.float32), -(_half(blocks[:, 2:4]) * m.astype(np.float32))
    return 4, _nibbles(blocks[:, 16:], 32), scale, 32, offset


def _q5_0(blocks):  # d * (q - 16), q of 4 low bits and a fifth from a 32-bit mask
    q = _five_bits(blocks[:, 2:6], blocks[:, 6:], 16).astype(np.int8) - np.int8(16)
    return 8, q, _half(blocks[:, :2]), BLOCK, None


def _q5_1(blocks):  # d * q + m
    q = _five_bits(blocks[:, 4:8], blocks[:, 8:], 16).astype(np.int8)
    return 8, q, _half(blocks[:, :2]), BLOCK, _half(blocks[:, 2:4])


def _five_bits(high: np.ndarray, low: np.ndarray, run: int) -> np.ndarray:
    """5-bit values [n, w]: 4-bit ones from `low` (runs of `run` bytes, as _nibbles) and a fifth bit per value from
    `high`, bit i of the little-endian bytes for value i."""
    fifth = np.unpackbits(np.ascontiguousarray(high), axis=-1, bitorder="little")
    return _nibbles(low, run) | (fifth << 4)


def _q5_k(blocks):  # 256 weights in 8 groups of 32: (d * sc) * q - dmin * m, q of 4 low bits and a fifth
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    scale, offset = _half(blocks[:, :2]) * sc.astype(np.float32), -(_half(blocks[:, 2:4]) * m.astype(np.float32))
    low = _nibbles(blocks[:, 48:], 32).reshape(-1, 8, 32)
    fifth = (blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # bit g: group g
    return 8, (low | (fifth << 4)).reshape(-1, 256).astype(np.int8), scale, 32, offset


def _q2_k(blocks):  # 256 weights in 16 groups of 16: (d * sc) * q - dmin * m, four-bit sc and m, two-bit q
    sc = blocks[:, :16]
    scale = _half(blocks[:, 80:82]) * (sc & 15).astype(np.float32)
    offset = -(_half(blocks[:, 82:84]) * (sc >> 4).astype(np.float32))
    return 4, _crumbs(blocks[:, 16:80]), scale, 16, offset


def _crumbs(packed: np.ndarray) -> np.ndarray:
    """Bytes [n, 64] -> 2-bit values [n, 256]: per half of 32 bytes, the four bit pairs of each byte in turn."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((packed.reshape(packed.shape[0], -1, 1, 32) >> shifts) & 3).reshape(packed.shape[0], -1)


def _q3_k(blocks):  # 256 weights in 16 groups of 16: (d * (sc - 32)) * q, q from -4 to 3: (q + 4) * s - 4 * s
    low, high = blocks[:, 96:104], blocks[:, 104:108]
    sc = ((low.reshape(-1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(-1, 16) & 15) | (
        ((high.reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(-1, 16) & 3) << 4
    )
    scale = _half(blocks[:, 108:110]) * (sc.astype(np.int8) - np.int8(32)).astype(np.float32)
    mask = (blocks[:, :32].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = _crumbs(blocks[:, 32:96]) + (mask.reshape(-1, 256) << 2)  # the mask's bit set: no -4 (q + 4 from 0 to 7)
    return 4, q, scale, 16, scale * -4  # (-4 * s is exact, and so is the value: one rounding changes nothing)


def _q6_k(blocks):  # 256 weights in 16 groups of 16: (d * sc) * (q - 32), q of 4 low bits and 2 high ones
    low = _nibbles(blocks[:, :128], 64)
    high = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high.reshape(low.shape) << 4)).astype(np.int8) - np.int8(32)
    scale = _half(blocks[:, 208:210]) * np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    return 8, q, scale, 16, None


# IQ4's 16 non-uniform levels (ggml's kvalues_iq4nl): a 4-bit index picks one; the int4 panels read it from this table.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _iq4_nl(blocks):  # d * level[q]
    return 4, _nibbles(blocks[:, 2:], 16), _half(blocks[:, :2]), BLOCK, None, IQ4_LEVELS


def _iq4_xs(blocks):  # 256 weights in 8 groups of 32: (d * (sc - 32)) * level[q], six-bit sc
    low = (blocks[:, 4:8].reshape(-1, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(-1, 8) & 15
    high = np.ascontiguousarray(blocks[:, 2:4]).view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16)).reshape(1, 8)
    sc = (low | ((high & 3).astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    return 4, _nibbles(blocks[:, 8:], 16), _half(blocks[:, :2]) * sc.astype(np.float32), 32, None, IQ4_LEVELS


DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
            "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
            "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}  # fmt: skip
