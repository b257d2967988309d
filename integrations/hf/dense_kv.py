"""The sdpa / eager path: new K/V go into the pool, and each layer gets its past back as dense tensors.

transformers' own attention functions need rectangular `[B, Hkv, columns, D]` K/V aligned with the 2D mask, so
this path stores padding too and reads every column through the block tables.
"""

from __future__ import annotations

import torch

from paged_backend.ops import reshape_and_cache
from paged_backend.worker.attention import token_rows


def store(
    key: torch.Tensor, value: torch.Tensor, pools: tuple[torch.Tensor, torch.Tensor], slot_mapping, backend
) -> None:
    """Write `key`/`value` [B, Hkv, q, D] into one layer's `pools` at `slot_mapping` (row-major, one per token)."""
    reshape_and_cache(token_rows(key), token_rows(value), *pools, slot_mapping, backend=backend)


def gather(pool: torch.Tensor, dtype: torch.dtype, slots: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, columns, D] contiguous K or V of the pool `slots` [B, columns], read through the block tables."""
    flat = pool.view(-1, pool.shape[-2], pool.shape[-1])
    slots = slots.to(pool.device)
    rows = torch.index_select(flat, 0, slots.flatten())  # several times faster than advanced indexing on CPU
    return rows.view(*slots.shape, *flat.shape[1:]).transpose(1, 2).contiguous().to(dtype)


def gather_slots(block_tables: torch.Tensor, num_columns: int, block_size: int) -> torch.Tensor:
    """[B, num_columns] pool slot of every column of every row (rows that store every column).

    >>> gather_slots(torch.tensor([[3, 1]], dtype=torch.int32), 6, 4)
    tensor([[12, 13, 14, 15,  4,  5]])
    """
    positions = torch.arange(num_columns, device=block_tables.device)
    return block_tables.long()[:, positions // block_size] * block_size + positions % block_size


