"""The bridge between transformers models and the paged pool: attention implementation "paged_backend".

A paged cache's ``update(k, v, layer_idx)`` returns a *handle* (anything with an ``attend`` method) instead
of contiguous K/V. transformers passes that handle unchanged to the attention function, which lets the
handle write the new K/V into the pool and run ``paged_attention`` over it. So a model loaded with
``attn_implementation="paged_backend"`` never materializes contiguous KV.

Per-forward metadata (``PagedMetadata``) is built once by the cache owner and reused by every layer. With
layer groups (sliding-window layers apart, see ``kv_groups``) there is one per group and each layer reads its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from paged_backend.core.kv_cache import PagedKVCache
from paged_backend.errors import UnsupportedModel
from paged_backend.ops import StepAttention

ATTN_IMPLEMENTATION = "paged_backend"
PROFILE_LABEL = "paged_backend::attention"  # cache write + paged attention of one layer, in profiler traces


@dataclass
class PagedMetadata:
    """Everything `paged_attention` needs for one forward, shared by all layers."""

    slot_mapping: torch.Tensor  # [N] pool slot of each new token (-1: do not store)
    block_tables: torch.Tensor  # [B, M] int32
    seq_lens: torch.Tensor  # [B] int32, context length including the new tokens
    query_start_loc: torch.Tensor  # [B+1] int32, rows of each sequence in the packed query
    row_index: torch.Tensor | None = None  # real rows of the flattened [batch * q_len] layout; None = all
    backend: str | None = None
    # Layer groups: metadata of every group (this object is group 0's) and the group of each layer.
    groups: tuple[PagedMetadata, ...] = field(default=(), repr=False)
    layer_group: Sequence[int] = ()
    _copies: dict = field(default_factory=dict, repr=False, compare=False)
    _step: StepAttention | None = field(default=None, repr=False, compare=False)

    @property
    def step(self) -> StepAttention:
        """The write and attention of every layer reading this metadata, dispatched once per forward."""
        if self._step is None:
            self._step = StepAttention(self.slot_mapping, self.block_tables, self.seq_lens, self.query_start_loc,
                                       self.backend)  # fmt: skip
        return self._step

    def for_layer(self, layer_idx: int) -> PagedMetadata:
        return self.groups[self.layer_group[layer_idx]] if self.layer_group else self

    def on(self, device: torch.device) -> PagedMetadata:
        """This metadata on `device`, copied once per forward (a device map runs layers on several devices)."""
        if self.slot_mapping.device == device:
            return self
        if device not in self._copies:
            names = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")
            moved = {name: getattr(self, name).to(device) for name in names}
            row_index = None if self.row_index is None else self.row_index.to(device)
            self._copies[device] = replace(self, **moved, row_index=row_index, _copies={}, _step=None)
        return self._copies[device]


def grouped_metadata(
    tables: list[list[list[int]]], slots: list[list[int]], shared: PagedMetadata, layer_group: Sequence[int]
) -> PagedMetadata:
    """Per-group block tables / slot mappings over `shared`'s lengths, query starts, rows and backend.

    `tables[g]` and `slots[g]` are group g's; a single group gives plain metadata (the no-window fast path).
    """
    device = shared.seq_lens.device
    groups = tuple(
        replace(
            shared,
            slot_mapping=torch.tensor(group_slots, dtype=torch.long, device=device),
            block_tables=block_table_tensor(group_tables, device),
            _copies={},  # each group's own device copies
            _step=None,
        )
        for group_tables, group_slots in zip(tables, slots, strict=True)
    )
    if len(groups) == 1:
        return groups[0]
    return replace(groups[0], groups=groups, layer_group=layer_group, _copies={}, _step=None)


def block_table_tensor(tables: list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """Ragged block tables as one `[B, M]` int32 tensor, padded with the null block 0 (at least one column)."""
    width = max(1, *map(len, tables)) if tables else 1
    return torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32, device=device)


class PagedHandle(Protocol):
    def attend(
        self,
        query: torch.Tensor,
        scaling: float,
        sliding_window: int | None,
        softcap: float | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """`query [B, Hq, q, D]` -> attention output `[B, q, Hq, D]`, after storing this layer's new K/V."""


