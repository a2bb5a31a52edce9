"""Tensor parallelism on ``torch.distributed`` (gloo on CPU, NCCL on CUDA); see ``tensor_parallel.py``."""

from radixserve.runtime.distributed.shard import check_shardable, shard_model
from radixserve.runtime.distributed.tensor_parallel import (
    TensorParallelModel,
    WorkerDiedError,
    finish_start,
    run_worker_node,
    start_leader,
)

__all__ = [
    "TensorParallelModel",
    "WorkerDiedError",
    "check_shardable",
    "finish_start",
    "run_worker_node",
    "shard_model",
    "start_leader",
]
