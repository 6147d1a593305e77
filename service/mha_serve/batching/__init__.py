"""Batching: an asyncio queue per model and lane that forms batches; knows nothing of torch."""

from mha_serve.batching.batcher import (
    Batcher,
    BatchInfo,
    BatchPolicy,
    Closed,
    DeadlineExceeded,
    QueueFull,
)
from mha_serve.batching.lanes import ModelLanes

__all__ = [
    "BatchInfo",
    "BatchPolicy",
    "Batcher",
    "Closed",
    "DeadlineExceeded",
    "ModelLanes",
    "QueueFull",
]
