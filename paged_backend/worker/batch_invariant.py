"""Batch-invariant mode (`EngineConfig.batch_invariant`, `--batch-invariant`, `PAGED_BACKEND_BATCH_INVARIANT=1`): a
request's tokens and logprobs are bitwise the same alone or in any batch, under any prefill chunking, with or without
prefix-cache hits or preemption, and equal to the prompt logprobs of the same text re-scored (echo). vLLM's
VLLM_BATCH_INVARIANT does this on GPUs. This mode was built for the CPU; its GPU side (below) has not run on a GPU yet.

A row's result must not depend on the other rows of its forward. What breaks that on CPU, and the fix for each:

- Linear layers (the LM head included): the panel kernel (`ops/panel_linear.py`, what packed layers run where the
  csrc/cpu library builds) sums each output in one order whatever the row count, so packed layers run as they are.
  oneDNN and MKL pick kernels and K-blocking by the row count M, so a row's dot products are summed in an order that
  depends on M (measured: oneDNN prepacked fp32 at K=1536, MKL's sgemm at every shape): layers on them run every
  call on tiles of exactly `TILE_ROWS` rows, copied into a fresh (so 64-byte aligned) buffer and padded with zero
  rows, so every row meets the same kernel and blocking. Its position in the tile and the other rows' values do not
  change it (tests/test_batch_invariant.py checks both).
- Activations: torch runs a tensor's elements in vector lanes but its last few (and each thread's chunk end) in
  scalar code that rounds differently (fp32 silu/gelu/sigmoid differ in 4-30% of inputs), so where a row falls in
  the batch decides some of its bits. They run here on rows padded to whole vectors, in calls small enough for one
  thread: every element takes the vector path.
- Attention: `active()` also enters `ops.batch_invariant()`, so the cpu kernel runs one query token per task with
  one score path for every row (csrc/cpu/paged_attention_cpu.cpp).
- The fused CPU forward of Llama-family models keeps the model's linear modules (so the tiles apply), its
  `AttentionPlan` reads the same switch, and its norm, rotary and SiLU kernels compute each row on its own.
- Left as torch runs them, measured invariant: RMS norms (a per-row reduction; up to 32768 features), rotary
  (cos/sin are the same in vector and scalar code), residual adds, and the sampler's and prompt logprobs' row-wise
  softmaxes. Sampling is per request when the request has a seed.

On a GPU the same rule holds with other culprits. cuBLAS picks its kernel, tiling and split of K by the GEMM's
shape, and torch's CUDA reductions (the norms' mean) pick theirs by the number of rows. So linear layers and norms
run on tiles of exactly `GPU_TILE_ROWS` rows: one shape per layer, one kernel. Triton's attention runs one query
token per program with one KV segment (`ops/triton.py`). Activations, rotary and residual adds are elementwise.

`BatchInvariantLinears` is a drop-in for `PackedLinears` (the runner's `packed`): the same `active()` contract, which
swaps each layer's `forward` for the runner's forwards only, over the prepacked oneDNN forward where the layer packs
and over its own `F.linear` where it does not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

from paged_backend.config import EngineConfig
from paged_backend.errors import InvalidRequest
from paged_backend.ops import INVARIANT_BACKENDS, batch_invariant, resolve_backend
from paged_backend.worker.packed_linear import pack_linears

# Rows per linear call. 8 against 16 (one thread, a 20M Llama): one stream decodes 141 against 126 tok/s (default
# 180), and 32 requests run at ~0.7x the default's tok/s either way; a larger tile pads a lone row more.
TILE_ROWS = 8
GPU_TILE_ROWS = 64  # on a GPU: a decode step's rows fit one tile, and a long prefill takes few GEMM launches
ELEMENTWISE = (nn.SiLU, nn.GELU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Mish)  # with every transformers.activations class
GRAIN = 32768  # torch's parallel grain (at::internal::GRAIN_SIZE): a smaller elementwise call runs on one thread
LANES = 64  # elements per step of torch's widest vector loop (two AVX-512 vectors of bf16)


def refusal(config: EngineConfig, device: torch.device) -> str | None:
    """Why this engine cannot run batch-invariant (a sentence), or None. The layers are checked when they load."""
    if device.type not in ("cpu", "cuda"):
        return f"batch-invariant mode runs on CPU or a CUDA GPU, not {device.type}"
    backend = None if config.attention_backend == "auto" else config.attention_backend
    if resolve_backend(backend, device) not in INVARIANT_BACKENDS:
        return ("batch-invariant mode needs the cpu attention kernel on CPU, or triton on a GPU: leave "
                "--attention-backend on auto")  # fmt: skip
    if config.enable_lora:
        return "batch-invariant mode does not cover LoRA adapters (their deltas are computed over the whole batch)"
    if config.speculative_config is not None:
        return "batch-invariant mode does not cover speculative decoding (the draft model is not batch-invariant)"
    if config.cache.calculate_kv_scales:
        return "batch-invariant mode does not cover calculate_kv_scales (the fp8 scales come from one step's batch)"
    if config.parallel.world_size > 1:
        return "batch-invariant mode runs in one process (no tensor or pipeline parallelism)"
    return None


def unsupported(module: nn.Linear, packed: bool) -> str | None:
    """Why a linear layer cannot run on fixed tiles, or None (`packed`: it runs a prepacked oneDNN forward)."""
    if module._forward_hooks or module._forward_pre_hooks:
        return "forward hooks on it would see the whole batch"
    if packed:
        return None
    if type(module).forward is not nn.Linear.forward or "forward" in module.__dict__:
        return "it has a forward of its own (a quantized layer, or accelerate's offload hooks)"
    weight = module.weight
    if type(weight.data) is not torch.Tensor:
        return "its weight is quantized"
    if weight.device.type not in ("cpu", "cuda"):
        return f"its weight is on {weight.device.type}"
    return None


def row_norm(module: nn.Module) -> bool:
    """A norm over each row's features (transformers' *RMSNorm classes, torch's LayerNorm and RMSNorm)."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("RMSNorm")


