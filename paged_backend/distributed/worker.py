"""One rank: its shard of the model, its KV pool and its pipeline stage, running the steps the driver broadcasts.

The driver (rank 0) runs the same `RankWorker` for its own shard; workers loop in `serve_steps` until the driver
broadcasts the stop message (None). A step carries the packed batch the driver's `ModelRunner.prepare` built and
the block copies/swaps the scheduler asked for, so every rank's pool mirrors the driver's BlockManager; with LoRA it
also carries the adapter slot writes and each row's slot, so every rank's slots mirror the driver's LoRAManager.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from paged_backend.config import EngineConfig
from paged_backend.core.kv_budget import KVShape
from paged_backend.distributed.pipeline import PipelineStage, stage_layers
from paged_backend.distributed.sharding import shard_model
from paged_backend.distributed.state import RankContext, Topology, init_rank, rank_device
from paged_backend.lora.adapter import linear_shapes
from paged_backend.lora.layers import SlotLayers
from paged_backend.worker.attention import PagedMetadata
from paged_backend.worker.model_worker import ModelWorker, StageKVCache, plan_pool


@dataclass
class StepInput:
    """What crosses the control group each step: the packed batch (CPU tensors) and the pool operations."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    rows: list[int]  # packed positions whose logits the driver samples from
    kv_ops: list[tuple[str, list[tuple[int, int]]]]  # (PagedKVCache method, block pairs), in order
    lora: tuple[list, list[int], int] | None = None  # LoRAManager.take_step(): slot writes, row slots, largest rank

    @classmethod
    def pack(cls, ids, positions, metadata: PagedMetadata, rows, kv_ops, lora=None) -> StepInput:
        fields = (ids, positions, metadata.slot_mapping, metadata.block_tables, metadata.seq_lens,
                  metadata.query_start_loc)  # fmt: skip
        return cls(*(tensor.cpu() for tensor in fields), list(rows), kv_ops, lora)

    def unpack(self, device: torch.device, backend: str | None):
        to = lambda tensor: tensor.to(device, non_blocking=True)  # noqa: E731
        metadata = PagedMetadata(to(self.slot_mapping), to(self.block_tables), to(self.seq_lens),
                                 to(self.query_start_loc), backend=backend)  # fmt: skip
        return to(self.input_ids), to(self.positions), metadata


class RankWorker:
    """This rank's slice of the model (its stage's layers, its tensor-parallel heads) and its KV pool."""

    def __init__(self, ctx: RankContext, config: EngineConfig, model: nn.Module, pool_cls=StageKVCache) -> None:
        self.ctx, topology, cache = ctx, ctx.topology, config.cache
        layers = stage_layers(KVShape.of(model.config).num_layers, topology.pp_size, ctx.pp_rank)
        self.linear_shapes = linear_shapes(model)  # the whole model's, which adapters are checked against
        self.stage = PipelineStage(ctx, model, layers, model.config.get_text_config().hidden_size)
        self.model = shard_model(model.eval(), ctx.tp_rank, topology.tp_size, ctx)
        self.lora_layers = SlotLayers(model, config.max_loras, config.max_lora_rank) if config.enable_lora else None
        self.backend = None if config.attention_backend == "auto" else config.attention_backend
        plan = plan_pool(model, cache, ctx.device, tp_size=topology.tp_size, layers=layers, split_windows=False,
                         backend=self.backend)  # fmt: skip
        # The budget is per rank; the BlockManager is global, so every rank takes the smallest count.
        counts = torch.tensor([plan.size.num_blocks, plan.size.num_cpu_blocks])
        dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=ctx.control_group)
        worker = ModelWorker(model, plan.with_blocks(*counts.tolist()), ctx.device, backend=self.backend,
                             pack=config.prepack_weights, release=True, pool_cls=pool_cls)  # a rank's own copy
        self.kv_cache, self.runner = worker.kv_cache, worker.runner
        self.vocab_size = model.get_output_embeddings().out_features
        self.logits_rank = topology.rank(topology.pp_size - 1, 0)  # the last stage's first rank

    def run(self, step: StepInput, replay: bool = True) -> torch.Tensor | None:
        """Run this rank's part of a step. On the driver, returns the logits of `step.rows`. `replay`: apply the
        step's pool operations and adapter slots here (the driver's own engine already did)."""
        if replay:
            for name, pairs in step.kv_ops:
                getattr(self.kv_cache, name)(pairs)
        ids, positions, metadata = step.unpack(self.ctx.device, self.backend)
        forward = lambda: self.runner.forward(ids, positions, metadata, step.rows)  # noqa: E731
        with self._adapters(step.lora if replay else None):
            logits = self.stage.run(forward, ids.shape[1])
        if self.logits_rank == 0:
            return logits
        group = self.ctx.compute_group
        if self.ctx.rank == self.logits_rank:
            dist.send(logits, dst=0, group=group)
        elif self.ctx.rank == 0:
            logits = torch.empty(len(step.rows), self.vocab_size, device=self.ctx.device)
            dist.recv(logits, src=self.logits_rank, group=group)
        return logits


    @contextmanager
    def _adapters(self, lora: tuple[list, list[int], int] | None) -> Iterator[None]:
        """Fill the slots the driver filled, and give the layers each row's slot for one forward."""
        if lora is None:
            yield
            return
        writes, token_slots, rank = lora
        for slot, weights in writes:
            self.lora_layers.write(slot, weights)
        with self.lora_layers.step(token_slots, rank, self.ctx.device, self.model.dtype):
            yield


def serve_steps(worker: RankWorker) -> None:
    """A worker's loop: run every step the driver broadcasts until it broadcasts None."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=worker.ctx.control_group)
        if box[0] is None:
            return
        worker.run(box[0])


def worker_main(
    rank: int,
    topology: Topology,
    init_method: str,
    config: EngineConfig,
    model: nn.Module | None = None,
    local_rank: int = 0,
    num_threads: int | None = None,
) -> None:
    """Entry point of a worker process or actor: join the group, load and shard the model, serve steps."""
    from paged_backend.worker.models import load_model, resolve_device

    if num_threads:
        torch.set_num_threads(num_threads)
    device = rank_device(resolve_device(config.device), local_rank)
    ctx = init_rank(rank, topology, init_method, device, config.parallel.distributed_timeout_seconds)
    if model is None:
        model, _ = load_model(config.model, tokenizer=config.tokenizer, dtype=config.dtype, device=str(device),
                              trust_remote_code=config.trust_remote_code)  # fmt: skip
    serve_steps(RankWorker(ctx, config, model.to(device)))
    ctx.close()
