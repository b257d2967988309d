"""PagedCache: a transformers `Cache` whose K/V lives in the core's paged pool, one sequence per batch row.

`generate` drives it through the Cache contract (update / get_seq_length / get_mask_sizes / reorder_cache /
crop). Under sdpa or eager attention `update` returns K/V gathered from the pool, rectangular and aligned with
the 2D mask (pads stored). Under attn_implementation="paged_backend" it returns a handle whose `attend` writes
and reads the pool directly; pads are never stored there, so per-row lengths exclude them.

Each forward is planned on layer 0 (`_begin_step`: which columns are stored, which rows repeat another, the
slots they get) and every later layer reuses that plan.
"""

from __future__ import annotations

import torch
from transformers import Cache

from paged_backend.core.kv_snapshot import KVHistory, pool_snapshot
from paged_backend.errors import InvalidRequest, OutOfBlocks
from paged_backend.worker.attention import ATTN_IMPLEMENTATION, PagedMetadata, attend_packed

from . import dense_kv
from .cache_pool import build_pool
from .cache_stats import CacheStats
from .forward_step import ForwardStep, has_holes, new_columns, paged_metadata
from .identical_rows import identical_rows
from .layer_handle import PagedLayerKV
from .model_support import check_update_shapes
from .row_blocks import RowBlocks


