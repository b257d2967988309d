"""PagedCache: a transformers `Cache` whose K/V lives in the core's paged pool, one sequence per batch row.

`generate` drives it through the Cache contract (update / get_seq_length / get_mask_sizes / reorder_cache /
crop). Under sdpa or eager attention `update` returns K/V gathered from the pool, rectangular and aligned with
the 2D mask (pads stored). Under attn_implementation="paged_backend" it returns a handle whose `attend` writes
and reads the pool directly; pads are never stored there, so per-row lengths exclude them.
"""

from __future__ import annotations

import torch
from transformers import Cache

from paged_backend.worker.attention import ATTN_IMPLEMENTATION, PagedMetadata, attend_packed
from paged_backend.core.block_manager import NULL_BLOCK, BlockManager
from paged_backend.errors import InvalidRequest, OutOfBlocks
from paged_backend.core.kv_cache import PagedKVCache, num_blocks_for_budget
from paged_backend.core.kv_groups import kv_cache_groups
from paged_backend.core.kv_snapshot import KVHistory, pool_snapshot
from paged_backend.worker.offload import input_device, layer_devices
from paged_backend.ops import reshape_and_cache

from .cache_stats import CacheStats
from .forward_step import ForwardStep, gather_slots, paged_metadata
from .identical_rows import identical_rows
from .layer_handle import PagedLayerKV
from .model_support import check_update_shapes, kv_geometry, rank_geometry


def _placeholder_tokens(n: int) -> list[int]:
    # Prefix caching is off, so the BlockManager only needs the token count.
    return [0] * n


def _model_facts(model_or_config) -> tuple[object, torch.dtype, torch.device, list[torch.device] | None]:
    """(text config, dtype, input device, per-layer devices of an accelerate-dispatched model or None)."""
    if isinstance(model_or_config, torch.nn.Module):
        config = model_or_config.config.get_text_config(decoder=True)
        devices = layer_devices(model_or_config, config.num_hidden_layers)
        dtype = next(model_or_config.parameters()).dtype
        return config, dtype, input_device(model_or_config), devices
    config = model_or_config.get_text_config(decoder=True)
    dtype = getattr(config, "dtype", None)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return config, dtype or torch.float32, torch.device("cpu"), None


