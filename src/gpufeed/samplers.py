"""Samplers that make the order a function of (seed, epoch) and shard it across ranks.

Both resume exactly (``state_dict()``/``load_state_dict()``) and give every rank a disjoint
share of the set under torchrun or any ``torch.distributed`` launcher.
"""

from ._order.sampler import (
    SeededRandomSampler,
    ShardedIterable,
    ShardedSampler,
    ShardInfo,
    get_shard_info,
)

__all__ = [
    "SeededRandomSampler",
    "ShardInfo",
    "ShardedIterable",
    "ShardedSampler",
    "get_shard_info",
]
