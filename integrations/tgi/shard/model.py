"""The shard's model: HF weights with paged attention, a KV pool sized at warmup, and one generate_token.

The model, pool and runner are the engine's `ModelWorker` (pool planned by the one KV budget, allocated at warmup);
the forward reuses `ModelRunner.prepare` (packing into `[1, T]` with slot mapping and block tables) and
`ModelRunner.forward` (the packed forward); tokens come from the engine's `Sampler`.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from paged_backend.config import CacheConfig
from paged_backend.core.kv_cache import PagedKVCache
from paged_backend.distributed.sharding import shard_model
from paged_backend.engine.sampler import Sampler
from paged_backend.errors import InvalidRequest, OutOfBlocks
from paged_backend.tgi.backends.tokens import eos_token_ids
from paged_backend.tgi.shard.batch import ShardBatch, ShardRequest
from paged_backend.tgi.shard.tensor_parallel import ShardRank
from paged_backend.worker.model_support import check_runs_paged
from paged_backend.worker.model_worker import ModelWorker, plan_pool
from paged_backend.worker.models import load_model
from paged_backend.worker.runner import ModelRunner, SequenceRows

logger = logging.getLogger(__name__)


@dataclass
class TokenResult:
    """What one forward produced for one request."""

    request: ShardRequest
    token_id: int
    text: str  # incremental detokenization of this token
    logprob: float
    top_tokens: list[tuple[int, float]]
    prefill_logprobs: list[float] | None  # one per prompt token (NaN first), when asked at prefill
    finish_reason: str | None


class ShardModel:
    def __init__(
        self,
        model_id: str | None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        memory_fraction: float = 1.0,
        quantization: str | None = None,
        quantization_param: str | None = None,
        rank: ShardRank = ShardRank(),
        trust_remote_code: bool = False,
    ) -> None:
        model, self.tokenizer = load_model(
            model_id, dtype=dtype, device=device, quantization=quantization, quantization_param=quantization_param,
            trust_remote_code=trust_remote_code,
        )
        check_runs_paged(model)
        self.model = model.eval()
        text_config = model.config.get_text_config()
        self.rank = rank
        if rank.world_size > 1:  # keep this rank's heads and MLP columns; its pool holds its own KV heads
            shard_model(model, rank.rank, rank.world_size)
        self.cache = CacheConfig(
            block_size=block_size, num_blocks=num_blocks, gpu_memory_utilization=memory_fraction,
            cache_dtype=kv_cache_dtype,
        )  # fmt: skip
        plan = self._plan()  # refuses a KV dtype the kernels cannot read before any request comes
        self.max_position_embeddings = plan.shape.max_positions
        self.block_size = block_size
        self.eos_ids = eos_token_ids(self.tokenizer, getattr(model, "generation_config", None))
        self.sampler = Sampler(self.eos_ids, device=self.device)
        self.vocab_size = text_config.vocab_size
        self.kv_cache: PagedKVCache | None = None
        self.runner: ModelRunner | None = None

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def num_blocks(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.num_blocks

    def _plan(self):
        """The pool the budget gives now: --num-blocks, else the memory budget (GPU: CUDA_MEMORY_FRACTION of free
        memory), with one block table for every layer (TGI's router assigns one per request)."""
        return plan_pool(self.model, self.cache, self.device, tp_size=self.rank.world_size, split_windows=False)

    def allocate_pool(self) -> int:
        plan = self._plan()
        worker = ModelWorker(self.model, plan, self.device)
        self.kv_cache, self.runner = worker.kv_cache, worker.runner
        logger.info(
            "KV pool: %d blocks of %d tokens (%.1f MiB)",
            plan.size.num_blocks, self.block_size, plan.size.num_blocks * plan.bytes_per_block / 2**20,
        )  # fmt: skip
        return plan.size.num_blocks

    def assign_blocks(self, batch: ShardBatch) -> None:
        """Warmup requests come without blocks: lay them out one after another from block 1."""
        next_block = 1
        for request in batch.requests:
            needed = math.ceil((request.seq.num_tokens + 1) / self.block_size)
            request.blocks = list(range(next_block, next_block + needed))
            request.slots = [
                request.blocks[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(needed * self.block_size)
            ]
            next_block += needed
        if next_block > self.num_blocks:
            tokens = sum(r.seq.num_tokens for r in batch.requests)
            raise OutOfBlocks(
                f"Not enough memory to handle {tokens} prefill tokens. You need to decrease `--max-batch-prefill-tokens`"
            )

    def structured(self):
        """The engine's structured-output manager (grammar compile cache + batch masks), built on first use."""
        if self.sampler.structured is None:
            from paged_backend.structured.manager import StructuredOutputManager

            self.sampler.structured = StructuredOutputManager(
                self.tokenizer, vocab_size=self.vocab_size, eos_token_ids=self.eos_ids
            )
        return self.sampler.structured

    def check_grammars(self, batch: ShardBatch) -> None:
        """Compile every request's grammar before anything runs (a bad one is refused as INVALID_ARGUMENT)."""
        for request in batch.requests:
            constraint = request.seq.request.params.structured_outputs
            if constraint is not None:
                self.structured().validate(constraint)

    def _attach_matchers(self, batch: ShardBatch) -> None:
        for request in batch.requests:
            constraint = request.seq.request.params.structured_outputs
            if constraint is not None and request.seq.grammar is None:
                request.seq.grammar = self.structured().new_matcher(constraint)

    @torch.inference_mode()
    def generate_token(self, batch: ShardBatch) -> tuple[list[TokenResult], int]:
        """One forward over `batch` (prefill of new requests, or one decode step); returns results and ns spent."""
        if self.runner is None:
            raise InvalidRequest("the KV pool does not exist yet: call Warmup before Prefill or Decode")
        start = time.perf_counter_ns()
        rows = []
        for request in batch.requests:
            computed, total = request.num_computed_tokens, request.seq.num_tokens
            if total > len(request.slots):
                raise OutOfBlocks(f"request {request.id} has no slot left for token {total}")
            # TGI's router assigns each request one block table and every token's slot.
            rows.append(SequenceRows(request.seq.token_ids[computed:], computed, (request.blocks,),
                                     slots=(request.slots[computed:total],)))  # fmt: skip
        ids, positions, metadata, sample_rows = self.runner.prepare(rows)
        prompt_rows = self._prompt_rows(batch, metadata.query_start_loc.tolist())
        keep = sorted(set(sample_rows) | {row for rows in prompt_rows.values() for row in rows})
        logits = self.runner.forward(ids, positions, metadata, keep)
        row_index = {row: index for index, row in enumerate(keep)}
        sample_logits = logits[[row_index[row] for row in sample_rows]]
        self._attach_matchers(batch)
        tokens, logprobs = self.sampler(sample_logits, [r.seq for r in batch.requests])
        results = []
        for index, (request, token_id, token_logprobs) in enumerate(zip(batch.requests, tokens, logprobs, strict=True)):
            prefill = None
            if index in prompt_rows:
                prefill = self._prompt_logprobs(request, logits, [row_index[r] for r in prompt_rows[index]])
            request.num_computed_tokens = request.seq.num_tokens
            request.seq.token_ids.append(token_id)
            grammar = request.seq.grammar
            if grammar is not None:
                grammar.accept(token_id)
            text = request.detokenizer.push(token_id)
            reason = request.stopping(token_id, text)
            if reason is None and grammar is not None and grammar.is_terminated():
                reason = "eos_token"  # the grammar is complete: nothing more may follow
            top = sorted(token_logprobs.items(), key=lambda item: item[1], reverse=True)[: request.top_n_tokens]
            results.append(TokenResult(request, token_id, text, token_logprobs[token_id], top, prefill, reason))
        return results, time.perf_counter_ns() - start

    @staticmethod
    def _prompt_rows(batch: ShardBatch, query_start_loc: list[int]) -> dict[int, list[int]]:
        """Packed rows whose logits give prompt logprobs: every new prompt row but the last, by position in the batch
        (not by request id: TGI's warmup sends every request with id 0)."""
        rows = {}
        for index, request in enumerate(batch.requests):
            if request.prefill_logprobs and request.seq.num_output_tokens == 0:
                rows[index] = list(range(query_start_loc[index], query_start_loc[index + 1] - 1))
        return rows

    @staticmethod
    def _prompt_logprobs(request: ShardRequest, logits: torch.Tensor, indices: list[int]) -> list[float]:
        """log p(prompt[p] | prompt[:p]); NaN where no logits were computed here (first token, cached prefix)."""
        prompt = request.seq.token_ids
        start = request.num_computed_tokens
        known = [float("nan")] * (start + 1)
        if indices:
            rows = torch.log_softmax(logits[indices], dim=-1)
            targets = torch.tensor(prompt[start + 1 :], device=rows.device)
            known += rows.gather(1, targets[:, None])[:, 0].tolist()
        return known
