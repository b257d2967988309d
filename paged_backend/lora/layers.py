"""Batched low-rank updates over a packed step in which every row may use a different adapter (or none).

Each adapted linear layer keeps every device slot's A and B side by side (`A [slots * R, in]`,
`B [out, slots * R]` with peft's scaling folded in, R = max_lora_rank, unused rank columns zero). A step then
costs two matmuls per layer whatever its mix of adapters: shrink every row against the step's slots, zero the
columns that are not the row's own slot, expand, add to the shared base projection's output. The base
projection runs once and is never modified; base-only steps skip all of this.

The update is a forward hook on the model's own `nn.Linear`s that does nothing unless its owner has a step
active on this thread, so the model's plain `generate()` and other engines on the same object are unaffected.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class StepRows:
    """One step's rows: the mask that keeps each row's own slot columns (none for base rows)."""

    mask: torch.Tensor  # [T, C] in the model dtype: 1 on the row's slot columns, 0 elsewhere
    num_columns: int  # C: the columns of slots 0..highest slot in this step (fewer slots, less work)


class LayerStack:
    """All slots' weights for one linear layer."""

    def __init__(self, module: nn.Linear, num_slots: int, max_rank: int, like: torch.Tensor) -> None:
        options = dict(dtype=like.dtype, device=like.device)  # the adapter's, not a quantized weight's dtype
        self.lora_a = torch.zeros(num_slots * max_rank, module.in_features, **options)
        self.lora_b = torch.zeros(module.out_features, num_slots * max_rank, **options)  # scaling folded in
        self.max_rank = max_rank

    def clear(self, slot: int) -> None:
        columns = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        self.lora_a[columns].zero_()
        self.lora_b[:, columns].zero_()

    def write(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> None:
        start, rank = slot * self.max_rank, lora_a.shape[0]
        self.lora_a[start : start + rank].copy_(lora_a)
        self.lora_b[:, start : start + rank].copy_(lora_b * scaling)

    def add_to(self, output: torch.Tensor, x: torch.Tensor, rows: StepRows) -> torch.Tensor:
        """`output + delta(x)`; the add is fused into the expand matmul."""
        flat, columns = x.reshape(-1, x.shape[-1]), rows.num_columns
        shrunk = torch.mm(flat, self.lora_a[:columns].T).mul_(rows.mask)
        return torch.addmm(output.reshape(-1, output.shape[-1]), shrunk, self.lora_b[:, :columns].T).view_as(output)


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
        for stack in self.stacks.values():
            stack.clear(slot)
        for name, (lora_a, lora_b, scaling) in weights.items():
            if name not in self.stacks:
                self.stacks[name] = stack = LayerStack(self.linears[name], self.num_slots, self.max_rank, lora_a)
                self._handles.append(self.linears[name].register_forward_hook(_hook(weakref.ref(self), stack)))
            self.stacks[name].write(slot, lora_a, lora_b, scaling)

    def rows(self, token_slots: list[int], device, dtype) -> StepRows:
        """Rows for one step; `token_slots[t]` is the slot of packed row t, or -1 for the base model."""
        num_columns = (max(token_slots) + 1) * self.max_rank
        slots = torch.tensor(token_slots, dtype=torch.long, device=device)
        column_slot = torch.arange(num_columns, device=device) // self.max_rank
        mask = (column_slot.unsqueeze(0) == slots.unsqueeze(1)).to(dtype)
        return StepRows(mask, num_columns)


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
