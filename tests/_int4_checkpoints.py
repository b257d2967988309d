"""Small AWQ (GEMM) and GPTQ int4 checkpoints built here, as their exporters write them: a seeded tiny Llama,
round-to-nearest int4 per group, packed with each format's own bit layout (written independently of
paged_backend.worker.int4_formats), saved as safetensors + config.json with `quantization_config` + byte tokenizer.

`build_checkpoint` returns the float32 weights the checkpoint means (each quantized layer's (q - z) * s, the rest as
stored in float16), so a test can run HF generate on exactly the model the checkpoint describes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from paged_backend.worker.models import byte_tokenizer, tiny_model

SHAPE = dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2)  # int4 kernel sizes
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of a word holds column 8c + AWQ_ORDER[i]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn_int4(
    weight: torch.Tensor, groups: torch.Tensor, order: torch.Tensor, group_size: int, sym: bool, min_zero: int
):
    """Round-to-nearest int4 of weight [out, in], group k being input channels order[k*size : (k+1)*size] (groups[i]
    names channel i's): q [out, in], and per (group, out) int zeros and float16 scales [groups, out]."""
    grouped = weight[:, order].unflatten(1, (-1, group_size))  # [out, groups, size]
    low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    if sym:
        scales, zeros = (torch.maximum(-low, high) * 2 / 15).clamp(min=1e-6).half(), torch.full_like(low, 8)
    else:
        scales = ((high - low) / 15).clamp(min=1e-6).half()
        zeros = torch.round(-low / scales.float()).clamp(min_zero, 15)
    scales, zeros = scales.T.contiguous(), zeros.T.int().contiguous()
    q = (torch.round(weight / scales[groups].T.float()) + zeros[groups].T).clamp(0, 15).int()
    return q, zeros, scales


def pack_words(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int values [rows, 8n] in 0..15 -> int32 words [rows, n]; nibble i (bits 4i..4i+3) of word c holds
    value 8c + order[i]."""
    array = values.numpy().astype(np.uint32)
    words = np.zeros((array.shape[0], array.shape[1] // 8), dtype=np.uint32)
    for i, column in enumerate(order):
        words |= array[:, column::8] << np.uint32(4 * i)
    return torch.from_numpy(words.view(np.int32))


def pack_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"qweight": pack_words(q.T, AWQ_ORDER), "qzeros": pack_words(zeros, AWQ_ORDER), "scales": scales}


def pack_gptq(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> dict[str, torch.Tensor]:
    """GPTQ v1: qweight packs 8 input channels per word (transpose of the column packing); qzeros stores zero - 1."""
    return {"qweight": pack_words(q).T.contiguous(), "qzeros": pack_words(zeros - 1), "scales": scales,
            "g_idx": g_idx.int()}  # fmt: skip


def build_checkpoint(
    path: Path,
    method: str,
    *,
    seed: int = 0,
    group_size: int = 32,
    desc_act: bool = False,
    sym: bool = False,
    tied: bool = False,
    modules_to_not_convert: tuple[str, ...] = (),
    shape: dict | None = None,
) -> dict[str, torch.Tensor]:
    """Write an AWQ ("awq") or GPTQ v1 ("gptq") checkpoint of tiny_model("llama", seed) into `path`; returns the
    float32 state dict it stands for. desc_act: GPTQ act-order, groups over a random permutation of the inputs.
    shape: tiny_model's size arguments (default SHAPE; benchmarks/int4_checkpoints.py builds a bigger one)."""
    model = tiny_model("llama", seed=seed, **(shape or SHAPE))
    model.config.tie_word_embeddings = tied
    generator = torch.Generator().manual_seed(seed)
    tensors, reference = {}, {}
    for name, weight in model.state_dict().items():
        layer = name.removesuffix(".weight")
        if tied and name == "lm_head.weight":
            continue
        if not layer.endswith(LINEARS) or any(skip in layer for skip in modules_to_not_convert):
            tensors[name] = weight.half()
            reference[name] = weight.half().float()
            continue
        in_features = weight.shape[1]
        order = torch.randperm(in_features, generator=generator) if desc_act else torch.arange(in_features)
        groups = torch.empty(in_features, dtype=torch.long)
        groups[order] = torch.arange(in_features) // group_size  # the k-th channel in `order` is in group k // size
        q, zeros, scales = rtn_int4(weight, groups, order, group_size, sym, min_zero=1 if method == "gptq" else 0)
        packed = pack_awq(q, zeros, scales) if method == "awq" else pack_gptq(q, zeros, scales, groups)
        tensors.update({f"{layer}.{part}": value for part, value in packed.items()})
        reference[name] = (q - zeros[groups].T).float() * scales[groups].T.float()
    if tied:
        reference["lm_head.weight"] = reference["model.embed_tokens.weight"]
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["dtype"] = "float16"  # as exports say: their unquantized tensors and scales are float16
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
         "modules_to_not_convert": list(modules_to_not_convert) or None}
        if method == "awq"
        else {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": "gptq", "pack_dtype": "int32", "lm_head": False}
    )  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=2))
    byte_tokenizer().save_pretrained(path)
    return reference
