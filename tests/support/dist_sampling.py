"""Run by tests/integration/test_distributed.py under ``torchrun --nproc_per_node=2`` (gloo, CPU).

Each rank records what it sees, epoch by epoch, and writes ``<out>/rank<R>.json``; the test
checks the ranks against each other. Recorded per configuration:

- ``sampler/*``: gpufeed's ShardedSampler fed to torch's own DataLoader (rank and world size
  read from the process group);
- ``loader/*``: ``gpufeed.DataLoader(..., seed=3)``, which must shard by itself once the process
  group is up (only when the loader has ``seed=``);
- ``iterable``: an iterable dataset wrapped in ShardedIterable, two thread workers per rank;
- ``datapipe``: a shuffled, sharded datapipe with a different global seed on each rank (the
  loader broadcasts rank 0's shared seed: NOTE [ DataPipes ]), and ``datapipe/stock``.

Usage: ``torchrun --nproc_per_node=2 tests/support/dist_sampling.py OUT_DIR``.
"""

from __future__ import annotations

import inspect
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.datapipes.iter import IterableWrapper

import gpufeed
from gpufeed._order.sampler import ShardedIterable, ShardedSampler

N, BATCH, EPOCHS = 21, 4, 3


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample ``index``: the index and one draw from the sample's generator (thread workers
    do not seed the global ones: NOTE [ Seeding and threads ])."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(index), torch.rand((), generator=gpufeed.random.sample_generator())


def epochs(loader: object) -> list[list[list[float]]]:
    """Per epoch, the (index, random draw) pairs in delivery order."""
    out = []
    for _ in range(EPOCHS):
        seen = []
        for index, draw in loader:  # type: ignore[attr-defined]
            seen += [[int(i), float(d)] for i, d in zip(index, draw, strict=True)]
        out.append(seen)
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report: dict[str, object] = {"rank": rank, "world_size": dist.get_world_size()}
    integrated = "seed" in inspect.signature(gpufeed.DataLoader.__init__).parameters
    for shuffle in (True, False):
        for drop_last in (False, True):
            key = f"shuffle={shuffle},drop_last={drop_last}"
            sampler = ShardedSampler(Indexed(), shuffle=shuffle, seed=3, drop_last=drop_last)
            report[f"sampler/{key}"] = epochs(
                DataLoader(Indexed(), batch_size=BATCH, sampler=sampler, drop_last=drop_last)
            )
            if integrated:
                loader = gpufeed.DataLoader(
                    Indexed(), batch_size=BATCH, shuffle=shuffle, drop_last=drop_last,
                    seed=3, num_workers=2 if shuffle else 0, worker_type="thread",
                )
                report[f"loader/{key}"] = epochs(loader)
                report[f"loader_sampler/{key}"] = type(loader.sampler).__name__
    # a program written for the stock loader (no seed=): every rank reads every sample, in
    # the stock order (the same global seed on both sides)
    for shuffle in (True, False):
        key = f"stock_program/shuffle={shuffle}"
        torch.manual_seed(7)
        ours = gpufeed.DataLoader(Indexed(), batch_size=BATCH, shuffle=shuffle, num_workers=2)
        report[key] = [int(i) for index, _ in ours for i in index]
        report[f"{key}/sampler"] = type(ours.sampler).__name__
        report[f"{key}/world"] = [ours.rank, ours.world_size]
        torch.manual_seed(7)
        stock = DataLoader(Indexed(), batch_size=BATCH, shuffle=shuffle, num_workers=2)
        report[f"{key}/stock"] = [int(i) for index, _ in stock for i in index]
    stream = ShardedIterable(range(N))
    report["iterable"] = [
        [int(x) for x in gpufeed.DataLoader(stream, batch_size=None, num_workers=2,
                                            worker_type="thread")]
    ]
    for name, cls in (("datapipe", gpufeed.DataLoader), ("datapipe/stock", DataLoader)):
        torch.manual_seed(11 + rank)
        pipe = IterableWrapper(list(range(N))).shuffle(buffer_size=8).sharding_filter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's datapipe deprecation
            report[name] = [int(x) for x in cls(pipe, batch_size=None, num_workers=2)]
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
