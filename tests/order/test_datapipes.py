"""DataPipe graphs in the loader: sharded across workers and ranks, shuffled from the loader's
seed, as the stock loader does (NOTE [ DataPipes ] in _order/datapipes.py)."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch.utils.data import DataLoader as StockLoader
from torch.utils.data.datapipes.iter import IterableWrapper

import gpufeed
from gpufeed._order import datapipes as _datapipes

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torch's datapipe deprecation


def _sharded(n: int) -> IterableWrapper:
    return IterableWrapper(list(range(n))).sharding_filter()


def _shuffled(n: int) -> IterableWrapper:
    return IterableWrapper(list(range(n))).shuffle(buffer_size=8).sharding_filter()


def _items(loader) -> list[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [int(x) for x in loader]


@pytest.mark.parametrize(("num_workers", "worker_type"),
                         [(0, "process"), (2, "process"), (3, "process"), (2, "thread")])
def test_a_sharding_filter_gives_each_sample_once_as_the_stock_loader(num_workers, worker_type):
    # Left alone, every worker would read the whole pipe: each sample num_workers times.
    got = _items(gpufeed.DataLoader(_sharded(23), num_workers=num_workers,
                                    worker_type=worker_type))
    stock = _items(StockLoader(_sharded(23), num_workers=num_workers))
    assert collections.Counter(got) == collections.Counter(range(23))
    assert got == stock  # the same worker turns, so the same order


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_shuffled_pipe_follows_the_global_seed_as_the_stock_loader(num_workers, persistent):
    def epochs(cls) -> tuple[list[list[int]], torch.Tensor]:
        loader = cls(_shuffled(40), num_workers=num_workers, persistent_workers=persistent,
                     shuffle=True)
        out = []
        for seed in (7, 7, 8):
            torch.manual_seed(seed)
            out.append(_items(loader))
        return out, torch.rand(3)  # what the loader's draws left of the global generator

    (a, b, c), after = epochs(gpufeed.DataLoader)
    stock, stock_after = epochs(StockLoader)
    assert a == b and a != c  # the seed decides the order, epoch after epoch
    assert sorted(a) == list(range(40))
    assert [a, b, c] == stock  # the stock loader's order for the same seed
    assert torch.equal(after, stock_after)  # and the same draws from the global generator


def test_the_loader_generator_seeds_the_pipe():
    def first_epoch(seed: int) -> list[int]:
        return _items(gpufeed.DataLoader(_shuffled(30), num_workers=2, shuffle=True,
                                         generator=torch.Generator().manual_seed(seed)))

    assert first_epoch(3) == first_epoch(3) != first_epoch(4)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_shard_first_then_workers(monkeypatch, num_workers):
    # rank 1 of 2: with two workers the pipe is cut in four, and this rank's workers keep the
    # shards 1 and 3 (worker_id * world_size + rank): the odd samples, as with none
    monkeypatch.setattr(_datapipes, "resolve_world", lambda rank, world_size: (1, 2, True))
    got = _items(gpufeed.DataLoader(_sharded(20), num_workers=num_workers,
                                    multiprocessing_context="fork" if num_workers else None))
    assert sorted(got) == list(range(1, 20, 2))
