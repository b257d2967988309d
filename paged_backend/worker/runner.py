"""Packs one scheduled step into a `[1, T]` batch and runs the HF model over the paged pool.

Metadata (slot mapping, block tables, sequence lengths, query start locations) is built once per step and
shared by every layer through `PackedKV` handles; with layer groups each group gets its own block tables and
slot mapping (`grouped_metadata`), and each layer's handle reads its group's. Logits are computed only at each sampling sequence's last
position (`logits_to_keep`), never for the whole packed prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from transformers import Cache, PreTrainedModel

from paged_backend.core.block_manager import slot_of
from paged_backend.core.kv_cache import PagedKVCache
from paged_backend.core.kv_scales import calibrate_layer
from paged_backend.worker.attention import (
    PackedKV,
    PagedMetadata,
    grouped_metadata,
    model_configs,
    paged_attention_enabled,
    register_paged_attention,
)
from paged_backend.worker.decode_graphs import DecodeGraphs
from paged_backend.worker.fused_forward import FusedForward, StepCut, unfused_reason  # noqa: F401 (StepCut: part of execute's contract)
from paged_backend.worker.packed_linear import PackedLinears


class StepCache(Cache):
    """The per-step cache handed to the model: `update` returns handles that write to and read from the pool."""

    def __init__(self, kv_cache: PagedKVCache, metadata: PagedMetadata) -> None:
        super().__init__(layers=[])
        self.kv_cache, self.metadata = kv_cache, metadata

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.kv_cache.scales_pending:
            calibrate_layer(self.kv_cache, layer_idx, key_states, value_states)
        handle = PackedKV(self.kv_cache, layer_idx, key_states, value_states, self.metadata)
        return handle, handle


@dataclass
class SequenceRows:
    """One sequence's share of a step, as plain data: all a worker needs, none of the scheduler's objects."""

    token_ids: list[int]  # the tokens fed this step: a prompt chunk or the last token, then any draft tokens
    start: int  # position of token_ids[0]
    block_tables: Sequence[list[int]]  # one block table per KV group
    num_logit_rows: int = 1  # trailing rows whose logits are kept: 0 mid-prefill, 1, or 1 + drafts to verify
    slots: Sequence[list[int]] | None = None  # per group, each token's slot when the caller assigns them (TGI)


class ModelRunner:
    """Runs one packed forward of a step's `SequenceRows` over the paged pool; returns the kept logits rows.

    It takes block tables as data and never sees the scheduler or the block manager (vLLM V1's worker contract), so
    the engine, the draft model and the TGI shard, which keep their tables differently, share it."""

    def __init__(
        self,
        model: PreTrainedModel,
        kv_cache: PagedKVCache,
        attention_backend: str | None = None,
        packed: PackedLinears | None = None,
    ) -> None:
        register_paged_attention()
        self.model = model
        self.packed = packed  # prepacked CPU linear layers, swapped in for each forward like attention
        self.model_configs = model_configs(model)  # switched to paged attention for each forward only
        self.kv_cache = kv_cache
        self.owns_model = False  # the model was loaded for this runner alone (set by `model_worker.model_runner`)
        self.attention_backend = attention_backend
        self.device = kv_cache.device
        # Llama-family models on CPU run on the fused kernels; the reason says why another model does not
        self.unfused_reason = unfused_reason(model, kv_cache, attention_backend)
        self.fused = FusedForward(model, kv_cache, packed) if self.unfused_reason is None else None
        self.decode_graphs: DecodeGraphs | None = None  # set by `use_decode_graphs`

    def use_decode_graphs(self, max_batch: int, max_blocks: int, *, capture: bool = True) -> None:
        """Run decode steps of up to `max_batch` sequences from captured CUDA graphs (`capture=False`: the same
        padded static-buffer steps, eagerly). transformers' forward only: the fused CPU forward has no graphs."""
        if self.fused is not None:
            raise ValueError("decode graphs replay transformers' forward; this runner runs the fused CPU forward")
        self.decode_graphs = DecodeGraphs(self._model_logits, self.kv_cache, max_batch, max_blocks,
                                          backend=self.attention_backend, capture=capture)  # fmt: skip

    def prepare(self, rows: list[SequenceRows]) -> tuple[torch.Tensor, torch.Tensor, PagedMetadata, list[int]]:
        """Flatten the step into input ids, positions, paged metadata and the packed rows whose logits are kept."""
        block_size = self.kv_cache.block_size
        num_groups = len(self.kv_cache.groups)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in range(num_groups)]
        seq_lens: list[int] = []
        query_start_loc = [0]
        tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
        logit_rows: list[int] = []
        for row in rows:
            start, end = row.start, row.start + len(row.token_ids)
            input_ids += row.token_ids
            positions += range(start, end)
            for group, table in enumerate(row.block_tables):
                if row.slots is not None:
                    slots[group] += row.slots[group]
                elif end - start == 1:  # the decode hot path: one slot, no list building
                    slots[group].append(slot_of(table, start, block_size))
                else:
                    slots[group] += [slot_of(table, position, block_size) for position in range(start, end)]
                tables[group].append(table)
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + end - start)
            logit_rows += range(query_start_loc[-1] - row.num_logit_rows, query_start_loc[-1])
        int32 = dict(dtype=torch.int32, device=self.device)
        shared = PagedMetadata(
            slot_mapping=None,
            block_tables=None,
            seq_lens=torch.tensor(seq_lens, **int32),
            query_start_loc=torch.tensor(query_start_loc, **int32),
            backend=self.attention_backend,
        )
        metadata = grouped_metadata(tables, slots, shared, self.kv_cache.layer_group)
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        pos = torch.tensor([positions], dtype=torch.long, device=self.device)
        return ids, pos, metadata, logit_rows

    def execute(
        self, rows: list[SequenceRows], extra_rows: list[int] = (), cut: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        """One packed forward of `rows`. Returns float32 logits of each row's kept positions (its last
        `num_logit_rows`, in row order), then those of the packed positions `extra_rows` (prompt logprobs).

        Where the fused forward runs (`cuts_steps`), `cut` is asked between layers and, once it says so, the
        forward stops with StepCut: its KV writes so far are for slots the step recomputes, so nothing is lost."""
        if self.decode_graphs is not None and self.decode_graphs.takes(rows, extra_rows):
            return self.decode_graphs.run(rows)
        ids, positions, metadata, logit_rows = self.prepare(rows)
        return self.forward(ids, positions, metadata, logit_rows + list(extra_rows), cut)

    @property
    def cuts_steps(self) -> bool:
        """Whether `execute` honours `cut` (the fused layer loop; the model's own forward runs to the end)."""
        return self.fused is not None

    @torch.inference_mode()
    def forward(
        self, ids, positions, metadata: PagedMetadata, rows: list[int], cut: Callable[[], bool] | None = None
    ) -> torch.Tensor:
        """Run the packed batch; float32 logits of the packed `rows` only (`logits_to_keep`), in that order."""
        # an fp8 pool's first step calibrates its scales from the keys transformers' forward hands the cache
        if self.fused is not None and not self.kv_cache.scales_pending:
            with self._eval_mode():
                return self.fused(ids, positions, metadata, rows, cut)
        return self._model_logits(ids, positions, metadata, torch.tensor(rows, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def _model_logits(self, ids, positions, metadata: PagedMetadata, keep: torch.Tensor) -> torch.Tensor:
        """transformers' forward over the pool: float32 logits of the packed rows `keep` (a tensor, so that a
        decode graph captures the forward with its buffers)."""
        with self._eval_mode(), paged_attention_enabled(self.model_configs), self._linears():
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                past_key_values=StepCache(self.kv_cache, metadata),
                use_cache=True,
                logits_to_keep=keep,
            )
        return out.logits[0].float()

    @contextmanager
    def _eval_mode(self) -> Iterator[None]:
        """A caller's model in train mode runs the forward in eval mode and gets train mode back after it."""
        training = self.model.training
        if training:
            self.model.eval()
        try:
            yield
        finally:
            if training:
                self.model.train()

    def _linears(self):
        return nullcontext() if self.packed is None else self.packed.active()