class PagedCache(Cache):
    """Paged KV storage for `model.generate`, with prompt sharing across repeated rows and beams.

    `model_or_config` is the model (the pool takes its dtype and device, and each forward reads its current
    attn_implementation) or its config. Give at most one budget: `max_tokens` (KV slots), `num_blocks`, or
    `memory_bytes`; with none the pool takes the engine's default budget (`core.kv_budget`). `backend` picks the
    paged-attention op backend (default: auto).

    >>> cache = PagedCache(model, max_tokens=32_768)                             # doctest: +SKIP
    >>> out = model.generate(**inputs, past_key_values=cache, num_beams=4)       # doctest: +SKIP
    >>> print(cache.stats()); cache.reset()                                      # doctest: +SKIP
    """

    def __init__(
        self,
        model_or_config,
        *,
        max_tokens: int | None = None,
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__(layers=[])
        pool = build_pool(
            model_or_config, max_tokens=max_tokens, num_blocks=num_blocks, memory_bytes=memory_bytes,
            block_size=block_size, dtype=dtype, device=device,
        )  # fmt: skip
        self.config, self.geometry, self.groups = pool.config, pool.geometry, pool.groups
        self.block_manager, self.kv_cache = pool.block_manager, pool.kv_cache
        self.backend = backend
        self.kv_history = KVHistory()  # one point per forward, for kv_map()
        self.rows = RowBlocks(self.block_manager, self.kv_cache)
        self._clear()

    def _clear(self) -> None:
        self._columns = torch.zeros(0, 0, dtype=torch.bool)  # [B, seq_length]: which columns are stored
        self._seq_length = 0  # columns per row, padding included (what transformers calls the cache length)
        self._paged: bool | None = None  # attention mode the current contents were written under
        self._step: ForwardStep | None = None
        self._peak_used_blocks = 0

    # ------------------------------------------------------------ Cache contract
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seq_length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        visible = self._visible_past(layer_idx, self._seq_length)
        return visible + query_length, self._seq_length - visible

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._seq_length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def __len__(self) -> int:
        return self.geometry.num_layers

    def __repr__(self) -> str:
        return f"PagedCache({len(self.rows)} rows x {self._seq_length} columns; {self.stats()})"

    @property
    def is_compileable(self) -> bool:
        return False  # shapes change every step; True would make generate pre-build 4D masks and compile

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return bool(self.rows.seqs)

    @property
    def batch_size(self) -> int:
        return len(self.rows) if self.rows.seqs else -1

    @property
    def is_sliding(self) -> list[bool]:
        return [window is not None for window in self.geometry.sliding_windows]

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.geometry.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.geometry.num_layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store this layer's new K/V. Returns (K, V) for sdpa/eager, or a pool handle for paged_backend."""
        check_update_shapes(key_states, value_states, self.geometry, layer_idx)
        if self.config._attn_implementation == ATTN_IMPLEMENTATION:
            handle = PagedLayerKV(self, layer_idx, key_states, value_states)
            return handle, handle  # the step is planned in attend: it needs the padding mask
        if layer_idx == 0:
            self._begin_step(key_states, value_states, None, paged=False)
        step = self._step
        self._check_followers(layer_idx, key_states, value_states)
        key_cache, value_cache = self.kv_cache.layer(layer_idx)
        slot_mapping = step.metadata.for_layer(layer_idx).on(key_cache.device).slot_mapping
        dense_kv.store(key_states, value_states, (key_cache, value_cache), slot_mapping, self.backend)
        if step.fresh:  # contiguous like DynamicCache's concatenation: kernels round by memory layout
            return key_states.contiguous(), value_states.contiguous()
        # Sliding layers see what DynamicCache keeps (window - 1 past columns), so the math is the same.
        q_len = key_states.shape[2]
        columns = self._visible_past(layer_idx, self._seq_length - q_len) + q_len
        slots = step.gather_slots[self.kv_cache.layer_group[layer_idx]][:, -columns:]
        return (
            dense_kv.gather(key_cache, key_states.dtype, slots),
            dense_kv.gather(value_cache, value_states.dtype, slots),
        )

    def attend_layer(self, handle: PagedLayerKV, query, scaling, sliding_window, softcap, attention_mask):
        """Paged-attention path of `update`'s handle: plan on layer 0, then write and attend from the pool."""
        if handle.layer_idx == 0:
            self._begin_step(handle.key, handle.value, attention_mask, paged=True)
        step = self._step
        if sliding_window is not None and step.has_holes:
            raise InvalidRequest(
                "paged_backend attention skips padding, so a sliding window cannot count padding columns that sit "
                "between real tokens; left-pad the batch, or use attn_implementation='sdpa'"
            )
        self._check_followers(handle.layer_idx, handle.key, handle.value)
        # A follower with the leader's query, blocks and mask has the leader's output: attend once per prompt.
        mirrors = {row: lead for row, lead in step.followers.items() if torch.equal(query[row], query[lead])}
        metadata = self._metadata_for([r for r in range(len(self.rows)) if r not in mirrors]) if mirrors else None
        out = attend_packed(
            self.kv_cache, handle.layer_idx, query, handle.key, handle.value, metadata or step.metadata,
            scaling, sliding_window, softcap,
        )
        for row, lead in mirrors.items():
            out[row] = out[lead]
        return out

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues row beam_idx[i]. Block tables are permuted; no KV is copied."""
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.rows.select(indices.tolist())
        self._columns = self._columns[indices.cpu()]

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Row i becomes rows i*repeats .. i*repeats+repeats-1, all sharing its blocks."""
        self.rows.repeat_interleave(repeats)
        self._columns = self._columns.repeat_interleave(repeats, dim=0)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` columns (negative, as transformers passes it)."""
        if tokens_to_remove > 0:
            raise InvalidRequest(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        keep = max(self._seq_length + tokens_to_remove, 0)
        self.rows.truncate(self._columns[:, :keep].sum(dim=1).tolist())
        self._columns = self._columns[:, :keep]
        self._seq_length = keep

    def reset(self) -> None:
        """Free every row's blocks (and the peak counter); the cache is empty and reusable for a new generate."""
        self.rows.free()
        self._clear()

    def kv_map(self, path: str = "kv_map.png", *, title: str = "PagedCache"):
        """Draw the pool now as `path` (PNG) and the same name with .html, one owner per batch row."""
        from paged_backend.core.kv_map import draw_kv_map

        owners = {seq: f"row {row}" for row, seq in enumerate(self.rows.seqs)}
        return draw_kv_map(pool_snapshot(self.block_manager, owners, self.kv_history), path, title=title)

    def stats(self) -> CacheStats:
        """Blocks used / shared / free, bytes, waste % and what prompt sharing saved."""
        return CacheStats(self.block_manager.stats(), self.kv_cache.bytes_per_block, self._peak_used_blocks)

    # -------------------------------------------------------------------- steps
    def _begin_step(self, key: torch.Tensor, value: torch.Tensor, attention_mask, *, paged: bool) -> None:
        batch, _, q_len, _ = key.shape
        fresh = not self.rows.seqs
        if not fresh and self._paged != paged:
            raise InvalidRequest(
                "this PagedCache was filled under another attention implementation; call cache.reset() "
                "before generating with a different attn_implementation"
            )
        if not fresh and batch != len(self.rows):
            self._expand_to(batch, key, value)
        columns = new_columns(attention_mask, self._columns, batch, q_len) if paged else torch.ones(batch, q_len).bool()
        if fresh:  # only now: a refused mask must leave the cache empty
            self._paged = paged
            self.rows.open(batch)
            self._columns = torch.zeros(batch, 0, dtype=torch.bool)
        # Prompts (also chunked or continued ones) can repeat across rows; single decode tokens rarely do.
        followers = identical_rows(key, value, columns, self.rows.block_tables()) if q_len > 1 or fresh else {}
        stored_before = [self.rows.num_stored(row) for row in range(batch)]
        try:
            self.rows.reserve(columns.sum(dim=1).tolist(), followers)
        except OutOfBlocks as exc:
            self.reset()  # some rows grew and others did not: nothing consistent is left to keep
            raise OutOfBlocks(f"{exc} (the PagedCache was reset)") from exc
        self._columns = torch.cat([self._columns, columns], dim=1)
        self._seq_length += q_len
        self._step = ForwardStep(fresh, columns, stored_before, followers, has_holes=has_holes(self._columns))
        self._build_metadata()
        used = self.block_manager.num_blocks - 1 - self.block_manager.num_free_blocks  # - the null block
        self._peak_used_blocks = max(self._peak_used_blocks, used)
        self.kv_history.record(self.block_manager)

    def _expand_to(self, batch: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """A filled cache meets generate's k-times expanded batch (beams / num_return_sequences): fork rows. Such a
        batch repeats each row k times, so its new K/V repeat too (up to rounding: a GEMM may round rows apart by
        where they sit); a batch of other prompts does not, and forking would attend them to the old rows' past."""
        rows = len(self.rows)
        expanded = batch % rows == 0 and all(_repeats(states, batch // rows) for states in (key, value))
        if not expanded:
            raise InvalidRequest(
                f"the cache holds {rows} row(s) but the model got a batch of {batch} that does not repeat them; "
                f"continue with the same rows (or each repeated, for beams / num_return_sequences), or call "
                f"cache.reset() before a new batch"
            )
        self.batch_repeat_interleave(batch // rows)

    def _build_metadata(self) -> None:
        step = self._step
        step.metadata = self._metadata_for(list(range(len(self.rows))))
        if not self._paged and not step.fresh:
            step.gather_slots = [
                dense_kv.gather_slots(
                    step.metadata.for_layer(group.layers[0]).block_tables, self._seq_length, self.kv_cache.block_size
                )
                for group in self.groups
            ]

    def _metadata_for(self, rows: list[int]) -> PagedMetadata:
        return paged_metadata(
            self._step, self.block_manager, self.rows.seqs, rows, self.kv_cache.device, self.backend,
            self.kv_cache.layer_group,
        )

    def _check_followers(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Rows grouped on layer 0 must still match here; a row that differs gets its own copy of the blocks."""
        step = self._step
        if layer_idx == 0 or not step.followers:
            return
        diverged = [
            row for row, leader in step.followers.items()
            if not (torch.equal(key[row], key[leader]) and torch.equal(value[row], value[leader]))
        ]
        for row in diverged:
            self.rows.unshare(row, step.followers.pop(row))
        if diverged:
            self._build_metadata()

    def _visible_past(self, layer_idx: int, past: int) -> int:
        """Past columns a layer attends over in sdpa/eager: all, or the last window - 1 for sliding layers."""
        window = self.geometry.sliding_windows[layer_idx]
        return past if window is None else min(past, window - 1)


def _repeats(states: torch.Tensor, times: int) -> bool:
    """Whether `states` [batch, ...] is each of its every `times`-th rows repeated `times` times, to a tolerance far
    above rounding and far below what another token's K/V differs by."""
    states = states.float()
    repeated = states[::times].repeat_interleave(times, dim=0)
    return torch.allclose(states, repeated, rtol=0.02, atol=0.02 * float(states.abs().amax()))
