"""Decode steps replayed from CUDA graphs (`--max-cudagraph-capture-size N`).

On a GPU a small model's decode step is bound by the host: ~400 kernel launches through transformers' modules,
against a few milliseconds of kernels (benchmarks/RESULTS.md, "GPU: the first run on CUDA"). A captured graph
replays the whole forward in one launch. As in vLLM, only decode steps are captured: one new token per sequence,
up to N sequences, padded to the next capture size (1, 2, 4, 8, then multiples of 16).

A step's inputs are copied into static buffers the graph was captured on. Padded rows write no KV (slot -1, which
every cache write skips) and attend to one token; their logits are dropped. The block-table buffer is as wide as
the longest sequence the pool holds, and a step fills only the columns it uses: a kernel reads a row's columns up to
its length alone. As in vLLM, every size is captured when the engine starts (`capture_all`), largest first, so no
decode step waits for a capture and the smaller graphs reuse the largest one's memory: each after two eager warm-up
runs on padding rows alone, which write nothing. All graphs share one memory pool. The graphs hold the pool's
addresses: when the pool is allocated again (sleep mode), they are dropped and captured anew, all at once on waking,
or (should a size be missing) the first time a step needs it, then on that step's real inputs.

`capture=False` runs the same padded static-buffer steps eagerly: on CPU, where the tests check them against the
plain forward, and as the fallback when a capture fails (a model whose forward syncs with the host cannot be
captured; the step then runs eagerly, with a warning, and nothing is lost).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from paged_backend.core.block_manager import slot_of
from paged_backend.core.kv_cache import PagedKVCache
from paged_backend.worker.attention import PagedMetadata

log = logging.getLogger(__name__)
WARMUP_RUNS = 2  # eager runs before a capture: kernels compiled and autotuned, workspaces allocated


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then multiples of 16, up to `max_batch` (which is always one)."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    """Static buffers for decode steps of up to `max_batch` sequences of up to `max_blocks` blocks of `kv_cache`,
    and the graph captured for each size. `forward(ids, positions, metadata, keep)` is the runner's model forward;
    its float32 logits `[len(keep), vocab]` are the graph's output."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, PagedMetadata, torch.Tensor], torch.Tensor],
        kv_cache: PagedKVCache,
        max_batch: int,
        max_blocks: int,
        *,
        backend: str | None = None,
        capture: bool = True,
    ) -> None:
        self.forward, self.kv_cache, self.capture = forward, kv_cache, capture
        self.block_size, device = kv_cache.block_size, kv_cache.device
        self.sizes = capture_sizes(max_batch)
        self.max_batch, self.max_blocks = max_batch, max_blocks
        long, int32 = dict(dtype=torch.long, device=device), dict(dtype=torch.int32, device=device)
        self.ids = torch.zeros(1, max_batch, **long)
        self.positions = torch.zeros(1, max_batch, **long)
        self.slots = torch.full((max_batch,), -1, **long)
        self.tables = torch.zeros(max_batch, max_blocks, **int32)
        self.seq_lens = torch.ones(max_batch, **int32)
        self.query_start_loc = torch.arange(max_batch + 1, **int32)  # one token per row, always
        self.keep = torch.arange(max_batch, **long)  # every row's logits
        self.backend = backend
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graphs_generation = kv_cache.generation  # the pool allocation the graphs were captured on
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.steps = 0  # decode steps run through the static buffers, replayed or eager
        self.replays = 0  # of which graph launches

    def takes(self, rows, extra_rows) -> bool:
        """Whether this step is a decode step the buffers hold: one token and one logit row per sequence, no prompt
        logprob rows, one block table per sequence, at most `max_batch` sequences of at most `max_blocks` blocks, and
        no fp8 scale calibration pending (it runs on the host between layers)."""
        if extra_rows or not rows or len(rows) > self.max_batch or self.kv_cache.scales_pending:
            return False
        return all(len(row.token_ids) == 1 and row.num_logit_rows == 1 and row.slots is None
                   and len(row.block_tables) == 1 and len(row.block_tables[0]) <= self.max_blocks
                   for row in rows)  # fmt: skip

    def run(self, rows) -> torch.Tensor:
        """Float32 logits `[len(rows), vocab]` of one decode step."""
        count = len(rows)
        size = next(s for s in self.sizes if s >= count)
        self._fill(rows, size)
        self.steps += 1
        captured = self._graph(size) if self.capture else None
        if captured is None:
            return self.forward(*self._views(size))[:count]
        graph, logits = captured
        graph.replay()
        self.replays += 1
        return logits[:count].clone()  # the graph's output buffer is overwritten by the next replay

    def capture_all(self) -> None:
        """Capture every size's graph now, largest first, on padding rows alone (no KV written, one token attended).
        Without capture (CPU), the same padding-only forwards run eagerly once, which is what the tests check."""
        started = time.perf_counter()
        for size in reversed(self.sizes):
            self._fill([], size)
            if not self.capture:
                self.forward(*self._views(size))
            elif self._graph(size) is None:  # a capture failed (logged): decode steps run eagerly from here
                return
        if self.capture:
            log.info("captured %d decode graphs (up to %d sequences) in %.2f s", len(self.graphs), self.max_batch,
                     time.perf_counter() - started)  # fmt: skip

    def drop(self) -> None:
        """Free the captured graphs (sleep mode): the next decode step of each size captures its graph again."""
        self.graphs.clear()

    def _fill(self, rows, size: int) -> None:
        block_size = self.block_size
        count = len(rows)
        tokens, positions, slots, lengths, tables = [], [], [], [], []
        for row in rows:
            table, start = row.block_tables[0], row.start
            tokens.append(row.token_ids[0])
            positions.append(start)
            slots.append(slot_of(table, start, block_size))
            lengths.append(start + 1)
            tables.append(table)
        if rows:  # (none: `capture_all`'s padding-only steps)
            width = max(map(len, tables))
            self.ids[0, :count].copy_(torch.tensor(tokens), non_blocking=True)
            self.positions[0, :count].copy_(torch.tensor(positions), non_blocking=True)
            self.slots[:count].copy_(torch.tensor(slots), non_blocking=True)
            self.seq_lens[:count].copy_(torch.tensor(lengths, dtype=torch.int32), non_blocking=True)
            padded = [table + [0] * (width - len(table)) for table in tables]
            self.tables[:count, :width].copy_(torch.tensor(padded, dtype=torch.int32), non_blocking=True)
        if size > count:  # padding rows: no KV written, one token attended, logits dropped
            self.ids[0, count:size].zero_()
            self.positions[0, count:size].zero_()
            self.slots[count:size].fill_(-1)
            self.seq_lens[count:size].fill_(1)

    def _views(self, size: int) -> tuple[torch.Tensor, torch.Tensor, PagedMetadata, torch.Tensor]:
        metadata = PagedMetadata(
            slot_mapping=self.slots[:size],
            block_tables=self.tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            backend=self.backend,
        )
        return self.ids[:, :size], self.positions[:, :size], metadata, self.keep[:size]

    def _graph(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """The graph of `size` and its logits, captured now if it is not yet (or the pool moved since); None when a
        capture fails."""
        if self.graphs_generation != self.kv_cache.generation:  # the pool moved: its addresses are in the graphs
            self.drop()
            self.graphs_generation = self.kv_cache.generation
        if size not in self.graphs:
            captured = self._capture(self._views(size))
            if captured is None:
                return None
            self.graphs[size] = captured
        return self.graphs[size]

    def _capture(self, views) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """Warm up, then capture the forward over `views`; None (and eager steps from then on) when it fails."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    self.forward(*views)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the server's other threads may use CUDA meanwhile; only this thread's calls are checked
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                logits = self.forward(*views)
        except RuntimeError as exc:  # e.g. a host sync inside the model's forward
            log.warning("CUDA graph capture failed, decode steps run eagerly: %s", exc)
            torch.cuda.synchronize()
            self.capture = False
            return None
        return graph, logits
