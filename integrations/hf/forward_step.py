"""One forward's plan: which rows store which new tokens, and the metadata every layer reuses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_backend.core.block_manager import BlockManager
from paged_backend.errors import InvalidRequest
from paged_backend.worker.attention import PagedMetadata, grouped_metadata


@dataclass
class ForwardStep:
    """What one forward adds, decided on layer 0 and reused by every layer."""

    fresh: bool  # first forward into an empty cache: K/V can be returned as computed
    new_columns: torch.Tensor  # [B, q] bool, which new columns get stored (False: padding)
    stored_before: list[int]  # tokens each row held before this forward
    followers: dict[int, int]  # row -> leader row whose blocks it shares (identical prompts)
    metadata: PagedMetadata | None = None
    gather_slots: list[torch.Tensor] | None = None  # per layer group: [B, past + q] pool slots, for sdpa / eager
    has_holes: bool = False  # a padding column sits after a stored one in some row


def new_columns(attention_mask: torch.Tensor | None, stored: torch.Tensor, batch: int, q_len: int) -> torch.Tensor:
    """[batch, q_len] which of this forward's columns are real tokens (paged attention never stores padding).

    `stored` [batch, past] says which earlier columns were stored; the mask must repeat it and add q_len columns.

    >>> new_columns(torch.tensor([[0, 1, 1]]), torch.tensor([[False, True]]), 1, 1)
    tensor([[True]])
    """
    past = stored.shape[1]
    if attention_mask is None:
        if not bool(stored.all()):
            raise InvalidRequest(
                "the cache skipped padding columns earlier, so pass the full 2D attention_mask when continuing"
            )
        return torch.ones(batch, q_len, dtype=torch.bool)
    mask = attention_mask.bool().cpu()
    if tuple(mask.shape) != (batch, past + q_len):
        raise InvalidRequest(
            f"attention_mask has shape {tuple(mask.shape)}, expected ({batch}, {past + q_len}): past plus new columns"
        )
    if past and not torch.equal(mask[:, :past], stored):
        raise InvalidRequest(
            "the attention_mask's past columns differ from the padding the cache stored; keep the mask of "
            "earlier calls and append to it"
        )
    return mask[:, past:]


def has_holes(stored: torch.Tensor) -> bool:
    """Whether a padding column sits after a stored one in some row of `stored` [B, columns].

    >>> has_holes(torch.tensor([[False, True]])), has_holes(torch.tensor([[True, False]]))
    (False, True)
    """
    return bool((stored.int().cummax(dim=1).values > stored.int()).any())


def paged_metadata(
    step: ForwardStep,
    block_manager: BlockManager,
    seqs: list[int],
    rows: list[int],
    device,
    backend: str | None,
    layer_group: list[int],
) -> PagedMetadata:
    """Paged-attention metadata of `step` restricted to batch `rows` (the other rows get no query tokens).

    `seqs[row]` is the BlockManager sequence of each batch row; followers write nothing (slot -1).
    """
    bm = block_manager
    counts = step.new_columns.sum(dim=1).tolist()
    groups = range(bm.num_groups)
    slots: list[list[int]] = [[] for _ in groups]
    tables: list[list[list[int]]] = [[] for _ in groups]
    for row in rows:
        seq, before, count = seqs[row], step.stored_before[row], counts[row]
        own = row not in step.followers and count
        for group in groups:
            slots[group] += bm.slot_mapping(seq, before, before + count, group) if own else [-1] * count
            tables[group].append(bm.block_table(seq, group) if bm.has(seq) else [])
    seq_lens = [step.stored_before[row] + counts[row] for row in rows]
    starts = torch.tensor([0, *(counts[row] for row in rows)]).cumsum(0)
    queried = torch.zeros_like(step.new_columns)
    queried[rows] = step.new_columns[rows]
    row_index = None if bool(queried.all()) else queried.flatten().nonzero().squeeze(1)
    shared = PagedMetadata(
        slot_mapping=None,
        block_tables=None,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=starts.to(device=device, dtype=torch.int32),
        row_index=None if row_index is None else row_index.to(device),
        backend=backend,
    )
    return grouped_metadata(tables, slots, shared, layer_group)