class PagedCache(Cache):
    """Paged KV storage for `model.generate`, with prompt sharing across repeated rows and beams.

    `model_or_config` is the model (the pool takes its dtype and device, and each forward reads its current
    attn_implementation) or its config. Give exactly one budget: `max_tokens` (KV slots), `num_blocks`, or
    `memory_bytes`. `backend` picks the paged-attention op backend (default: auto).

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
        self.config, model_dtype, model_device, devices = _model_facts(model_or_config)
        # Under transformers' tensor parallelism (tp_plan) each rank's pool holds only its own KV heads.
        self.geometry = rank_geometry(kv_geometry(self.config), getattr(model_or_config, "tp_size", None))
        # Sliding-window layers get their own block tables and drop blocks that leave their window.
        self.groups = kv_cache_groups(self.geometry.sliding_windows)
        dtype = dtype or model_dtype
        device_given = device is not None
        device = torch.device(device or model_device)
        num_blocks = self._resolve_num_blocks(max_tokens, num_blocks, memory_bytes, block_size, dtype)
        self.block_manager = BlockManager(
            num_blocks, block_size, enable_prefix_caching=False,
            sliding_windows=[group.sliding_window for group in self.groups],
        )
        g = self.geometry
        self.kv_cache = PagedKVCache(
            g.num_layers, g.num_kv_heads, g.head_dim, num_blocks, block_size, dtype=dtype, device=device,
            groups=self.groups, layer_devices=None if device_given else devices,
        )
        self.backend = backend
        self.kv_history = KVHistory()  # one point per forward, for kv_map()
        self._next_seq_id = 0
        self._clear()

    def _resolve_num_blocks(self, max_tokens, num_blocks, memory_bytes, block_size, dtype) -> int:
        given = [x is not None for x in (max_tokens, num_blocks, memory_bytes)]
        if sum(given) != 1:
            raise InvalidRequest("give PagedCache exactly one budget: max_tokens=, num_blocks= or memory_bytes=")
        if max_tokens is not None:  # every group holds each token; + the reserved null block
            return len(self.groups) * -(-max_tokens // block_size) + 1
        if num_blocks is not None:
            return num_blocks
        g = self.geometry
        return num_blocks_for_budget(
            len(self.groups[0].layers), g.num_kv_heads, g.head_dim, block_size, dtype, memory_bytes=memory_bytes
        )

    def _clear(self) -> None:
        self._rows: list[int] = []  # BlockManager sequence id of each batch row
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
        return f"PagedCache({len(self._rows)} rows x {self._seq_length} columns; {self.stats()})"

    @property
    def is_compileable(self) -> bool:
        return False  # shapes change every step; True would make generate pre-build 4D masks and compile

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_initialized(self) -> bool:
        return bool(self._rows)

    @property
    def batch_size(self) -> int:
        return len(self._rows) if self._rows else -1

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
        reshape_and_cache(
            _token_rows(key_states), _token_rows(value_states), key_cache, value_cache,
            step.metadata.for_layer(layer_idx).on(key_cache.device).slot_mapping, backend=self.backend,
        )
        if step.fresh:  # contiguous like DynamicCache's concatenation: kernels round by memory layout
            return key_states.contiguous(), value_states.contiguous()
        # Sliding layers see what DynamicCache keeps (window - 1 past columns), so the math is the same.
        q_len = key_states.shape[2]
        columns = self._visible_past(layer_idx, self._seq_length - q_len) + q_len
        slots = step.gather_slots[self.kv_cache.layer_group[layer_idx]][:, -columns:]
        return self._gather(key_cache, key_states.dtype, slots), self._gather(value_cache, value_states.dtype, slots)

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
        metadata = self._metadata_for([r for r in range(len(self._rows)) if r not in mirrors]) if mirrors else None
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
        picks = indices.tolist()
        if picks == list(range(len(self._rows))):
            return
        rows = [self._copy_row(self._rows[i]) for i in picks]
        self._free_rows()
        self._rows = rows
        self._columns = self._columns[indices.cpu()]

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Row i becomes rows i*repeats .. i*repeats+repeats-1, all sharing its blocks."""
        self._rows = [copy for seq in self._rows for copy in [seq] + [self._copy_row(seq) for _ in range(repeats - 1)]]
        self._columns = self._columns.repeat_interleave(repeats, dim=0)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` columns (negative, as transformers passes it)."""
        if tokens_to_remove > 0:
            raise InvalidRequest(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        keep = max(self._seq_length + tokens_to_remove, 0)
        stored = self._columns[:, :keep].sum(dim=1).tolist()
        for seq, count in zip(self._rows, stored, strict=True):
            if self.block_manager.has(seq):
                self.block_manager.truncate(seq, count)
        self._columns = self._columns[:, :keep]
        self._seq_length = keep

    def reset(self) -> None:
        """Free every row's blocks (and the peak counter); the cache is empty and reusable for a new generate."""
        self._free_rows()
        self._clear()

    def kv_map(self, path: str = "kv_map.png", *, title: str = "PagedCache"):
        """Draw the pool now as `path` (PNG) and the same name with .html, one owner per batch row."""
        from paged_backend.core.kv_map import draw_kv_map

        owners = {seq: f"row {row}" for row, seq in enumerate(self._rows)}
        return draw_kv_map(pool_snapshot(self.block_manager, owners, self.kv_history), path, title=title)

    def stats(self) -> CacheStats:
        """Blocks used / shared / free, bytes, waste % and what prompt sharing saved."""
        return CacheStats(self.block_manager.stats(), self.kv_cache.bytes_per_block, self._peak_used_blocks)

    # ------------------------------------------------------------- rows/blocks
    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def _copy_row(self, seq: int) -> int:
        child = self._new_seq_id()
        if self.block_manager.has(seq):
            self.block_manager.fork(seq, child)
        return child

    def _free_rows(self) -> None:
        for seq in self._rows:
            if self.block_manager.has(seq):
                self.block_manager.free(seq)
        self._rows = []

    def _num_stored(self, seq: int) -> int:
        return self.block_manager.num_tokens(seq) if self.block_manager.has(seq) else 0

    def _grow(self, seq: int, num_tokens: int) -> list[tuple[int, int]]:
        """Reserve slots for `num_tokens` more tokens; returns the copy-on-write block copies to do."""
        if num_tokens == 0:
            return []
        if not self.block_manager.has(seq):
            self.block_manager.allocate(seq, _placeholder_tokens(num_tokens))
            return []
        return self.block_manager.append_slots(seq, _placeholder_tokens(num_tokens))

    # -------------------------------------------------------------------- steps
    def _begin_step(self, key: torch.Tensor, value: torch.Tensor, attention_mask, *, paged: bool) -> None:
        batch, _, q_len, _ = key.shape
        fresh = not self._rows
        if not fresh and self._paged != paged:
            raise InvalidRequest(
                "this PagedCache was filled under another attention implementation; call cache.reset() "
                "before generating with a different attn_implementation"
            )
        if not fresh and batch != len(self._rows):
            self._expand_to(batch)
        new_columns = self._new_columns(attention_mask, batch, q_len) if paged else torch.ones(batch, q_len).bool()
        if fresh:  # only now: a refused mask must leave the cache empty
            self._paged = paged
            self._rows = [self._new_seq_id() for _ in range(batch)]
            self._columns = torch.zeros(batch, 0, dtype=torch.bool)
        # Prompts (also chunked or continued ones) can repeat across rows; single decode tokens rarely do.
        followers = identical_rows(key, value, new_columns, self._block_tables()) if q_len > 1 or fresh else {}
        stored_before = [self._num_stored(seq) for seq in self._rows]
        try:
            copies = self._reserve(new_columns.sum(dim=1).tolist(), followers)
        except OutOfBlocks as exc:
            self.reset()  # some rows grew and others did not: nothing consistent is left to keep
            raise OutOfBlocks(f"{exc} (the PagedCache was reset)") from exc
        self.kv_cache.copy_blocks(copies)
        self._columns = torch.cat([self._columns, new_columns], dim=1)
        self._seq_length += q_len
        holes = bool((self._columns.int().cummax(dim=1).values > self._columns.int()).any())
        self._step = ForwardStep(fresh, new_columns, stored_before, followers, has_holes=holes)
        self._build_metadata()
        used = self.block_manager.num_blocks - 1 - self.block_manager.num_free_blocks
        self._peak_used_blocks = max(self._peak_used_blocks, used)
        self.kv_history.record(self.block_manager)

    def _reserve(self, counts: list[int], followers: dict[int, int]) -> list[tuple[int, int]]:
        """Slots for each row's new tokens; followers share their leader's blocks instead."""
        copies: list[tuple[int, int]] = []
        for row, (seq, count) in enumerate(zip(self._rows, counts, strict=True)):
            if row not in followers:
                copies += self._grow(seq, count)
        for row, leader in followers.items():
            if self.block_manager.has(self._rows[row]):
                self.block_manager.free(self._rows[row])  # it held the leader's blocks; it now follows its growth
            if self.block_manager.has(self._rows[leader]):
                self.block_manager.fork(self._rows[leader], self._rows[row])
        return copies

    def _block_tables(self) -> list[tuple[int, ...]]:
        bm = self.block_manager
        return [tuple(map(tuple, bm.block_tables(seq))) if bm.has(seq) else () for seq in self._rows]

    def _expand_to(self, batch: int) -> None:
        """A filled cache meets generate's k-times expanded batch (beams / num_return_sequences): fork rows."""
        if batch % len(self._rows):
            raise InvalidRequest(
                f"the cache holds {len(self._rows)} rows but the model got a batch of {batch}; continue with the "
                f"same rows (or a multiple, for beams / num_return_sequences), or call cache.reset()"
            )
        self.batch_repeat_interleave(batch // len(self._rows))

    def _new_columns(self, attention_mask, batch: int, q_len: int) -> torch.Tensor:
        """Which of this forward's columns are real tokens (paged attention never stores padding)."""
        past = self._seq_length
        if attention_mask is None:
            if not bool(self._columns.all()):
                raise InvalidRequest(
                    "the cache skipped padding columns earlier, so pass the full 2D attention_mask when continuing"
                )
            return torch.ones(batch, q_len, dtype=torch.bool)
        mask = attention_mask.bool().cpu()
        if tuple(mask.shape) != (batch, past + q_len):
            raise InvalidRequest(
                f"attention_mask has shape {tuple(mask.shape)}, expected ({batch}, {past + q_len}): "
                f"past plus new columns"
            )
        if past and not torch.equal(mask[:, :past], self._columns):
            raise InvalidRequest(
                "the attention_mask's past columns differ from the padding the cache stored; keep the mask of "
                "earlier calls and append to it"
            )
        return mask[:, past:]

    def _build_metadata(self) -> None:
        step, bm = self._step, self.block_manager
        step.metadata = self._metadata_for(list(range(len(self._rows))))
        if not self._paged and not step.fresh:
            step.gather_slots = [
                gather_slots(step.metadata.for_layer(group.layers[0]).block_tables, self._seq_length, bm.block_size)
                for group in self.groups
            ]

    def _metadata_for(self, rows: list[int]) -> PagedMetadata:
        return paged_metadata(
            self._step, self.block_manager, self._rows, rows, self.kv_cache.device, self.backend,
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
            self._unshare(row, step.followers.pop(row))
        if diverged:
            self._build_metadata()

    def _unshare(self, row: int, leader: int) -> None:
        bm, seq, lead = self.block_manager, self._rows[row], self._rows[leader]
        if not bm.has(lead):
            return
        bm.free(seq)
        bm.allocate(seq, _placeholder_tokens(bm.num_tokens(lead)))
        # Earlier layers were verified equal, so the leader's blocks are this row's KV up to here.
        pairs = [
            (src, dst)
            for lead_table, own_table in zip(bm.block_tables(lead), bm.block_tables(seq), strict=True)
            for src, dst in zip(lead_table, own_table, strict=True)
            if src != NULL_BLOCK
        ]
        self.kv_cache.copy_blocks(pairs)

    def _visible_past(self, layer_idx: int, past: int) -> int:
        """Past columns a layer attends over in sdpa/eager: all, or the last window - 1 for sliding layers."""
        window = self.geometry.sliding_windows[layer_idx]
        return past if window is None else min(past, window - 1)

    @staticmethod
    def _gather(pool: torch.Tensor, dtype: torch.dtype, slots: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, columns, D] contiguous K or V of the pool `slots` [B, columns], read through the block tables."""
        flat = pool.view(-1, pool.shape[-2], pool.shape[-1])
        slots = slots.to(pool.device)
        rows = torch.index_select(flat, 0, slots.flatten())  # several times faster than advanced indexing on CPU
        return rows.view(*slots.shape, *flat.shape[1:]).transpose(1, 2).contiguous().to(dtype)


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, H, q, D] -> [B*q, H, D], row-major like the slot mapping."""
    batch, heads, q_len, dim = x.shape
    return x.transpose(1, 2).reshape(batch * q_len, heads, dim)
