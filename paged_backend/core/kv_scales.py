"""Per-layer fp8 KV scales computed from the first step (vLLM's `--calculate-kv-scales`).

An fp8 pool stores `k / k_scale` and reads `stored * k_scale`. With scale 1.0 a layer whose keys are large
saturates e4m3 at 448, and one whose keys are small falls into the subnormals. Calibration sets each layer's
scale from the amax of the K/V its first forward writes, so that amax lands at half the format's largest
value (headroom for later tokens). Layers are calibrated once; pools that are not fp8 keep scale 1.0.
"""

from __future__ import annotations

import torch

from paged_backend.core.kv_cache import PagedKVCache
from paged_backend.ops.reference import is_fp8

HEADROOM = 2.0  # the first step's amax maps to max / HEADROOM
SMALLEST_SCALE = 1e-8  # an all-zero first step must not give a zero scale


def start_calibration(kv_cache: PagedKVCache) -> None:
    """Mark every layer of an fp8 pool to take its scales from the next K/V it writes."""
    if is_fp8(kv_cache.dtype):
        kv_cache.scales_pending = set(range(kv_cache.num_layers))


def _scale(x: torch.Tensor, dtype: torch.dtype) -> float:
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    return max(amax * HEADROOM / torch.finfo(dtype).max, SMALLEST_SCALE)


def calibrate_layer(kv_cache: PagedKVCache, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Set `layer_idx`'s scales from the K/V about to be written, if that layer still waits for them."""
    if layer_idx in kv_cache.scales_pending:
        kv_cache.k_scales[layer_idx] = _scale(key, kv_cache.dtype)
        kv_cache.v_scales[layer_idx] = _scale(value, kv_cache.dtype)
        kv_cache.scales_pending.discard(layer_idx)