def on_gpu(module: nn.Module, recurse: bool = False) -> bool:
    return any(param.device.type == "cuda" for param in module.parameters(recurse=recurse))


def elementwise(module: nn.Module) -> bool:
    return isinstance(module, ELEMENTWISE) or type(module).__module__ == "transformers.activations"


def tiled_linear(forward: Callable, tile_rows: int) -> Callable:
    """`forward` run on `[tile_rows, K]` tiles only: the rows of `x [..., K]` copied in, zero rows after the last."""

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = None
        for start in range(0, rows.shape[0], tile_rows):
            part = rows[start : start + tile_rows]
            count = part.shape[0]
            tile = part.new_empty(tile_rows, part.shape[1])  # fresh: the same alignment for every tile
            tile[:count] = part
            tile[count:].zero_()
            result = forward(tile)
            if out is None:
                out = result.new_empty(rows.shape[0], result.shape[-1])
            out[start : start + count] = result[:count]
        if out is None:  # no rows at all
            return forward(x)
        return out.view(*x.shape[:-1], out.shape[-1])

    return run


def tiled_elementwise(forward: Callable) -> Callable:
    """`forward` run on rows padded to whole vector steps, under torch's parallel grain: no element falls in a
    scalar tail or at a thread's chunk end, wherever its row sits."""

    def run(x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        rows = x.reshape(-1, width)
        stride = -(-width // LANES) * LANES
        per_call = max(1, (GRAIN - 1) // stride)
        out = torch.empty_like(rows)
        for start in range(0, rows.shape[0], per_call):
            part = rows[start : start + per_call]
            padded = part.new_zeros(part.shape[0], stride)
            padded[:, :width] = part
            out[start : start + part.shape[0]] = forward(padded)[:, :width]
        return out.view(x.shape)

    return run


class BatchInvariantLinears:
    """The model's linear layers and activations (and on a GPU its norms) on batch-invariant forwards (see the
    module doc).

    `pack`/`release` as for `PackedLinears`: layers that pack run their prepacked oneDNN forward on the tiles, the
    others their own `F.linear`. A layer neither can tile (quantized, offloaded, hooked) is refused here, at load.
    `tile_rows`: rows per tile; default `TILE_ROWS` on CPU, `GPU_TILE_ROWS` for a model on a GPU."""

    def __init__(self, model: nn.Module, *, pack: bool = True, release: bool = False, tile_rows: int | None = None):
        self.tile_rows = tile_rows or (GPU_TILE_ROWS if on_gpu(model, recurse=True) else TILE_ROWS)
        self.packed = pack_linears(model, pack, release=release)
        packed = self.packed.layers if self.packed is not None else {}
        self.linears: list[nn.Module] = []
        self.activations: list[nn.Module] = []
        self.norms: list[nn.Module] = []  # GPU only: torch's CPU norms are invariant as they are (measured)
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                reason = unsupported(module, module in packed)
                if reason:
                    raise InvalidRequest(f"batch-invariant mode cannot run layer {name!r}: {reason}")
                self.linears.append(module)
            elif elementwise(module):
                self.activations.append(module)
            elif row_norm(module) and on_gpu(module):
                self.norms.append(module)

    def __len__(self) -> int:
        return len(self.linears)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Tiled forwards on every linear layer and activation, and batch-invariant attention, for the duration."""
        with ExitStack() as stack:
            if self.packed is not None:
                stack.enter_context(self.packed.active())  # a packed layer's forward is now its oneDNN one
            stack.enter_context(batch_invariant())
            # a panel-packed layer is invariant as it is (one multiply-add chain per output, whatever the rows)
            swapped = [(module, tiled_linear(module.forward, self.tile_rows)) for module in self.linears
                       if getattr(module.forward, "panel", None) is None]  # fmt: skip
            swapped += [(module, tiled_elementwise(module.forward)) for module in self.activations]
            swapped += [(module, tiled_linear(module.forward, self.tile_rows)) for module in self.norms]
            stack.enter_context(_forwards(swapped))
            yield


@contextmanager
def _forwards(swapped: list[tuple[nn.Module, Callable]]) -> Iterator[None]:
    """Each module's `forward` replaced for the duration, then whatever it was before (a packed one, or none)."""
    before = [module.__dict__.get("forward") for module, _ in swapped]
    for module, forward in swapped:
        module.forward = forward
    try:
        yield
    finally:
        for (module, _), previous in zip(swapped, before, strict=True):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
