"""A small draft model that proposes greedily from its own paged KV pool (a second PagedKVCache + BlockManager).

Its own pool, not the target's: the draft has other layer counts and head shapes, so its blocks could not share
the target's tensors, and keeping its blocks out of the target's manager means a draft can never preempt or
evict target work. Each sequence's draft KV is kept between steps; before proposing it is cut back to the
longest prefix the target has verified (`truncate`) and the missing tokens are prefilled in one packed forward.
"""

from __future__ import annotations

import torch

from paged_backend.config import CacheConfig
from paged_backend.core.block_manager import BlockManager
from paged_backend.worker.model_worker import ModelWorker, plan_pool
from paged_backend.worker.runner import SequenceRows


class DraftModelProposer:
    def __init__(
        self, model, num_blocks: int, block_size: int, device: torch.device, backend: str | None, *, pack: bool,
        release: bool,
    ) -> None:
        # As many blocks as the target's pool (a draft sequence never outgrows its target), in the draft's dtype.
        cache = CacheConfig(num_blocks=num_blocks, block_size=block_size)
        plan = plan_pool(model, cache, device, split_windows=False, backend=backend)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False, watermark=0.0)
        worker = ModelWorker(model, plan, device, backend=backend, pack=pack, release=release)
        self.kv_cache, self.runner = worker.kv_cache, worker.runner

    def propose(self, requests: list[tuple[int, list[int], int]]) -> dict[int, list[int]]:
        """{seq id: up to k greedy draft tokens} for (seq id, verified tokens, k) triples; sequences whose draft KV
        does not fit the pool get no proposal."""
        manager = self.block_manager
        limits = {seq_id: k for seq_id, _, k in requests}
        proposals: dict[int, list[int]] = {}
        fed: dict[int, list[int]] = {}  # seq id -> tokens in the draft pool
        rows: list[SequenceRows] = []
        for seq_id, tokens, _ in requests:
            start = self._sync(seq_id, tokens)
            if start is not None:
                proposals[seq_id], fed[seq_id] = [], list(tokens)
                rows.append(SequenceRows(tokens[start:], start, manager.block_tables(seq_id)))
        ids = list(proposals)
        while rows:  # the first round catches each draft KV up in one packed forward, then one token a round
            tokens = self.runner.execute(rows).argmax(dim=-1).tolist()
            next_rows, next_ids = [], []
            for seq_id, token in zip(ids, tokens, strict=True):
                proposals[seq_id].append(token)
                if len(proposals[seq_id]) < limits[seq_id] and manager.can_append(seq_id, 1):
                    manager.append_slots(seq_id, [token])
                    fed[seq_id].append(token)
                    next_rows.append(SequenceRows([token], len(fed[seq_id]) - 1, manager.block_tables(seq_id)))
                    next_ids.append(seq_id)
            rows, ids = next_rows, next_ids
        return proposals

    def _sync(self, seq_id: int, tokens: list[int]) -> int | None:
        """Make the draft pool hold `tokens` (KV computed up to the returned position); None if it cannot."""
        manager = self.block_manager
        if manager.has(seq_id):
            held = manager.seqs[seq_id].token_ids
            common = 0
            limit = min(len(held), len(tokens) - 1)  # at least the last token is fed again, for its logits
            while common < limit and held[common] == tokens[common]:
                common += 1
            manager.truncate(seq_id, common)
            if manager.can_append(seq_id, len(tokens) - common):
                manager.append_slots(seq_id, tokens[common:])
                return common
            manager.free(seq_id)
        if not manager.can_allocate(tokens, lookup=False):
            return None
        manager.allocate(seq_id, tokens, lookup=False)
        return 0

    def retain(self, seq_ids: set[int]) -> None:
        for seq_id in [seq_id for seq_id in self.block_manager.seqs if seq_id not in seq_ids]:
            self.block_manager.free(seq_id)
