"""The sharded shard (`serve --sharded`): one process per rank, started with TGI's launcher environment.

Each rank joins torch.distributed (NCCL on GPU, gloo on CPU) through RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT, keeps its slice of the model (`paged_backend.distributed.shard_model`) and its own KV heads, and runs
every batch the router sends to all shards (SPMD): the all-reduces inside the forward pair up because every rank
runs the same forwards in the same order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from paged_backend.errors import InvalidRequest

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # a rank that died turns a peer's all-reduce into an error, not a hang


@dataclass(frozen=True)
class ShardRank:
    rank: int = 0
    world_size: int = 1


def shard_rank(sharded: bool) -> ShardRank:
    """This shard's place, from TGI's launcher environment; refuses an environment that does not add up."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if not sharded:
        if world_size > 1:
            raise InvalidRequest(f"WORLD_SIZE={world_size} needs --sharded (one shard per rank)")
        return ShardRank()
    missing = [name for name in LAUNCHER_ENV if name not in os.environ]
    if missing:
        raise InvalidRequest(f"--sharded needs {', '.join(missing)} in the environment, as TGI's launcher sets them")
    rank = int(os.environ["RANK"])
    if not 0 <= rank < world_size:
        raise InvalidRequest(f"RANK={rank} must be in [0, WORLD_SIZE={world_size})")
    return ShardRank(rank, world_size)


def rank_device(device: str, rank: ShardRank) -> str:
    """A sharded rank computes on its own GPU (cuda:RANK), or on the CPU."""
    if rank.world_size == 1 or device not in ("auto", "cuda"):
        return device
    return f"cuda:{rank.rank}" if torch.cuda.is_available() else "cpu"


def join_group(rank: ShardRank, device: torch.device) -> None:
    """Join the shards' process group (blocks until every rank has joined)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method="env://", rank=rank.rank, world_size=rank.world_size, timeout=COLLECTIVE_TIMEOUT
    )


def leave_group() -> None:
    dist.destroy_process_group()
