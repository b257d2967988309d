"""The driver: rank 0 of a parallel engine. It owns the Scheduler and BlockManager (in `Engine`), starts or joins
the worker ranks, broadcasts every step over the control group and is the only rank that samples.

A worker that dies, stops answering within `distributed_timeout_seconds` or fails to start makes the step raise
`WorkerFailed`; the driver then stops every rank it started and refuses further steps.
"""

from __future__ import annotations

import logging
import traceback
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from paged_backend.config import EngineConfig
from paged_backend.core.kv_budget import KVShape
from paged_backend.distributed.executor import EXECUTORS
from paged_backend.distributed.pipeline import stage_layers
from paged_backend.distributed.sharding import check_shardable
from paged_backend.distributed.state import RankContext, Topology, init_rank, torchrun_rank
from paged_backend.distributed.worker import RankWorker, StepInput, serve_steps
from paged_backend.errors import InvalidRequest
from paged_backend.worker.model_worker import StageKVCache
from paged_backend.worker.runner import ModelRunner

logger = logging.getLogger(__name__)


class WorkerFailed(RuntimeError):
    """A worker rank died, hung past the collective timeout, or failed to start; the parallel engine is down."""

    fatal = True  # the engine cannot step again: a server stops (exit code 1) instead of serving errors


class DriverKVCache(StageKVCache):
    """The driver's pool: applies the block copies and swaps the engine asks for and records them for the ranks."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pending: list[tuple[str, list[tuple[int, int]]]] = []

    def take_pending(self) -> list[tuple[str, list[tuple[int, int]]]]:
        pending, self.pending = self.pending, []
        return pending

    def _record(self, name: str, pairs) -> None:
        if pairs:
            self.pending.append((name, list(pairs)))
            getattr(super(), name)(pairs)

    def copy_blocks(self, pairs) -> None:
        self._record("copy_blocks", pairs)

    def swap_out(self, pairs) -> None:
        self._record("swap_out", pairs)

    def swap_in(self, pairs) -> None:
        self._record("swap_in", pairs)


@dataclass
class _DriverState:
    """What shutdown needs (kept apart from the driver so the driver can be garbage-collected)."""

    ctx: RankContext | None = None
    failure: WorkerFailed | None = None
    in_step: bool = False  # between a step's broadcast and its end the ranks are not ready for a stop message


def _shutdown(executor, state: _DriverState) -> None:
    """Stop every rank: a stop message when the ranks are in step, else kill what this driver started."""
    graceful = state.ctx is not None and state.failure is None and not state.in_step
    if graceful:
        try:
            dist.broadcast_object_list([None], src=0, group=state.ctx.control_group)
        except Exception:  # a rank already gone: it is killed below
            graceful = False
    executor.stop(graceful)
    if state.ctx is not None:
        state.ctx.close()
    elif dist.is_initialized():  # failed while joining
        dist.destroy_process_group()


class ParallelDriver:
    """Rank 0: its own shard (`worker`), the executor that owns the other ranks, and the step broadcast."""

    def __init__(self, config: EngineConfig, model: nn.Module) -> None:
        parallel, topology = config.parallel, Topology.of(config.parallel)
        check_shardable(model, topology.tp_size)  # refuse before any process starts
        stage_layers(KVShape.of(model.config).num_layers, topology.pp_size, 0)
        if dist.is_initialized():
            raise InvalidRequest(
                "this process already belongs to a torch.distributed group (another parallel engine?); "
                "close it first: one parallel engine per process"
            )
        joined = torchrun_rank()
        name = parallel.distributed_executor_backend or ("torchrun" if joined is not None else "mp")
        self.executor = EXECUTORS[name]()
        init_method = self.executor.start(config, model, topology, model.device)
        if joined:  # a torchrun worker rank: serve the driver's steps, then leave the process
            self._serve_as_worker(joined, topology, config, model)
        self.state = _DriverState()
        self._finalizer = weakref.finalize(self, _shutdown, self.executor, self.state)  # at close, GC or exit
        try:
            self.state.ctx = init_rank(0, topology, init_method, model.device, parallel.distributed_timeout_seconds)
            self.worker = RankWorker(self.state.ctx, config, model, pool_cls=DriverKVCache)
        except Exception as error:
            raise self._fail(error, "the workers failed to start") from error

    @staticmethod
    def _serve_as_worker(rank: int, topology: Topology, config: EngineConfig, model: nn.Module) -> None:
        ctx = init_rank(rank, topology, "env://", model.device, config.parallel.distributed_timeout_seconds)
        serve_steps(RankWorker(ctx, config, model))
        ctx.close()
        raise SystemExit(0)

    @property
    def model(self) -> nn.Module:
        return self.worker.model

    @property
    def kv_cache(self) -> DriverKVCache:
        return self.worker.kv_cache

    @property
    def failure(self) -> WorkerFailed | None:
        return self.state.failure

    def runner(self, attention_backend: str | None, lora=None) -> DriverRunner:
        return DriverRunner(self, attention_backend, lora)

    def step(self, step: StepInput) -> torch.Tensor:
        """Broadcast a step, run the driver's shard of it and return the logits the driver samples from."""
        if self.state.failure is not None:
            raise self.state.failure
        self.state.in_step = True
        try:
            dist.broadcast_object_list([step], src=0, group=self.state.ctx.control_group)
            logits = self.worker.run(step, replay=False)
        except Exception as error:
            raise self._fail(error, "a worker failed during a step") from error
        self.state.in_step = False
        return logits

    def _fail(self, error: Exception, what: str) -> WorkerFailed:
        # The error's frames (a collective's own among them) hold process groups in their locals, and the failure
        # kept here would keep them, and their threads, past close: keep the traceback, drop the locals.
        traceback.clear_frames(error.__traceback__)
        self.state.failure = WorkerFailed(
            f"{what}: {self.executor.describe()} ({type(error).__name__}: {str(error).splitlines()[0]}); "
            "the requests in flight are failed and this parallel engine is stopped"
        )
        logger.error("%s", self.state.failure)
        self.close()
        return self.state.failure

    def close(self) -> None:
        """Stop every rank and leave the process group (idempotent)."""
        self._finalizer()


class DriverRunner(ModelRunner):
    """The engine's runner on the driver: packs the step as usual, then runs it on every rank."""

    def __init__(self, driver: ParallelDriver, attention_backend: str | None, lora=None) -> None:
        super().__init__(driver.model, driver.kv_cache, attention_backend)
        self.driver = driver
        self.lora = lora  # the engine's LoRAManager: its slot writes and row slots go out with each step

    cuts_steps = False  # every rank runs the step to its end: ranks cannot stop between layers in step

    def forward(self, ids, positions, metadata, rows: list[int], cut=None) -> torch.Tensor:
        lora = None if self.lora is None else self.lora.take_step()
        step = StepInput.pack(ids, positions, metadata, rows, self.kv_cache.take_pending(), lora)
        return self.driver.step(step)
