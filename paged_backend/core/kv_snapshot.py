"""What the KV pool looks like right now, as plain JSON-able data: who holds each block, how full it is, and a
bounded history of usage and waste. `kv_map.draw_kv_map` draws it; the server's /debug/kv route serves it.

Block states: "owned" (one holder), "shared" (ref_count > 1), "cached" (free but still holding a reusable
prefix), "free", and, for sequences swapped to CPU, "swapped" (their CPU blocks).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import asdict

from paged_backend.core.block_manager import CPU_NULL_BLOCK, NULL_BLOCK, BlockManager

HISTORY_LENGTH = 256  # points kept; older ones are dropped
HISTORY_BLOCKS_PER_STEP = 64  # bigger pools record every k-th step, so the cost per step stays flat (at 256,
# ~0.15 ms a step: 1% of a 16-stream bf16 step of the 135M model, 2% of a one-stream step)
HISTORY_FIELDS = ("usage", "waste_pct", "used_blocks", "shared_blocks", "cached_blocks")  # BlockStats, per point


class KVHistory:
    """A bounded history of pool usage and waste, one point per recorded step."""

    def __init__(self, maxlen: int = HISTORY_LENGTH) -> None:
        self.points: deque[dict] = deque(maxlen=maxlen)
        self.num_steps = 0

    def record(self, manager: BlockManager) -> None:
        """Record one step (every step for small pools; stats() walks every block, so big pools sample)."""
        step, self.num_steps = self.num_steps, self.num_steps + 1
        if step % max(1, manager.num_blocks // HISTORY_BLOCKS_PER_STEP):
            return
        stats = manager.stats()
        point = {name: getattr(stats, name) for name in HISTORY_FIELDS}
        self.points.append({"step": step, "time": time.monotonic(), **point})


def pool_snapshot(manager: BlockManager, owners: Mapping[Hashable, str], history: KVHistory | None = None) -> dict:
    """Every usable block's state, group, owner and fill; swapped CPU blocks; stats; history.

    `owners` names the request (or row) of each sequence id; a block held by sequences of several owners has the
    owner "(several)".
    """
    bs = manager.block_size
    holders: dict[int, set[str]] = {}
    fill: dict[int, int] = {}
    swapped: dict[int, dict] = {}
    for seq_id, seq in manager.seqs.items():
        owner = owners.get(seq_id, str(seq_id))
        n = len(seq.token_ids)
        null = CPU_NULL_BLOCK if seq.on_cpu else NULL_BLOCK
        for group, table in enumerate(seq.block_tables):
            for i, block_id in enumerate(table):
                if block_id == null:
                    continue
                tokens = min(bs, n - i * bs)
                if seq.on_cpu:
                    entry = swapped.setdefault(block_id, dict(cpu_block=block_id, group=group, owner=owner, fill=0))
                    entry["fill"] = max(entry["fill"], tokens)
                else:
                    holders.setdefault(block_id, set()).add(owner)
                    fill[block_id] = max(fill.get(block_id, 0), tokens)
    blocks = []
    for block in manager.blocks[1:]:
        if block.ref_count:
            state = "shared" if block.ref_count > 1 else "owned"
        else:
            state = "cached" if block.hash is not None else "free"
        names = holders.get(block.block_id, set())
        owner = next(iter(names)) if len(names) == 1 else ("(several)" if names else None)
        blocks.append(
            dict(
                id=block.block_id,
                group=block.group if state != "free" else None,
                state=state,
                owner=owner,
                ref_count=block.ref_count,
                fill=fill.get(block.block_id, bs if state == "cached" else 0),
            )
        )
    stats = manager.stats()
    return dict(
        block_size=bs,
        num_blocks=manager.num_blocks,
        sliding_windows=list(manager.sliding_windows),
        blocks=blocks,
        swapped=sorted(swapped.values(), key=lambda entry: entry["cpu_block"]),
        stats={**asdict(stats), "usage": stats.usage, "waste_pct": stats.waste_pct},
        history=list(history.points) if history is not None else [],
    )
