"""Tiny base models with three random peft adapters (different ranks and target modules), saved to disk, and
peft's own greedy `generate` as the reference each engine path must equal token for token."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from paged_backend.worker.models import byte_tokenizer, tiny_model

# The dtype of every engine compared with `reference_tokens` (peft on a float32 model): `--dtype auto` is bfloat16 on
# CPUs with AMX or AVX512-BF16, whose greedy tokens may part from float32's.
DTYPE = "float32"
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69], [80, 81, 82, 9, 8, 7]]
ADAPTERS = {  # name: peft options; ranks 4 / 8 / 2, attention only / everything / MLP only with rsLoRA
    "attn4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all8": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ),
    "mlp2": dict(r=2, lora_alpha=4, target_modules=["gate_proj", "down_proj"], use_rslora=True),
}


def save_base_and_adapters(arch: str, root: Path, seed: int = 3) -> tuple[Path, dict[str, Path]]:
    """Save the tiny base model (+ tokenizer) and the three adapters; returns their directories."""
    base = tiny_model(arch, seed=seed)
    model_dir = root / f"{arch}-base"
    base.save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    adapters = {}
    for index, (name, options) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + index)  # init_lora_weights=False: random A and B, so the adapter changes tokens
        peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **options))
        adapters[name] = root / f"{arch}-{name}"
        peft_model.save_pretrained(adapters[name])
    return model_dir, adapters


def reference_tokens(
    arch: str, adapter_dir: Path | None, prompts: list[list[int]], max_new_tokens: int, seed: int = 3
) -> list[list[int]]:
    """peft's own greedy generate with the adapter active (or the plain base model), one prompt at a time."""
    model = tiny_model(arch, seed=seed)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    tokens = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
        tokens.append(out[0, len(prompt) :].tolist())
    return tokens


def adapter_builder(tmp_path_factory, max_new_tokens: int):
    """`build(arch)`: per architecture, built once, the base model directory, a LoRARequest per adapter and peft's
    reference tokens (for a module-scoped fixture)."""
    from paged_backend.lora import LoRARequest

    cache = {}

    def build(arch: str):
        if arch not in cache:
            model_dir, adapters = save_base_and_adapters(arch, tmp_path_factory.mktemp(arch))
            loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
            cache[arch] = model_dir, loras, expected_tokens(arch, adapters, max_new_tokens)
        return cache[arch]

    return build


def expected_tokens(arch: str, adapters: dict[str, Path], max_new_tokens: int) -> dict[str | None, list[list[int]]]:
    """The reference tokens of every prompt under the base model (key None) and each adapter."""
    return {name: reference_tokens(arch, adapters.get(name), PROMPTS, max_new_tokens) for name in [None, *adapters]}
