"""Samplers: DistributedSampler equivalence, epochs, resume, building, sharding."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from torch.utils.data import IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from gpufeed._order.sampler import (
    SeededRandomSampler,
    ShardedIterable,
    ShardedSampler,
    ShardInfo,
    build_sampler,
    get_shard_info,
    resolve_world,
    set_shard_info,
    shard_for,
)


@pytest.mark.parametrize("n", [0, 1, 7, 12, 37])
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_order_as_torch_distributed_sampler(n, world_size, shuffle, drop_last):
    for rank in range(world_size):
        ours = ShardedSampler(
            range(n), rank=rank, world_size=world_size, shuffle=shuffle, seed=11,
            drop_last=drop_last,
        )
        theirs = DistributedSampler(
            range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=11,
            drop_last=drop_last,
        )
        for epoch in range(3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_disjoint_and_cover(drop_last):
    n, world_size = 23, 4
    samplers = [
        ShardedSampler(range(n), rank=r, world_size=world_size, drop_last=drop_last, seed=3)
        for r in range(world_size)
    ]
    for _ in range(3):  # epochs advance by themselves
        parts = [list(s) for s in samplers]
        assert len({len(p) for p in parts}) == 1  # equal counts: DDP needs them
        counts = Counter(i for p in parts for i in p)
        if drop_last:
            assert all(c == 1 for c in counts.values())
            assert len(counts) == n - n % world_size
        else:
            assert set(counts) == set(range(n))
            assert sum(counts.values()) - n == (-n) % world_size  # padding repeats only


def test_epoch_advances_and_set_epoch_pins():
    s = SeededRandomSampler(range(50), seed=5)
    first, second = list(s), list(s)
    assert first != second and sorted(first) == sorted(second) == list(range(50))
    assert s.epoch == 2
    s.set_epoch(0)
    assert list(s) == first
    s.set_epoch(1)
    assert list(s) == second
    with pytest.raises(ValueError, match="epoch must be an int >= 0, got -1"):
        s.set_epoch(-1)


def test_seeded_random_sampler_is_a_random_sampler_of_seed_and_epoch():
    a, b = SeededRandomSampler(range(30), seed=9), SeededRandomSampler(range(30), seed=9)
    assert isinstance(a, RandomSampler) and len(a) == 30
    assert [list(a) for _ in range(3)] == [list(b) for _ in range(3)]
    one_rank = ShardedSampler(range(30), rank=0, world_size=1, seed=9)
    b.set_epoch(0)
    assert [list(one_rank) for _ in range(3)] == [list(b) for _ in range(3)]
    other_seed = SeededRandomSampler(range(30), seed=10)
    assert list(other_seed) != list(SeededRandomSampler(range(30), seed=9))


@pytest.mark.parametrize("make", [
    lambda: SeededRandomSampler(range(20), seed=4),
    lambda: ShardedSampler(range(20), rank=1, world_size=3, seed=4),
])
def test_state_dict_resumes_mid_epoch(make):
    ref = make()
    ref.set_epoch(2)
    expected = list(ref)
    s = make()
    s.set_epoch(2)
    it = iter(s)
    head = [next(it) for _ in range(4)]
    state = s.state_dict()
    assert state["epoch"] == 2 and state["position"] == 4
    fresh = make()
    fresh.load_state_dict(state)
    assert head + list(fresh) == expected
    assert fresh.state_dict()["epoch"] == 3  # the resumed epoch was exhausted
    ref.set_epoch(3)
    assert list(fresh) == list(ref)


def test_state_dict_before_iterating_and_pending_seek():
    s = SeededRandomSampler(range(8), seed=1)
    assert s.state_dict()["epoch"] == 0 and s.state_dict()["position"] == 0
    s.seek(3, 5)
    assert (s.state_dict()["epoch"], s.state_dict()["position"]) == (3, 5)
    assert len(list(s)) == 3
    s.seek(1, 8)
    assert list(s) == []
    with pytest.raises(ValueError, match=r"position must be an int in \[0, 8\].*got 9"):
        s.seek(0, 9)


def test_set_epoch_after_seek_to_another_epoch_drops_the_position():
    s = SeededRandomSampler(range(8), seed=1)
    s.seek(2, 5)
    s.set_epoch(3)
    assert len(list(s)) == 8


@pytest.mark.parametrize(("key", "other"), [
    ("dataset_len", lambda: ShardedSampler(range(21), rank=0, world_size=2)),
    ("world_size", lambda: ShardedSampler(range(20), rank=0, world_size=4)),
    ("rank", lambda: ShardedSampler(range(20), rank=1, world_size=2)),
    ("drop_last", lambda: ShardedSampler(range(20), rank=0, world_size=2, drop_last=True)),
])
def test_load_state_dict_rejects_changes(key, other):
    state = ShardedSampler(range(20), rank=0, world_size=2).state_dict()
    new = other()
    with pytest.raises(ValueError, match=f"{key}={state[key]!r} but this sampler has "
                                         f"{key}={new.state_dict()[key]!r}"):
        new.load_state_dict(state)


def test_load_state_dict_rejects_garbage():
    s = SeededRandomSampler(range(5), seed=0)
    with pytest.raises(ValueError, match="need int seed, epoch and position"):
        s.load_state_dict({"dataset_len": 5, "world_size": 1, "seed": 0})


def test_resolve_world():
    assert resolve_world(None, None) == (0, 1, False)
    assert resolve_world(1, 2) == (1, 2, True)
    with pytest.raises(ValueError, match="rank=1 was given without world_size"):
        resolve_world(1, None)
    with pytest.raises(ValueError, match="world_size=2 was given without rank"):
        resolve_world(None, 2)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 1\], got 2"):
        resolve_world(2, 2)
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        resolve_world(0, 0)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_build_sampler_choices():
    data = list(range(10))
    common = dict(seed=3, rank=None, world_size=None, drop_last=False, shard=False)
    user = SequentialSampler(data)
    assert build_sampler(data, shuffle=None, sampler=user, **common) is user
    assert build_sampler(_Stream(), shuffle=None, sampler=None, **common) is None
    assert build_sampler(data, shuffle=False, sampler=None, **common) is None
    assert build_sampler(data, shuffle=True, sampler=None, **{**common, "seed": None}) is None
    shuffled = build_sampler(data, shuffle=True, sampler=None, **common)
    assert isinstance(shuffled, SeededRandomSampler) and shuffled.seed == 3
    sharded = build_sampler(
        data, shuffle=True, sampler=None, seed=3, rank=1, world_size=2, drop_last=True,
        shard=True)
    assert isinstance(sharded, ShardedSampler)
    assert (sharded.rank, sharded.num_replicas, sharded.shuffle, sharded.drop_last) == (
        1, 2, True, True
    )
    unshuffled = build_sampler(
        data, shuffle=None, sampler=None, seed=3, rank=0, world_size=2, drop_last=False,
        shard=True)
    assert isinstance(unshuffled, ShardedSampler) and list(unshuffled) == [0, 2, 4, 6, 8]
    unseeded = build_sampler(
        data, shuffle=True, sampler=None, seed=None, rank=0, world_size=2, drop_last=False,
        shard=True)
    assert isinstance(unseeded, ShardedSampler) and unseeded.seed == 0
    with pytest.raises(ValueError, match="cannot be combined with sampler=SequentialSampler"):
        build_sampler(data, shuffle=None, sampler=user, seed=3, rank=0, world_size=2,
                      drop_last=False, shard=True)


def test_shard_for_and_info():
    assert shard_for(0, 1, 0, 0) == (0, 1)
    assert shard_for(1, 2, 2, 3) == (5, 6)
    assert ShardInfo(1, 2, 2, 3).index == 5 and ShardInfo(1, 2, 2, 3).count == 6
    with pytest.raises(ValueError, match=r"worker_id must be in \[0, 2\], got 3"):
        shard_for(0, 1, 3, 3)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\], got 2"):
        shard_for(2, 2, 0, 1)
    assert get_shard_info() == ShardInfo()


def test_shard_info_is_thread_local_and_shards_cover():
    source = list(range(23))
    results: dict[int, list[int]] = {}

    def work(rank: int, worker: int) -> None:
        set_shard_info(ShardInfo(rank, 2, worker, 3))
        results[rank * 3 + worker] = list(ShardedIterable(source))

    threads = [threading.Thread(target=work, args=(r, w)) for r in range(2) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(i for part in results.values() for i in part) == source
    assert results[4] == [4, 10, 16, 22]
    assert get_shard_info() == ShardInfo()  # this thread never set one


def test_sharded_iterable_under_stock_loader_workers():
    loader = torch.utils.data.DataLoader(
        ShardedIterable(range(10)), batch_size=None, num_workers=2,
        multiprocessing_context="fork",
    )
    assert sorted(int(x) for x in loader) == list(range(10))
