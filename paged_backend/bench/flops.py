"""How much of the machine the engine uses: the workload's useful model FLOPs, and this machine's matmul peak."""

from __future__ import annotations

import time

import torch


def model_flops(model, prompts: list[list[int]], outputs: list[int]) -> float:
    """Useful FLOPs of the workload: every decoder linear layer once per token, the LM head once per output token,
    and attention's two products over each token's context (no padding, no recomputation)."""
    config = model.config
    decoder = sum(m.weight.numel() for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and "lm_head" not in name)  # fmt: skip
    head = model.get_output_embeddings().weight.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_context_token = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim  # QK^T and PV
    flops = 0.0
    for prompt, wanted in zip(prompts, outputs, strict=True):
        tokens = len(prompt) + wanted
        flops += 2 * decoder * tokens + 2 * head * wanted + per_context_token * tokens * (tokens + 1) / 2
    return flops


def matmul_peak(model, repeats: int = 20) -> float:
    """FLOP/s of this machine's best case for the model: one [256, hidden] x [hidden, intermediate] linear in the
    model's dtype and on its device (at the current thread count on CPU), dense (MKL) or prepacked (oneDNN),
    whichever is faster (best of `repeats`)."""
    from paged_backend.worker.packed_linear import packable, packed_forward

    config = model.config
    x = torch.randn(256, config.hidden_size, dtype=model.dtype, device=model.device)
    layer = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False, dtype=model.dtype,
                            device=model.device)
    best = float("inf")
    for linear in (layer.forward, packed_forward(layer)) if packable(layer) else (layer.forward,):
        for _ in range(repeats + 3):
            started = time.perf_counter()
            with torch.no_grad():
                linear(x)
            if x.is_cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
    return 2 * x.shape[0] * config.hidden_size * config.intermediate_size / best
