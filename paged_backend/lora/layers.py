"""Batched low-rank updates over a packed step in which every row may use a different adapter (or none).

Each adapted linear layer keeps every device slot's weights stacked, `A [slots, R, in]` and `B [slots, out, R]`
(peft's scaling folded into B, R = max_lora_rank, unused rank columns zero). A step gathers its adapted rows into
one padded segment per adapter (`StepRows`), then shrinks and expands every segment with one batched matmul each
against only that segment's adapter and only the step's largest rank (punica's segmented-gather idea in plain
torch), and adds the result back into the shared base projection's output. The base projection runs once and is
never modified; base-only steps skip all of this, and a step whose rows all use one adapter skips the gather.

The update is a forward hook on the model's own `nn.Linear`s that does nothing unless its owner has a step
active on this thread, so the model's plain `generate()` and other engines on the same object are unaffected.
Under tensor parallelism each rank keeps its part of every adapter (`shard_lora`), and the hook runs before the
layer's all-reduce so a row-parallel layer's partial update is summed with its partial output.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from paged_backend.distributed.sharding import shard_lora


@dataclass
class StepRows:
    """One step's adapted rows, grouped by adapter slot into padded segments."""

    slots: torch.Tensor  # [S] the device slots used this step
    rank: int  # the largest rank among the step's adapters: columns beyond it are zero in every slot
    index: torch.Tensor | None = None  # [S * L] packed row of each segment entry (padding repeats a real row)
    valid: torch.Tensor | None = None  # [S, L, 1] 1 on real entries, 0 on padding (model dtype)

    @property
    def whole(self) -> bool:
        """One slot for every row, in order: no gather or scatter needed."""
        return self.index is None


class LayerStack:
    """All slots' weights for one linear layer."""

    def __init__(self, module: nn.Linear, num_slots: int, max_rank: int, like: torch.Tensor) -> None:
        options = dict(dtype=like.dtype, device=like.device)  # the adapter's, not a quantized weight's dtype
        self.lora_a = torch.zeros(num_slots, max_rank, module.in_features, **options)
        self.lora_b = torch.zeros(num_slots, module.out_features, max_rank, **options)  # scaling folded in

    def clear(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def write(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> None:
        rank = lora_a.shape[0]
        self.lora_a[slot, :rank].copy_(lora_a)
        self.lora_b[slot, :, :rank].copy_(lora_b * scaling)

    def add_to(self, output: torch.Tensor, x: torch.Tensor, rows: StepRows) -> torch.Tensor:
        """`output + delta(x)` for the step's adapted rows."""
        flat, out = x.reshape(-1, x.shape[-1]), output.reshape(-1, output.shape[-1])
        if rows.whole:  # every row, one adapter: two plain matmuls, the add fused into the second
            slot = int(rows.slots[0])
            shrunk = torch.mm(flat, self.lora_a[slot, : rows.rank].T)
            return torch.addmm(out, shrunk, self.lora_b[slot, :, : rows.rank].T).view_as(output)
        lora_a = self.lora_a.index_select(0, rows.slots)[:, : rows.rank]  # [S, r, in]
        lora_b = self.lora_b.index_select(0, rows.slots)[:, :, : rows.rank]  # [S, out, r]
        segments = flat.index_select(0, rows.index).view(len(rows.slots), -1, flat.shape[-1])  # [S, L, in]
        delta = torch.bmm(torch.bmm(segments, lora_a.transpose(1, 2)), lora_b.transpose(1, 2)).mul_(rows.valid)
        return out.index_add(0, rows.index, delta.view(-1, out.shape[-1])).view_as(output)


class SlotLayers:
    """The device slots of every adapted layer of one model, and the per-step rows the hooks read."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int) -> None:
        self.linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        self.num_slots, self.max_rank = num_slots, max_rank
        self.stacks: dict[str, LayerStack] = {}
        self.local = threading.local()  # the active step, per thread: engines on other threads see none
        self._handles: list = []
        weakref.finalize(self, _remove_hooks, self._handles)  # the model forgets the hooks with their owner

    def write(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Put one adapter's weights in `slot`. Layers this rank does not hold (another pipeline stage) are
        skipped; sharded layers keep this rank's part."""
        for stack in self.stacks.values():
            stack.clear(slot)
        for name, (lora_a, lora_b, scaling) in weights.items():
            module = self.linears.get(name)
            if module is None:
                continue
            lora_a, lora_b = shard_lora(module, lora_a, lora_b)
            if name not in self.stacks:
                self.stacks[name] = LayerStack(module, self.num_slots, self.max_rank, lora_a)
                hook = _hook(weakref.ref(self), self.stacks[name])
                self._handles.append(module.register_forward_hook(hook, prepend=True))  # before any all-reduce
            self.stacks[name].write(slot, lora_a, lora_b, scaling)

    @contextmanager
    def step(self, token_slots: list[int], rank: int, device, dtype) -> Iterator[None]:
        """For one forward on this thread: the hooks add each row's update (`rows`)."""
        self.local.rows = self.rows(token_slots, rank, device, dtype)
        try:
            yield
        finally:
            self.local.rows = None

    def rows(self, token_slots: list[int], rank: int, device, dtype) -> StepRows | None:
        """Rows for one step; `token_slots[t]` is the slot of packed row t, or -1 for the base model. `rank`: the
        largest rank among the step's adapters. None when no row is adapted."""
        segments: dict[int, list[int]] = {}
        for row, slot in enumerate(token_slots):
            if slot >= 0:
                segments.setdefault(slot, []).append(row)
        if not segments:
            return None
        slots = torch.tensor(list(segments), dtype=torch.long, device=device)
        if len(segments) == 1 and len(next(iter(segments.values()))) == len(token_slots):
            return StepRows(slots, rank)
        length = max(map(len, segments.values()))
        index = [rows + rows[:1] * (length - len(rows)) for rows in segments.values()]
        valid = [[1] * len(rows) + [0] * (length - len(rows)) for rows in segments.values()]
        return StepRows(
            slots,
            rank,
            torch.tensor(index, dtype=torch.long, device=device).view(-1),
            torch.tensor(valid, dtype=dtype, device=device).unsqueeze(-1),
        )


def _hook(owner_ref, stack: LayerStack):
    """A forward hook adding the step's low-rank update; it returns None (no change) outside its owner's steps."""

    def hook(module, args, output):
        owner = owner_ref()
        rows = None if owner is None else getattr(owner.local, "rows", None)
        return None if rows is None else stack.add_to(output, args[0], rows)

    return hook


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()
