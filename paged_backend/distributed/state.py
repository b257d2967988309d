"""Who is who among the ranks: the TP x PP grid, its process groups, and the torchrun environment.

Ranks are laid out as vLLM lays them: `rank = pp_rank * tp_size + tp_rank`, so the tensor-parallel group of a
stage is a run of consecutive ranks (on one machine when tp_size divides the GPUs per node). Rank 0 is the
driver. Two kinds of groups: the control group (gloo) carries each step's metadata, and its workers wait on it
with no practical timeout (as long as the server is idle); the compute groups (NCCL on GPU, gloo on
CPU) carry all-reduces and stage hand-offs and time out after `distributed_timeout_seconds`, which is how a hung
rank turns into an error instead of a hang.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.distributed_c10d import _set_pg_timeout  # the only way to retime a created group

from paged_backend.config import ParallelConfig

IDLE_TIMEOUT = timedelta(days=365)  # an idle server's workers wait this long for the next step
# Joining waits for every rank to start (a fork and a model load on a busy host), which a short collective timeout
# must not cut: groups are created with at least this long, then given the collective timeout.
JOIN_TIMEOUT = timedelta(seconds=15)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_generations = itertools.count()


def torchrun_rank() -> int | None:
    """This process's rank when started by torchrun (or any launcher setting its variables), else None."""
    if all(name in os.environ for name in TORCHRUN_VARS):
        return int(os.environ["RANK"])
    return None


@dataclass(frozen=True)
class Topology:
    tp_size: int
    pp_size: int

    @classmethod
    def of(cls, parallel: ParallelConfig) -> Topology:
        return cls(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp_rank, tp_rank) of a global rank."""
        return divmod(rank, self.tp_size)


@dataclass
class RankContext:
    """One process's place in the grid and the groups it talks on."""

    rank: int
    topology: Topology
    device: torch.device
    control_group: object  # gloo, step metadata
    compute_group: object  # every rank, compute timeout: stage hand-offs and logits
    tp_group: object  # this stage's ranks, compute timeout: all-reduces

    @property
    def pp_rank(self) -> int:
        return self.topology.coords(self.rank)[0]

    @property
    def tp_rank(self) -> int:
        return self.topology.coords(self.rank)[1]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.topology.pp_size - 1

    def close(self) -> None:
        """Leave the process group and drop this process's last references to its groups, so that each group's
        threads are joined now. Left to exit, a gloo thread still releasing a collective's tensors needs the GIL
        while the interpreter finalizes, and the process aborts ("terminate called without an active exception")."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.control_group = self.compute_group = self.tp_group = None


def init_rank(rank: int, topology: Topology, init_method: str, device: torch.device, timeout: float) -> RankContext:
    """Join the process group and build the groups; collectives then wait at most `timeout` s for a rank (joining
    itself waits at least `JOIN_TIMEOUT`)."""
    compute_backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    compute_timeout = timedelta(seconds=timeout)
    join = max(compute_timeout, JOIN_TIMEOUT)
    # Groups are named by a per-process counter that names their store keys; destroy_process_group resets it, a join
    # that failed half-way does not, and the next engine's fresh workers would count from 0 and wait on other keys.
    if not dist.is_initialized():
        distributed_c10d._world.group_count = 0
    store, _, _ = next(dist.rendezvous(init_method, rank=rank, world_size=topology.world_size, timeout=join))
    # torchrun's store outlives an engine: each engine of the job gets fresh keys (every rank counts alike). A tcp://
    # address is a new store per engine already (and a spawned rank's count would start over).
    generation = next(_generations) if init_method == "env://" else 0
    store = dist.PrefixStore(f"paged_backend/{generation}", store)
    dist.init_process_group(compute_backend, store=store, rank=rank, world_size=topology.world_size, timeout=join)
    # Timeouts are each process's own: workers wait for the next step as long as the server idles, while the
    # driver's broadcast to a rank that stopped answering fails after the compute timeout.
    control = dist.new_group(backend="gloo", timeout=join if rank == 0 else IDLE_TIMEOUT)
    tp_groups = [
        dist.new_group([topology.rank(stage, tp) for tp in range(topology.tp_size)], timeout=join)
        for stage in range(topology.pp_size)
    ]  # every rank creates every group, in the same order, as new_group requires
    pp_rank, _ = topology.coords(rank)
    for group in (dist.group.WORLD, tp_groups[pp_rank], *([control] if rank == 0 else [])):
        _set_pg_timeout(compute_timeout, group)
    return RankContext(rank, topology, device, control, dist.group.WORLD, tp_groups[pp_rank])


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device a rank computes on: its own GPU (cuda:local_rank), or the CPU."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device