@dataclass
class PackedKV:
    """Handle for one layer of a forward whose metadata is fully known before the forward runs."""

    cache: PagedKVCache
    layer_idx: int
    key: torch.Tensor  # [B, Hkv, q, D] new keys of this forward
    value: torch.Tensor
    metadata: PagedMetadata

    def attend(self, query, scaling, sliding_window, softcap, attention_mask=None) -> torch.Tensor:
        return attend_packed(
            self.cache, self.layer_idx, query, self.key, self.value, self.metadata, scaling, sliding_window, softcap
        )


def token_rows(x: torch.Tensor, row_index: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H, q, D] -> [B*q, H, D], row-major like a slot mapping (optionally only the rows `row_index`)."""
    batch, heads, q_len, dim = x.shape
    rows = x.transpose(1, 2).reshape(batch * q_len, heads, dim)
    return rows if row_index is None else rows.index_select(0, row_index)


def attend_packed(
    cache: PagedKVCache,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    metadata: PagedMetadata,
    scaling: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Store this layer's new K/V, then paged attention. Returns `[B, q, Hq, D]` (zeros on non-real rows)."""
    metadata = metadata.for_layer(layer_idx)  # the layer's group's block tables and slots
    batch, num_heads, q_len, head_dim = query.shape
    key_cache, value_cache = cache.layer(layer_idx)
    metadata = metadata.on(key_cache.device)
    k_scale, v_scale = cache.k_scales[layer_idx], cache.v_scales[layer_idx]
    rows, step = metadata.row_index, metadata.step
    with _profiled():
        step.write(token_rows(key, rows), token_rows(value, rows), key_cache, value_cache, k_scale=k_scale,
                   v_scale=v_scale)  # fmt: skip
        out = step.attend(token_rows(query, rows), key_cache, value_cache, scaling, sliding_window=sliding_window,
                          softcap=softcap, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    if metadata.row_index is not None:
        full = out.new_zeros(batch * q_len, num_heads, head_dim)
        full.index_copy_(0, metadata.row_index, out)
        out = full
    return out.view(batch, q_len, num_heads, head_dim)


def _profiled():
    """The layer's label in a profiler's trace. The label costs ~4 us a layer to build even with no profiler running,
    so it is built only under one (torch's own code asks the same question for its labels)."""
    return torch.profiler.record_function(PROFILE_LABEL) if torch.autograd._profiler_enabled() else _UNLABELLED


_UNLABELLED = nullcontext()


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key,
    value,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function reading K/V straight from the paged pool."""
    if not hasattr(key, "attend"):
        raise UnsupportedModel(
            "attn_implementation='paged_backend' reads K/V from a paged pool: pass "
            "past_key_values=PagedCache(model, ...) to generate(), or run the model through the paged-backend engine"
        )
    if dropout and module.training:
        raise UnsupportedModel("paged_backend attention is inference-only; call model.eval() or set dropout to 0")
    if kwargs.get("s_aux") is not None:
        raise UnsupportedModel("attention sinks (s_aux) are not supported by paged_backend attention")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return key.attend(query, scale, sliding_window, softcap, attention_mask), None


def padding_mask_only(batch_size: int, q_length: int, kv_length: int, *args, attention_mask=None, **kwargs):
    """Mask function for "paged_backend": causality and windows come from sequence lengths, so pass only
    the 2D padding mask through (None when there is no padding), never a dense [q, kv] mask."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask.bool()


def register_paged_attention() -> str:
    """Register the "paged_backend" attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask_only)
    return ATTN_IMPLEMENTATION


def model_configs(model: torch.nn.Module) -> list:
    """The model's config and every nested sub-config (multimodal models keep one per tower)."""
    found, pending = [], deque([model.config])
    while pending:
        config = pending.popleft()
        if all(config is not seen for seen in found):
            found.append(config)
            pending.extend(sub for key in config.sub_configs if (sub := getattr(config, key, None)) is not None)
    return found


@contextmanager
def paged_attention_enabled(configs: list) -> Iterator[None]:
    """Run the forward inside with "paged_backend" attention, then give each config its own implementation back.

    The engine switches attention per forward instead of for good, so a model object a caller hands to `LLM`
    still runs `generate()` with its own attention between (and after) engine steps.
    """
    saved = [config._attn_implementation_internal for config in configs]
    for config in configs:
        config._attn_implementation_internal = ATTN_IMPLEMENTATION
    try:
        yield
    finally:
        for config, implementation in zip(configs, saved, strict=True):
            config._attn_implementation_internal = implementation
