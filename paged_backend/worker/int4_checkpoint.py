"""AWQ and GPTQ int4 checkpoints on CPU, with no GPU kernel package: each quantized linear layer is repacked into
torchao's CPU int4 layout where its kernel applies, so its weight stays 4-bit in memory, else dequantized.

torchao's `Int4OpaqueTensor` (the layout `Int4WeightOnlyConfig(int4_packing_format="opaque")` makes) multiplies with
`aten._weight_int4pack_mm_for_cpu`, which computes each group as (q - 8) * scale + zero with a float zero. The
checkpoint's (q - z) * s is that form with zero = (8 - z) * s, built from the checkpoint's own int4 values (never
re-quantized from float). The kernel takes groups of 32, 64, 128 or 256 consecutive input channels and output sizes
that are multiples of 16; layers outside that (GPTQ act-order, other shapes), or every layer when torchao is missing,
are dequantized to the engine's dtype. The model is built from its config with no quantization_config, its
parameters never initialised: each is set once, from the checkpoint.
"""

from __future__ import annotations

import copy
import ctypes
import importlib.util
import json
import os
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.initialization import no_init_weights

from paged_backend.errors import InvalidRequest
from paged_backend.worker.int4_formats import Int4Scheme, Int4Weight, saved_settings

PACKED_PARTS = ("qweight", "qzeros", "scales", "g_idx")  # a quantized layer's tensors, besides its bias
KERNEL_GROUP_SIZES = (32, 64, 128, 256)
KERNEL_OUT_MULTIPLE = 16
KERNEL_ZERO_LEVEL = 8  # the kernel subtracts this from every int4 value
# PyTorch vectorizes the kernel for bfloat16 on x86 (AVX2/AVX-512); float32 and float16 take a scalar loop there.
FAST_DTYPE_HINT = "; the int4 kernel runs several times faster with --dtype bfloat16"


def load_int4_checkpoint(source: str, config, dtype: torch.dtype, device: torch.device) -> tuple[PreTrainedModel, str]:
    """Load an AWQ (GEMM) or GPTQ int4 checkpoint directory (or cached hub id) onto CPU.

    Returns the model and one sentence for startup: how many layers were repacked and which were dequantized, why.
    """
    scheme = Int4Scheme.from_config(saved_settings(config))
    model = _unloaded_model(config, dtype)
    checkpoint = _CheckpointTensors(source)
    layers = sorted({name.removesuffix(".qweight") for name in checkpoint.names if name.endswith(".qweight")})
    loaded, dequantized = set(), defaultdict(list)
    for layer in layers:
        module = _linear(model, layer)
        parts = {part: checkpoint.read(f"{layer}.{part}") for part in PACKED_PARTS if f"{layer}.{part}" in checkpoint}
        weight = scheme.unpack(layer, parts, module.in_features, module.out_features)
        reason = _why_not_repacked(weight)
        if reason is None:
            module.weight = nn.Parameter(_repacked(weight, dtype), requires_grad=False)
        else:
            module.weight = nn.Parameter(weight.dequantize(dtype), requires_grad=False)
            dequantized[reason].append(layer)
        loaded.add(f"{layer}.weight")
    packed = {f"{layer}.{part}" for layer in layers for part in PACKED_PARTS}
    for name in checkpoint.names - packed:
        if _set_tensor(model, name, checkpoint.read(name), dtype):
            loaded.add(name)
    _check_complete(model, loaded, source)
    _return_freed_memory()
    return model.to(device).eval(), _summary(scheme, len(layers), dequantized, dtype)


def _unloaded_model(config, dtype: torch.dtype) -> PreTrainedModel:
    """The model the config describes, with no quantization_config and parameters allocated but never written
    (untouched pages cost no memory until the checkpoint's values replace them)."""
    plain = copy.deepcopy(config)
    del plain.quantization_config
    with no_init_weights():
        return AutoModelForCausalLM.from_config(plain, dtype=dtype)


def _linear(model: nn.Module, layer: str) -> nn.Linear:
    try:
        module = model.get_submodule(layer)
    except AttributeError as exc:
        raise InvalidRequest(
            f"the checkpoint quantizes {layer}, which a {type(model).__name__} does not have; check that "
            f"config.json belongs to these weights"
        ) from exc
    if not isinstance(module, nn.Linear):
        raise InvalidRequest(f"the checkpoint quantizes {layer}, a {type(module).__name__}; only linear layers can be")
    return module


