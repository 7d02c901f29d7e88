"""Sharding across ranks and workers: which part of the data this process and worker own.

:func:`resolve_world` reads (rank, world size) from arguments or ``torch.distributed``.
Iterable datasets are sharded by ``(rank, worker)``: :func:`shard_for` gives one worker's
shard, :func:`get_shard_info` tells code inside a worker its own, and :class:`ShardedIterable`
strides any iterable by it. The samplers of ``_order/sampler.py`` shard map-style datasets.

NOTE [ Sharding by rank ]
-------------------------
The stock loader never shards by itself: under ``torch.distributed`` every rank reads every
sample unless a ``DistributedSampler`` says otherwise, and frameworks rely on that: Lightning
injects its own sampler (or, with ``use_distributed_sampler=False``, leaves each rank the whole
dataset), Accelerate's ``prepare`` splits the batches among the processes, evaluation code
reads the whole set on every rank. Sharding whenever a process group is up breaks each of them,
silently: some samples are never seen. So ``gpufeed.DataLoader`` shards a map-style dataset by
rank only when asked: ``rank=``/``world_size=``, or ``seed=`` with an initialised process group
(a shared seed gives every rank the same permutation to split; a program written for the stock
loader passes none of them). A loader that shards itself refuses ``accelerator.prepare`` with
an error naming both ways out. Iterable datasets shard themselves, through
:func:`get_shard_info`, which always reports the process group's rank.
Measurements: docs/how-it-works/measurements/order.md#sharding-by-rank.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset


def resolve_world(rank: int | None, world_size: int | None) -> tuple[int, int, bool]:
    """``(rank, world_size, distributed)``: explicit values win, missing ones come from an
    initialised ``torch.distributed`` process group; ``distributed`` says either was used
    (with neither: ``(0, 1, False)``)."""
    initialised = dist.is_available() and dist.is_initialized()
    if rank is None and world_size is None and not initialised:
        return 0, 1, False
    if world_size is None:
        if not initialised:
            raise ValueError(
                f"rank={rank!r} was given without world_size and torch.distributed is not "
                "initialised; pass world_size too (or call torch.distributed.init_process_group)"
            )
        world_size = dist.get_world_size()
    if rank is None:
        if not initialised:
            raise ValueError(
                f"world_size={world_size!r} was given without rank and torch.distributed is not "
                "initialised; pass rank too (or call torch.distributed.init_process_group)"
            )
        rank = dist.get_rank()
    # a wrong type is a TypeError, a wrong int a ValueError (as torch's own checks)
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int >= 1, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int in [0, {world_size - 1}], got {rank!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size - 1}], got {rank!r}")
    return rank, world_size, True


@dataclass(frozen=True)
class ShardInfo:
    """Which shard of an iterable dataset the current worker owns.

    Attributes:
        rank, world_size: this process in ``torch.distributed`` (0, 1 without it).
        worker_id, num_workers: this worker in the loader (0, 1 in the main process).
    """

    rank: int = 0
    world_size: int = 1
    worker_id: int = 0
    num_workers: int = 1

    @property
    def index(self) -> int:
        """Shard number: ``rank * num_workers + worker_id``."""
        return shard_for(self.rank, self.world_size, self.worker_id, self.num_workers)[0]

    @property
    def count(self) -> int:
        """Number of shards: ``world_size * num_workers``."""
        return self.world_size * self.num_workers


def shard_for(rank: int, world_size: int, worker_id: int, num_workers: int) -> tuple[int, int]:
    """``(shard_index, num_shards)`` of one worker: ``(rank*num_workers + worker_id,
    world_size*num_workers)``; ``num_workers=0`` (main-process loading) counts as one worker."""
    num_workers = max(num_workers, 1)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size - 1}], got {rank!r}")
    if not 0 <= worker_id < num_workers:
        raise ValueError(f"worker_id must be in [0, {num_workers - 1}], got {worker_id!r}")
    return rank * num_workers + worker_id, world_size * num_workers


_local = threading.local()


def set_shard_info(info: ShardInfo | None) -> None:
    """Called by the loader in each worker (thread-local, so thread workers each get theirs)."""
    _local.info = info
    _local.pid = os.getpid()  # a forked child (e.g. a stock loader's worker) must not inherit it


def get_shard_info() -> ShardInfo:
    """The shard owned by the calling worker, for use inside ``IterableDataset.__iter__``: set
    by gpufeed's workers, else derived from ``torch.utils.data.get_worker_info()`` and
    ``torch.distributed`` (so it also works under the stock loader)."""
    info: ShardInfo | None = getattr(_local, "info", None)
    if info is not None and getattr(_local, "pid", None) == os.getpid():
        return info
    rank, world_size, _ = resolve_world(None, None)
    worker = torch.utils.data.get_worker_info()
    if worker is None:
        return ShardInfo(rank, world_size, 0, 1)
    return ShardInfo(rank, world_size, worker.id, worker.num_workers)


class ShardedIterable(IterableDataset[Any]):
    """Wrap an iterable so each worker of each rank yields every ``count``-th item of its shard.

    Every shard still reads the whole source (skipping what is not its own): simple and correct,
    but it costs I/O; sources that can seek should shard themselves with :func:`get_shard_info`.
    """

    def __init__(self, source: Iterable[Any]) -> None:
        self.source = source

    def __iter__(self) -> Iterator[Any]:
        info = get_shard_info()
        index, count = info.index, info.count
        for position, item in enumerate(self.source):
            if position % count == index:
                yield item
