"""Stats and metrics of an engine: the counters a step adds to, KV usage and its peak, and the `EngineStats` a server
exports (vLLM's names where vLLM has them)."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from paged_backend.core.block_manager import BlockManager
from paged_backend.core.kv_snapshot import KVHistory, pool_snapshot
from paged_backend.engine.request import Request
from paged_backend.engine.scheduler import Scheduler


@dataclass(frozen=True)
class EngineStats:
    """Counters a server exports; usage figures are fractions in [0, 1]."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float
    peak_kv_usage: float
    num_preemptions: int
    num_split_prefills: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found cached
    prompt_tokens: int
    generation_tokens: int
    num_steps: int
    step_time: float  # seconds inside step()
    forward_time: float  # seconds inside the model forward
    num_cut_steps: int = 0  # steps stopped between layers for a request that outranked them (Engine.cut_step_for)
    running_lora_adapters: tuple[str, ...] = ()  # adapters of running / waiting requests (vLLM's lora_requests_info)
    waiting_lora_adapters: tuple[str, ...] = ()
    # Speculative decoding (vLLM's names): proposals verified, tokens proposed, accepted, accepted per position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # Tokens per step (vLLM's iteration_tokens_total): steps counted per ITERATION_TOKEN_BUCKETS bound and past the
    # last one (not cumulative), and the tokens of all steps.
    iteration_tokens: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineCounters:
    """What the engine counts as it steps; `stats` adds the scheduler's, the pool's, LoRA's and the speculator's."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.prompt_tokens = self.generation_tokens = self.num_steps = self.num_cut_steps = 0
        self.step_time = self.forward_time = 0.0  # seconds
        self.peak_kv_usage = 0.0
        self.iteration_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        self.iteration_tokens_sum = 0
        self.kv_history = KVHistory()  # usage and waste of recent steps, for the KV map

    def kv_usage(self) -> float:
        manager = self.block_manager
        return 1 - manager.num_free_blocks / (manager.num_blocks - 1)

    def end_step(self, started: float, num_tokens: int) -> None:
        """Count a step of `num_tokens` tokens that began at `started` (time.perf_counter); record the pool."""
        self.iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        self.iteration_tokens_sum += num_tokens
        self.peak_kv_usage = max(self.peak_kv_usage, self.kv_usage())
        self.kv_history.record(self.block_manager)
        self.num_steps += 1
        self.step_time += time.perf_counter() - started

    def kv_snapshot(self, requests: dict[str, Request]) -> dict:
        owners = {seq.seq_id: request.request_id for request in requests.values() for seq in request.seqs}
        return pool_snapshot(self.block_manager, owners, self.kv_history)

    def stats(self, scheduler: Scheduler, lora=None, speculator=None) -> EngineStats:
        manager = self.block_manager
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_swapped=len(scheduler.swapped),
            kv_usage=self.kv_usage(),
            peak_kv_usage=self.peak_kv_usage,
            num_preemptions=scheduler.num_preemptions,
            num_split_prefills=scheduler.num_split_prefills,
            prefix_cache_queries=manager.prefix_queries,
            prefix_cache_hits=manager.prefix_hits,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_steps=self.num_steps,
            step_time=self.step_time,
            forward_time=self.forward_time,
            num_cut_steps=self.num_cut_steps,
            iteration_tokens=tuple(self.iteration_tokens),
            iteration_tokens_sum=self.iteration_tokens_sum,
            **({} if lora is None else lora.adapters_in(scheduler)),
            **_spec_decode_stats(speculator),
        )


def _spec_decode_stats(speculator) -> dict:
    if speculator is None:
        return {}
    return dict(
        spec_decode_num_drafts=speculator.num_drafts,
        spec_decode_num_draft_tokens=speculator.num_draft_tokens,
        spec_decode_num_accepted_tokens=speculator.num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=tuple(speculator.num_accepted_tokens_per_pos),
    )