def _why_not_repacked(weight: Int4Weight) -> str | None:
    """Why torchao's CPU int4 kernel cannot take this layer as it is, or None when it can."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'paged-backend[quantization]')"
    group_size = weight.consecutive_group_size()
    if group_size is None:
        return "their act-order groups are not runs of consecutive input channels"
    if group_size not in KERNEL_GROUP_SIZES:
        return f"their group size {group_size} is not one the int4 kernel takes ({', '.join(map(str, KERNEL_GROUP_SIZES))})"
    if weight.values.shape[0] % KERNEL_OUT_MULTIPLE:
        return f"their output size is not a multiple of {KERNEL_OUT_MULTIPLE}"
    return None


def _repacked(weight: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The layer as a torchao `Int4OpaqueTensor`: its int4 values packed for the CPU kernel, and per group the scale
    and the float zero (KERNEL_ZERO_LEVEL - z) * s that make the kernel's (q - 8) * s + zero equal (q - z) * s."""
    from torchao.prototype.quantization.int4 import Int4OpaqueTensor

    scales = weight.scales.to(dtype)
    zeros = ((KERNEL_ZERO_LEVEL - weight.zeros).float() * scales.float()).to(dtype)
    values = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.values.int(), 1)
    return Int4OpaqueTensor(
        qdata=values,
        scale_and_zero=torch.stack([scales, zeros], dim=-1).contiguous(),  # [groups, out, 2]
        block_size=[1, weight.consecutive_group_size()],
        shape=weight.values.shape,
    )


def _set_tensor(model: nn.Module, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Put a checkpoint tensor into the parameter or buffer of that name (floats in `dtype`); False when the model
    has no such tensor (exports may carry extras such as old rotary buffers)."""
    owner, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    value = tensor.to(dtype) if tensor.is_floating_point() else tensor
    current = module._parameters.get(attr, module._buffers.get(attr))
    if current is None:
        return False
    if current.shape != value.shape:
        raise InvalidRequest(
            f"the checkpoint's {name} has shape {tuple(value.shape)} but the model built from config.json "
            f"needs {tuple(current.shape)}; check that config.json belongs to these weights"
        )
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attr] = value
    return True


def _check_complete(model: PreTrainedModel, loaded: set[str], source: str) -> None:
    """Tie the output embeddings if the config says so, then refuse a model with a parameter the checkpoint lacks."""
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [name for name, _ in model.named_parameters() if name not in loaded]
    if missing:
        raise InvalidRequest(
            f"the checkpoint {source} lacks {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}; "
            f"it is incomplete or does not match its config.json"
        )


def _return_freed_memory() -> None:
    """Hand the per-layer unpacking buffers back to the OS. glibc keeps freed blocks of their size in its heap, so
    without this the process RSS stays ~as large as a dense load (measured: +330 MiB for 171 MiB of weights, +183
    after the trim). Not glibc (no malloc_trim): nothing to do."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _summary(scheme: Int4Scheme, total: int, dequantized: dict[str, list[str]], dtype: torch.dtype) -> str:
    repacked = total - sum(map(len, dequantized.values()))
    parts = [f"{repacked} of {total} quantized linear layers repacked to torchao's CPU int4 layout (their weights "
             f"stay 4-bit{'' if dtype == torch.bfloat16 else FAST_DTYPE_HINT})"] if repacked else []  # fmt: skip
    parts += [
        f"{len(layers)} of {total} dequantized to {str(dtype).removeprefix('torch.')} because {reason} "
        f"({', '.join(layers[:3])}{', ...' if len(layers) > 3 else ''})"
        for reason, layers in dequantized.items()
    ]
    return f"{scheme.method.upper()} int4 checkpoint on CPU: {'; '.join(parts)}"


class _CheckpointTensors:
    """The tensors of a checkpoint's safetensors files, by name, read one at a time."""

    def __init__(self, source: str):
        directory = Path(source) if os.path.isdir(source) else _downloaded(source)
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
        else:
            files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise InvalidRequest(
                f"the checkpoint {source} has no .safetensors files; AWQ and GPTQ checkpoints load on CPU "
                f"from safetensors"
            )
        self._files = {}
        for file in files:
            with safe_open(file, framework="pt") as opened:
                self._files.update(dict.fromkeys(opened.keys(), file))
        self.names = set(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def read(self, name: str) -> torch.Tensor:
        with safe_open(self._files[name], framework="pt") as opened:
            return opened.get_tensor(name)


def _downloaded(repo_id: str) -> Path:
    """A hub checkpoint's files (from the local cache when present)."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, allow_patterns=["*.safetensors", "*.json"]))
