"""Scale-out on torch.distributed: tensor and pipeline parallelism, driver/worker executors (mp, torchrun, Ray).

The driver (rank 0) owns the Scheduler and BlockManager and broadcasts each step; only the driver samples.
"""

from paged_backend.distributed.sharding import check_shardable, shard_model, tp_plan

__all__ = ["check_shardable", "shard_model", "tp_plan"]
