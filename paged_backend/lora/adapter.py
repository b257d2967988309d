"""Reading one peft LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) for a given model.

Everything is checked against the model before a request is queued: the files exist, the rank fits
`max_lora_rank`, and every adapted module is a linear layer of the model (by its whole shapes, `linear_shapes`,
taken before tensor or pipeline parallelism cuts the model; each rank keeps its part when it fills a slot). peft's scaling (`lora_alpha / r`, or
`/ sqrt(r)` with rsLoRA, per-module `alpha_pattern`) is kept per module (the device slots fold it into B).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import torch
from torch import nn

from paged_backend.errors import BadLoRAAdapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_load_ids = count(1)


@dataclass
class LoRAAdapter:
    """One loaded adapter: per adapted module, `A [r, in]`, `B [out, r]` and peft's scaling."""

    name: str
    int_id: int
    path: str
    rank: int  # the largest rank over its modules
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    # Unique per load: the prefix-cache key and the slot key, so a reloaded or renamed adapter never reuses
    # another's KV or device slot.
    load_id: int = field(default_factory=lambda: next(_load_ids))


def _pattern_value(pattern: dict, module: str, default):
    for key, value in (pattern or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise BadLoRAAdapter(f"LoRA adapter {directory} has no {CONFIG_FILE}; give a peft adapter directory")
    config = json.loads(path.read_text())
    if config.get("peft_type", "LORA").upper() != "LORA":
        raise BadLoRAAdapter(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "bias": config.get("bias", "none") != "none",
    }
    named = [name for name, present in unsupported.items() if present]
    if named:
        raise BadLoRAAdapter(f"{path}: {', '.join(named)} not supported; save a plain LoRA adapter")
    return config


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """`{module name: (in_features, out_features)}` of the model's linear layers (the adapters' targets)."""
    return {name: (m.in_features, m.out_features) for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def load_adapter(
    name: str,
    int_id: int,
    path: str,
    shapes: dict[str, tuple[int, int]],
    *,
    max_rank: int,
    dtype: torch.dtype,
    device,
) -> LoRAAdapter:
    """Load and check the adapter at `path` against a model's `linear_shapes`; raises `BadLoRAAdapter` saying what
    to fix."""
    from safetensors.torch import load_file

    directory = Path(path)
    if not directory.is_dir():
        raise BadLoRAAdapter(f"LoRA adapter {name!r}: {path} is not a directory; give a peft adapter directory")
    config = _read_config(directory)
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise BadLoRAAdapter(f"LoRA adapter {name!r}: {weights_path} is missing; save the adapter with safetensors")
    tensors = load_file(str(weights_path))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.\w+)?\.weight", key)
        if match is None:
            raise BadLoRAAdapter(f"LoRA adapter {name!r}: unexpected tensor {key!r}; only lora_A / lora_B weights")
        pairs.setdefault(match[1], {})[match[2]] = tensor
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for module_name, pair in pairs.items():
        shape = shapes.get(module_name)
        if module_name in ("lm_head",) or shape is None:
            raise BadLoRAAdapter(
                f"LoRA adapter {name!r} targets {module_name!r}, which is not an attention or MLP linear layer of "
                "this model; train the adapter for this base model"
            )
        if set(pair) != {"A", "B"}:
            raise BadLoRAAdapter(f"LoRA adapter {name!r}: {module_name} lacks lora_A or lora_B")
        lora_a, lora_b = pair["A"], pair["B"]
        rank = lora_a.shape[0]
        if lora_a.shape[1] != shape[0] or lora_b.shape != (shape[1], rank):
            raise BadLoRAAdapter(f"LoRA adapter {name!r}: {module_name} shapes do not fit the model's layer")
        if rank > max_rank:
            raise BadLoRAAdapter(
                f"LoRA adapter {name!r} has rank {rank} at {module_name} but max_lora_rank is {max_rank}; "
                "raise max_lora_rank"
            )
        alpha = _pattern_value(config.get("alpha_pattern"), module_name, config.get("lora_alpha", 8))
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        weights[module_name] = (lora_a.to(device=device, dtype=dtype), lora_b.to(device=device, dtype=dtype), scaling)
    if not weights:
        raise BadLoRAAdapter(f"LoRA adapter {name!r}: {weights_path} holds no LoRA weights")
    rank = max(a.shape[0] for a, _, _ in weights.values())
    return LoRAAdapter(name, int_id, str(path), rank, weights)
