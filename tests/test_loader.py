"""Drop-in compatibility: the same scenarios against torch's DataLoader and gpufeed's.

Every comparison is exact (values, dtypes, shapes, container types); with ``in_order=False``
the batches are compared as a multiset.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import gc
import io
import multiprocessing
import os
import sys
import time
import typing
import warnings

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import gpufeed
from gpufeed._host.workahead import CHUNK_MAX
from support.compare import assert_same, assert_same_batches, collect, list_or_stop, seed_all
from support.fakes import (
    Box,
    CountingDataset,
    GetitemsDataset,
    KindDataset,
    NoLenIterable,
    Pair,
    RandomDataset,
    RangeIterable,
    RichDataset,
    VarLenDataset,
    WorkerInfoDataset,
    box_collate,
    identity_collate,
    init_calls,
    numpy_collate,
    pad_collate,
    pair_collate,
    record_init,
)
from support.leaks import no_leaks

# -- the grid ---------------------------------------------------------------------------------

# (num_workers, worker_type, in_order); worker_type and in_order only matter with workers.
WORKERS = [
    (0, "process", True),
    (1, "process", True),
    (1, "thread", True),
    (2, "process", True),
    (2, "process", False),
    (2, "thread", True),
    (2, "thread", False),
]


def _grid():
    for kind in ("map", "iterable"):
        for bs in (1, 7, None):
            for shuffle in (False, True) if kind == "map" else (False,):
                for drop_last in (False, True) if bs == 7 else (False,):
                    for nw, wt, in_order in WORKERS:
                        yield pytest.param(
                            kind, bs, shuffle, drop_last, nw, wt, in_order,
                            id=f"{kind}-bs{bs}-{'shuf' if shuffle else 'seq'}"
                            f"{'-drop' if drop_last else ''}-w{nw}"
                            f"{'-' + wt if nw else ''}{'' if in_order else '-unordered'}",
                        )


_stock_cache: dict[tuple, list] = {}


def _stock(key: tuple, dataset_fn, **kwargs) -> list:
    """Stock batches for a scenario; thread/process variants share one stock run."""
    if key not in _stock_cache:
        _stock_cache[key] = collect(tud.DataLoader, dataset_fn(), **kwargs)[0]
    return _stock_cache[key]


@pytest.mark.parametrize(
    "kind,batch_size,shuffle,drop_last,num_workers,worker_type,in_order", list(_grid())
)
def test_same_batches_as_stock(kind, batch_size, shuffle, drop_last, num_workers, worker_type,
                               in_order):
    dataset_fn = RichDataset if kind == "map" else RangeIterable
    kwargs = dict(batch_size=batch_size, num_workers=num_workers, in_order=in_order)
    if shuffle:
        kwargs["shuffle"] = True
    if drop_last:
        kwargs["drop_last"] = True
    # stock's unordered batches are compared as a multiset: its in-order run serves for both
    key = (kind, batch_size, shuffle, drop_last, num_workers)
    expected = _stock(key, dataset_fn, **{**kwargs, "in_order": True})
    got = collect(gpufeed.DataLoader, dataset_fn(), worker_type=worker_type, **kwargs)[0]
    assert_same_batches(expected, got, ordered=in_order)


# -- samplers, collate functions, sample kinds ---------------------------------------------

WORKER_CONFIGS = [
    pytest.param(dict(num_workers=0), id="main"),
    pytest.param(dict(num_workers=2), id="process"),
    pytest.param(dict(num_workers=2, worker_type="thread"), id="thread"),
]


def _compare(dataset_fn, workers, epochs=1, ordered=True, same_workers=False, **kwargs):
    """gpufeed with ``workers`` against stock; returns gpufeed's batches.

    The datasets used with ``same_workers=False`` are deterministic, and stock's batches do
    not depend on ``num_workers`` then (its global RNG use is the same with and without
    workers), so the reference runs in the main process: half the process start-ups.
    """
    stock_workers = {k: v for k, v in workers.items() if k != "worker_type"}
    if not same_workers:
        stock_workers = {}
    # deep copies: a generator or sampler must start from the same state for both loaders
    expected = collect(tud.DataLoader, dataset_fn(), epochs=epochs, **stock_workers,
                       **copy.deepcopy(kwargs))
    got = collect(gpufeed.DataLoader, dataset_fn(), epochs=epochs, **workers,
                  **copy.deepcopy(kwargs))
    for e, g in zip(expected, got, strict=True):
        assert_same_batches(e, g, ordered=ordered)
    return got


@pytest.mark.parametrize("workers", WORKER_CONFIGS)
@pytest.mark.parametrize(
    "case",
    [
        "sampler_list", "subset_random_sampler", "weighted_sampler", "batch_sampler_lists",
        "batch_sampler_object", "custom_collate", "generator",
    ],
)
def test_samplers_and_collate_match_stock(case, workers):
    kwargs: dict = {}
    if case == "sampler_list":
        kwargs = dict(sampler=[5, 3, 3, 0, 22, 7, 1], batch_size=3)
    elif case == "subset_random_sampler":
        kwargs = dict(sampler=tud.SubsetRandomSampler([2, 4, 6, 8, 10, 12, 14]), batch_size=2)
    elif case == "weighted_sampler":
        kwargs = dict(
            sampler=tud.WeightedRandomSampler([1.0] * 20 + [5.0] * 3, 30), batch_size=4
        )
    elif case == "batch_sampler_lists":
        kwargs = dict(batch_sampler=[[0, 1], [5, 6, 7], [22], [3, 3, 3, 3]])
    elif case == "batch_sampler_object":
        kwargs = dict(
            batch_sampler=tud.BatchSampler(tud.RandomSampler(range(23)), 5, drop_last=False)
        )
    elif case == "custom_collate":
        kwargs = dict(batch_size=4, collate_fn=lambda b: {"n": len(b), "ids": [s["i"] for s in b],
                                                          "x": torch.stack([s["x"] for s in b])})
    elif case == "generator":
        g = torch.Generator()
        g.manual_seed(1234)
        kwargs = dict(batch_size=4, shuffle=True, generator=g)
    _compare(RichDataset, workers, **kwargs)


def test_generator_two_epochs_match_stock():
    """The loader's generator drives the shuffle and the base seed over epochs."""

    def run(cls, **kw):
        g = torch.Generator()
        g.manual_seed(7)
        loader = cls(RichDataset(13), batch_size=3, shuffle=True, generator=g, num_workers=2,
                     **kw)
        return [list(loader) for _ in range(2)]

    expected = run(tud.DataLoader)
    for wt in ("process", "thread"):
        got = run(gpufeed.DataLoader, worker_type=wt)
        for e, g in zip(expected, got, strict=True):
            assert_same_batches(e, g)


@pytest.mark.parametrize("taken", [0, 2, 3])
@pytest.mark.parametrize("kwargs", [
    dict(num_workers=1), dict(num_workers=2), dict(num_workers=2, prefetch_factor=1),
    dict(num_workers=1, prefetch_factor=3, persistent_workers=True),
    dict(num_workers=2, worker_type="thread"),
], ids=["w1", "w2", "w2-pf1", "w1-pf3-persistent", "w2-thread"])
@pytest.mark.parametrize("n,drop_last", [(10, False), (9, False), (10, True)])
def test_generator_break_then_next_epoch_matches_stock(taken, kwargs, n, drop_last):
    """Breaking out after ``taken`` batches leaves the user's generator as stock does (the
    sampler's closing draw comes at a pull that depends on n, batch size and drop_last)."""
    def run(cls, **kw):
        g = torch.Generator()
        g.manual_seed(0)
        loader = cls(RangeIndex(n), batch_size=3, shuffle=True, generator=g,
                     drop_last=drop_last, **kw)
        it = iter(loader)
        first = [next(it).tolist() for _ in range(taken)]
        del it
        return [first, [b.tolist() for b in loader], g.initial_seed(), g.get_state()]

    stock_kw = {k: v for k, v in kwargs.items() if k != "worker_type"}
    ours = run(gpufeed.DataLoader, **kwargs)
    stock = _stock_run(("generator", taken, n, drop_last, *sorted(stock_kw.items())),
                       lambda: run(tud.DataLoader, **stock_kw))
    assert ours[:3] == stock[:3]
    assert torch.equal(ours[3], stock[3]), "the generator was left in another state"


_stock_runs: dict[tuple, list] = {}


def _stock_run(key: tuple, run):
    """A stock run's outcome, shared by the cases that differ only in gpufeed's worker_type:
    it depends on the stock loader's arguments alone (fresh generators, index-only datasets)."""
    if key not in _stock_runs:
        _stock_runs[key] = run()
    return _stock_runs[key]


# taken=2 stands for any break mid-epoch before the sampler's closing draw is due (stock has
# pulled 4-6 of the 7 indices by then): taken=1 is the same state one index further from it
# (the bug this caught failed both alike); taken=7 is the break after the last index.
@pytest.mark.parametrize("taken", [2, 7])
@pytest.mark.parametrize("kwargs", [
    dict(num_workers=1), dict(num_workers=2), dict(num_workers=2, worker_type="thread"),
    dict(num_workers=1, prefetch_factor=3, persistent_workers=True),
], ids=["w1", "w2", "w2-thread", "w1-pf3-persistent"])
@pytest.mark.parametrize("how", ["shuffle", "sampler"])
def test_unbatched_break_then_next_epoch_matches_stock(taken, kwargs, how):
    """``batch_size=None``: the sampler is pulled one index at a time, so breaking out leaves
    its generator as stock does (gpufeed works further ahead than stock pulls: it used to
    exhaust a short epoch's sampler, whose closing draw then shifted the next epoch's order)."""
    n = 7

    def run(cls, **kw):
        g = torch.Generator()
        g.manual_seed(40)
        if how == "shuffle":
            kw.update(shuffle=True, generator=g)
        else:
            kw.update(sampler=tud.RandomSampler(range(n), generator=g))
        loader = cls(RangeIndex(n), batch_size=None, **kw)
        it = iter(loader)
        first = [next(it) for _ in range(taken)]
        del it
        return [first, list(loader), list(loader), g.get_state()]

    stock_kw = {k: v for k, v in kwargs.items() if k != "worker_type"}
    ours = run(gpufeed.DataLoader, **kwargs)
    stock = _stock_run(("unbatched", taken, how, *sorted(stock_kw.items())),
                       lambda: run(tud.DataLoader, **stock_kw))
    assert ours[:3] == stock[:3]
    assert torch.equal(ours[3], stock[3]), "the generator was left in another state"


class RangeIndex(tud.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


SAMPLE_KINDS = [
    "tensor", "tensor0d", "dtypes", "tuple", "list", "dict", "ordereddict", "namedtuple",
    "numpy", "numpy_scalar", "int", "float", "bool", "str", "bytes",
]


@pytest.mark.parametrize("workers", WORKER_CONFIGS)
@pytest.mark.parametrize("batch_size", [3, None])
def test_sample_kinds_match_stock(batch_size, workers):
    """One epoch whose batches each hold one kind of sample (top-level type included).

    Kinds change from batch to batch, so the slot layout learnt from the first batch does
    not fit the later ones either.
    """
    ds = KindsDataset(SAMPLE_KINDS, per_kind=4)
    if batch_size is None:
        kwargs: dict = dict(batch_size=None)
    else:
        kwargs = dict(batch_sampler=[list(range(k * 4, k * 4 + batch_size))
                                     for k in range(len(SAMPLE_KINDS))])
    expected = list_or_stop(tud.DataLoader(ds, **kwargs))
    got = list_or_stop(gpufeed.DataLoader(ds, **kwargs, **workers))
    assert len(got) == len(expected)
    for k, (e, g) in enumerate(zip(expected, got, strict=True)):
        kind = SAMPLE_KINDS[k if batch_size else k // 4]
        assert_same(e, g, f"batch {k} ({kind})")


class KindsDataset(tud.Dataset):
    """Samples ``k*per_kind ... (k+1)*per_kind - 1`` are of kind ``kinds[k]``."""

    def __init__(self, kinds, per_kind):
        self.parts = [KindDataset(kind, per_kind) for kind in kinds]
        self.per_kind = per_kind

    def __len__(self):
        return self.per_kind * len(self.parts)

    def __getitem__(self, i):
        return self.parts[i // self.per_kind][i % self.per_kind]


@pytest.mark.parametrize("workers", WORKER_CONFIGS)
@pytest.mark.parametrize(
    "collate_fn", [pair_collate, box_collate, numpy_collate, identity_collate],
    ids=["dataclass", "object", "numpy", "identity"],
)
def test_custom_collate_results_match_stock(collate_fn, workers):
    got = _compare(functools.partial(KindDataset, "tuple"), workers, batch_size=4,
                   collate_fn=collate_fn)
    first = got[0][0]
    if collate_fn is pair_collate:
        assert type(first) is Pair
    if collate_fn is box_collate:
        assert type(first) is Box
    if collate_fn is numpy_collate:
        assert all(isinstance(first[k], np.ndarray) for k in ("c", "f", "strided"))


def test_numpy_string_arrays_pass_through(worker_type):
    """Non-numeric arrays (here <U2) cannot go in a slot: they travel as they are."""
    ds = NumpyLeafDataset(np.array(["ab", "cd"]))
    expected = list_or_stop(tud.DataLoader(ds, batch_size=None, num_workers=1))
    got = list_or_stop(gpufeed.DataLoader(ds, batch_size=None, num_workers=1,
                                          worker_type=worker_type))
    assert_same_batches(expected, got)


def test_numpy_big_endian_arrays_pass_through(worker_type):
    """Non-native byte order arrays from a collate_fn arrive with their values.

    (Stock itself returns '>f4' without workers and native float32 with them: only the byte
    order may differ.)
    """
    ds = NumpyLeafDataset(np.arange(3, dtype=">f4"))
    expected = list_or_stop(tud.DataLoader(ds, batch_size=2, num_workers=1,
                                           collate_fn=identity_collate))
    got = list_or_stop(gpufeed.DataLoader(ds, batch_size=2, num_workers=1,
                                          collate_fn=identity_collate, worker_type=worker_type))
    assert len(got) == len(expected)
    for e, g in zip(expected, got, strict=True):
        assert type(g) is list and len(g) == len(e)
        for a, b in zip(e, g, strict=True):
            assert type(b) is np.ndarray and np.array_equal(a, b)
            assert b.dtype.newbyteorder("=") == a.dtype.newbyteorder("=")


class NumpyLeafDataset(tud.Dataset):
    def __init__(self, arr):
        self.arr = arr

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.arr


@pytest.mark.parametrize("workers", WORKER_CONFIGS)
def test_variable_size_samples_with_padding_collate(workers):
    got = _compare(VarLenDataset, workers, batch_size=7, shuffle=True, collate_fn=pad_collate)
    widths = {b[0].shape[1] for b in got[0]}
    assert len(widths) > 1 or max(widths) == 5


# -- worker random state and worker info ----------------------------------------------------


@pytest.mark.parametrize("n,batch_size", [(12, 3), (200, 5)], ids=["short", "long"])
def test_worker_random_state_matches_stock(n, batch_size):
    """torch/numpy/random draws in __getitem__ equal the stock loader's (process workers);
    the long epoch has cheap batches sent several per message: still batch k on worker
    k % num_workers."""
    expected = collect(tud.DataLoader, RandomDataset(n), batch_size=batch_size, shuffle=True,
                       num_workers=2)
    got = collect(gpufeed.DataLoader, RandomDataset(n), batch_size=batch_size, shuffle=True,
                  num_workers=2)
    assert_same_batches(expected[0], got[0])


@pytest.mark.filterwarnings("ignore::gpufeed.random.RandomStateWarning")  # what it draws from: said
def test_thread_workers_random_samples_are_valid():
    """Threads share the process RNG: compare content, not per-worker random state."""
    got = collect(gpufeed.DataLoader, RandomDataset(12), batch_size=3, shuffle=True,
                  num_workers=2, worker_type="thread")[0]
    expected = collect(tud.DataLoader, RandomDataset(12), batch_size=3, shuffle=True)[0]
    assert [b[3].tolist() for b in got] == [b[3].tolist() for b in expected]
    for b in got:
        assert b[0].shape == (3, 2) and b[1].dtype == torch.float64
        assert ((b[0] >= 0) & (b[0] < 1)).all() and ((b[2] >= 0) & (b[2] < 1)).all()


def _infos(batches):
    rows = set()
    for b in batches:
        for k in range(len(b["i"])):
            rows.add((int(b["id"][k]), int(b["num_workers"][k]), int(b["seed"][k]),
                      b["dataset"][k]))
    return rows


def test_get_worker_info_inside_workers(worker_type):
    expected = _infos(collect(tud.DataLoader, WorkerInfoDataset(12), batch_size=2,
                              num_workers=2)[0])
    got_batches = collect(gpufeed.DataLoader, WorkerInfoDataset(12), batch_size=2,
                          num_workers=2, worker_type=worker_type)[0]
    assert _infos(got_batches) == expected  # ids 0..1, num_workers 2, seed base+id, dataset
    assert {r[0] for r in expected} == {0, 1}
    assert tud.get_worker_info() is None


def test_get_worker_info_is_none_in_main_thread_while_threads_run():
    it = iter(gpufeed.DataLoader(WorkerInfoDataset(12), batch_size=2, num_workers=2,
                                 worker_type="thread"))
    b = next(it)
    assert tud.get_worker_info() is None
    assert gpufeed.get_worker_info() is None
    assert set(b["num_workers"].tolist()) == {2}
    it.close()


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("batch_size", [1, 4, None])
def test_iterable_sharding_gives_each_sample_once(worker_type, batch_size, in_order):
    loader = gpufeed.DataLoader(RangeIterable(31, rich=False), batch_size=batch_size,
                                num_workers=2, worker_type=worker_type, in_order=in_order)
    seen = []
    for b in loader:
        seen.extend(b.tolist() if isinstance(b, torch.Tensor) and b.ndim else [int(b)])
    assert sorted(seen) == list(range(31))


# -- persistent workers, in_order, epochs ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["map-shuffle", "iterable"])
def test_persistent_workers_two_epochs_match_stock(kind, worker_type):
    if kind == "iterable":
        ds_fn, kw = (lambda: RangeIterable(23)), dict(batch_size=2)
    else:
        ds_fn, kw = (lambda: RichDataset(23)), dict(batch_size=4, shuffle=True)
    _compare(ds_fn, dict(num_workers=2, worker_type=worker_type), epochs=2,
             persistent_workers=True, same_workers=True, **kw)


def test_persistent_break_then_next_epoch_matches_stock(worker_type):
    def run(cls, **kw):
        seed_all(3)
        loader = cls(RichDataset(40), batch_size=3, shuffle=True, num_workers=2,
                     persistent_workers=True, **kw)
        it = iter(loader)
        head = [next(it), next(it)]
        del it
        out = [head, list(loader), list(loader)]
        del loader
        gc.collect()
        return out

    expected = run(tud.DataLoader)
    got = run(gpufeed.DataLoader, worker_type=worker_type)
    for e, g in zip(expected, got, strict=True):
        assert_same_batches(e, g)


def test_persistent_loader_usable_after_iterator_closed(worker_type, small_dataset):
    loader = gpufeed.DataLoader(small_dataset, batch_size=4, num_workers=2,
                                persistent_workers=True, worker_type=worker_type)
    it = iter(loader)
    next(it)
    it.close()
    assert len(list(loader)) == 2


def _fetched_after_two_batches(then=None, **kwargs):
    ds = CountingDataset(400)
    loader = gpufeed.DataLoader(ds, batch_size=1, num_workers=2, worker_type="thread", **kwargs)
    if then is not None:  # set on the loader after construction, before iter()
        loader.prefetch_factor = then
    it = iter(loader)
    for _ in range(40):  # long enough for the chunk size to adapt to these cheap batches
        next(it)
    time.sleep(0.3)
    fetched = ds.fetched
    it.close()
    return fetched - 40


@pytest.mark.parametrize("prefetch_factor", [1, 2, 3])
def test_explicit_prefetch_factor_bounds_work_ahead(prefetch_factor):
    ahead = _fetched_after_two_batches(prefetch_factor=prefetch_factor)
    assert ahead <= prefetch_factor * 2, f"{ahead} samples fetched ahead"


def test_unset_prefetch_factor_works_further_ahead_for_cheap_batches():
    """The documented default: several cheap batches per message, bounded by 2*chunk*workers."""
    ahead = _fetched_after_two_batches()
    assert 2 * 2 < ahead <= 2 * CHUNK_MAX * 2, f"{ahead} samples fetched ahead"


def test_prefetch_factor_read_back_is_stocks_and_stays_unset():
    """Left unset, prefetch_factor reads 2, as stock's; a loader built again with it (as
    Lightning rebuilds one from its attributes) still works further ahead on cheap batches.
    An explicit 2 read back stays a strict bound, as does a value set on the loader later."""
    unset = gpufeed.DataLoader(CountingDataset(4), num_workers=2).prefetch_factor
    assert unset == tud.DataLoader(CountingDataset(4), num_workers=2).prefetch_factor == 2
    assert isinstance(unset, int) and repr(unset) == "2" and copy.deepcopy(unset) == 2
    assert gpufeed.DataLoader(CountingDataset(4)).prefetch_factor is None  # no workers
    assert gpufeed.DataLoader(CountingDataset(4), prefetch_factor=unset).prefetch_factor is None
    ahead = _fetched_after_two_batches(prefetch_factor=unset)
    assert 2 * 2 < ahead <= 2 * CHUNK_MAX * 2, f"{ahead} samples fetched ahead"
    explicit = gpufeed.DataLoader(CountingDataset(4), num_workers=2, prefetch_factor=2)
    ahead = _fetched_after_two_batches(prefetch_factor=explicit.prefetch_factor)
    assert ahead <= 2 * 2, f"{ahead} samples fetched ahead"
    ahead = _fetched_after_two_batches(then=2)
    assert ahead <= 2 * 2, f"{ahead} samples fetched ahead"


@pytest.mark.parametrize("workers", WORKER_CONFIGS)
def test_two_live_iterators_of_one_loader(workers):
    """zip(loader, loader): two iterators (two rings, two pools) side by side."""
    stock = tud.DataLoader(RichDataset(13), batch_size=3)
    ours = gpufeed.DataLoader(RichDataset(13), batch_size=3, **workers)
    expected = [(a, b) for a, b in zip(stock, stock, strict=True)]
    got = [(a, b) for a, b in zip(ours, ours, strict=True)]
    assert_same_batches(expected, got)


# -- len, isinstance, worker_init_fn, spawn, pin_memory ----------------------------------------


@pytest.mark.parametrize(
    "dataset_fn,kwargs",
    [
        (lambda: RichDataset(23), dict(batch_size=7)),
        (lambda: RichDataset(23), dict(batch_size=7, drop_last=True)),
        (lambda: RichDataset(23), dict(batch_size=None)),
        (lambda: RichDataset(23), dict(batch_size=1, shuffle=True)),
        (lambda: RangeIterable(23, length=True), dict(batch_size=7)),
        (lambda: RangeIterable(23, length=True), dict(batch_size=7, drop_last=True)),
    ],
    ids=["bs7", "bs7-drop", "none", "shuffle", "iterable", "iterable-drop"],
)
@pytest.mark.parametrize("workers", WORKER_CONFIGS)
def test_len_matches_stock(dataset_fn, kwargs, workers):
    stock = tud.DataLoader(dataset_fn(), **kwargs)
    ours = gpufeed.DataLoader(dataset_fn(), **kwargs, **workers)
    assert len(ours) == len(stock)
    it = iter(ours)
    if isinstance(stock.dataset, tud.IterableDataset):
        with pytest.raises(TypeError):  # stock: _InfiniteConstantSampler has no len()
            len(it)
    else:
        assert len(it) == len(stock)
    it.close()


def test_len_of_iterable_without_len_raises_like_stock():
    with pytest.raises(TypeError) as stock:
        len(tud.DataLoader(NoLenIterable()))
    with pytest.raises(TypeError) as ours:
        len(gpufeed.DataLoader(NoLenIterable()))
    assert str(ours.value) == str(stock.value)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_iterable_length_warning_like_stock(num_workers):
    """torch's words exactly (tools and warning filters match them), pointing at the loop."""
    said = []
    for cls in (tud.DataLoader, gpufeed.DataLoader):
        data = ShortLenIterable(RangeIterable(12, rich=False))
        loader = cls(data, batch_size=None, num_workers=num_workers)
        assert len(loader) == 10
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            list(loader)  # the loop's line
        seen = [w for w in caught if "was reported to be 10" in str(w.message)]
        assert seen and all(w.filename == __file__ for w in seen)
        said.append([str(w.message).replace(repr(data), "DATA") for w in seen])
    assert said[1] == said[0]


def test_a_persistent_iterator_warns_of_a_length_asked_after_its_first_epoch():
    """``len(loader)`` first asked between epochs: the kept iterator's next epoch warns as a
    new one would (torch's ``_reset`` takes the length again)."""
    counts = []
    for cls in (tud.DataLoader, gpufeed.DataLoader):
        loader = cls(ShortLenIterable(RangeIterable(12, rich=False)), batch_size=None,
                     num_workers=1, persistent_workers=True)
        list(loader)
        assert len(loader) == 10
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            list(loader)
        counts.append(sum("was reported to be 10" in str(w.message) for w in caught))
    assert counts[1] == counts[0] == 2


class ShortLenIterable(tud.IterableDataset):
    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return 10


def test_is_a_torch_dataloader():
    loader = gpufeed.DataLoader(RichDataset(4), batch_size=2, worker_type="thread")
    assert isinstance(loader, tud.DataLoader)
    assert loader.batch_size == 2 and loader.num_workers == 0
    assert loader.dataset.n == 4


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_init_fn_called_once_per_worker(tmp_path, worker_type, persistent):
    loader = gpufeed.DataLoader(
        RichDataset(12), batch_size=2, num_workers=2, worker_type=worker_type,
        worker_init_fn=functools.partial(record_init, str(tmp_path)),
        persistent_workers=persistent,
    )
    for _ in range(2):
        assert len(list(loader)) == 6
    del loader
    gc.collect()
    per_epoch = 1 if persistent else 2
    assert init_calls(tmp_path) == {0: per_epoch, 1: per_epoch}


@pytest.mark.slow
def test_spawn_context_matches_stock(tmp_path):
    """Datasets and worker_init_fn come from support/fakes.py, importable in a spawned child."""
    kwargs = dict(batch_size=3, shuffle=True, num_workers=1)
    expected = collect(tud.DataLoader, RichDataset(10), **kwargs)[0]
    got = collect(
        gpufeed.DataLoader, RichDataset(10), multiprocessing_context="spawn",
        worker_init_fn=functools.partial(record_init, str(tmp_path)), **kwargs,
    )[0]
    assert_same_batches(expected, got)
    assert init_calls(tmp_path) == {0: 1}


class _ReadOnlyMap(collections.abc.Mapping):
    """A Mapping that is not mutable: the default collate rebuilds it from a dict."""

    def __init__(self, items):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


class _Record(collections.abc.Sequence):
    """An immutable Sequence that keeps what it is given: rebuilt from a list, it must not get
    a generator."""

    def __init__(self, values):
        self.values = values

    def __getitem__(self, i):
        return self.values[i]

    def __len__(self):
        return len(self.values)


class _AbcContainers(tud.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return _ReadOnlyMap({"x": torch.full((2,), i), "rec": _Record([torch.tensor(i), i])})


@pytest.mark.parametrize("batch_size", [2, None])
@pytest.mark.parametrize("workers", WORKER_CONFIGS)
def test_abstract_mapping_and_sequence_subclasses_keep_their_type_like_stock(workers,
                                                                              batch_size):
    expected = list(tud.DataLoader(_AbcContainers(), batch_size=batch_size))
    got = list(gpufeed.DataLoader(_AbcContainers(), batch_size=batch_size, **workers))
    assert_same_batches(expected, got)
    assert all(type(b["rec"].values) is list for b in got)


@dataclasses.dataclass
class _Counted:
    x: torch.Tensor
    inits: int = 0
    mask: torch.Tensor | None = dataclasses.field(default=None, init=False)

    def __post_init__(self):
        self.inits += 1


@dataclasses.dataclass(init=False)
class _OwnInit:
    x: torch.Tensor

    def __init__(self, samples):
        self.x = torch.stack(samples)


def _collate_objects(samples):
    """What custom collate functions return: dataclasses (one with a field set after init,
    one with its own __init__), a masked array, a tensor that requires grad, a range."""
    x = torch.stack([torch.as_tensor(s, dtype=torch.float32) for s in samples])
    counted = _Counted(x)
    counted.mask = x > 1
    masked = np.ma.masked_array(x.numpy().copy(), mask=x.numpy() > 1)
    return counted, _OwnInit([torch.tensor([s]) for s in samples]), masked, \
        x.clone().requires_grad_(), range(len(samples))


@pytest.mark.parametrize("workers", WORKER_CONFIGS)
def test_objects_a_collate_fn_returns_come_back_as_stock_returns_them(workers):
    """Rebuilt as unpickling rebuilds them: no __init__ or __post_init__ run again, fields set
    after init kept, subclasses of arrays and grad flags kept."""
    def run(loader_cls, **kw):
        return list(loader_cls(list(range(6)), batch_size=3, collate_fn=_collate_objects, **kw))

    for expected, got in zip(run(tud.DataLoader, num_workers=1), run(gpufeed.DataLoader,
                                                                     **workers), strict=True):
        (e_counted, e_own, e_masked, e_grad, e_range) = expected
        (counted, own, masked, grad, rng) = got
        assert type(counted) is _Counted and counted.inits == e_counted.inits == 1
        assert_same(e_counted.mask, counted.mask) and assert_same(e_own.x, own.x)
        assert type(masked) is np.ma.MaskedArray and masked.tolist() == e_masked.tolist()
        assert grad.requires_grad and e_grad.requires_grad and torch.equal(grad, e_grad)
        assert rng == e_range


class _ImagesAndPairs(tud.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.full((3, 32, 32), float(i)), torch.tensor([i, -i])


@pytest.mark.parametrize("workers", WORKER_CONFIGS)
def test_a_tensor_kept_from_a_batch_holds_and_saves_only_its_own_bytes(workers):
    """Keeping (and torch.save-ing) the labels of every batch takes what stock's take, not
    the batch's whole slot of memory."""
    def labels(loader_cls, **kw):
        return [y for _, y in loader_cls(_ImagesAndPairs(), batch_size=4, **kw)]

    expected, got = labels(tud.DataLoader, num_workers=1), labels(gpufeed.DataLoader, **workers)
    assert_same_batches(expected, got)
    for y in got:
        assert y.untyped_storage().nbytes() == y.numel() * y.element_size()
    saved = io.BytesIO()
    torch.save(got, saved)
    stock_saved = io.BytesIO()
    torch.save(expected, stock_saved)
    assert len(saved.getvalue()) <= len(stock_saved.getvalue()) + 1024


class _Unpicklable(tud.Dataset):
    def __init__(self):
        self.transform = lambda x: x  # spawn cannot pickle it

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.transform(i)


def test_spawn_with_an_unpicklable_dataset_warns_and_raises_like_stock():
    """The worker's start fails as stock's does: the same error, after torch's own warning
    (which names the fix), and nothing is left behind."""
    seen = {}
    for name, loader_cls in (("stock", tud.DataLoader), ("gpufeed", gpufeed.DataLoader)):
        # stock's run first: spawn's resource tracker, which outlives both, starts there
        with warnings.catch_warnings(record=True) as caught, \
                (no_leaks() if name == "gpufeed" else contextlib.nullcontext()):
            warnings.simplefilter("always")
            with pytest.raises(AttributeError) as error:
                list(loader_cls(_Unpicklable(), batch_size=2, num_workers=1,
                                multiprocessing_context="spawn"))
        seen[name] = (str(error.value), [str(w.message) for w in caught
                                         if "pickle error" in str(w.message)])
    assert seen["gpufeed"] == seen["stock"] and len(seen["stock"][1]) == 1


# Python 3.12+ warns of a fork while the process has other threads, as the kernel counts them
# (torch's intra-op threads after a parallel op; in a whole run, tqdm's monitor thread that an
# earlier test's Hugging Face datasets started): the fork is this test's gpufeed side's, the
# stock side here has no workers
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("workers", WORKER_CONFIGS)
def test_pin_memory_without_accelerator_warns_like_stock(workers):
    if torch.accelerator.is_available():
        batches = list(gpufeed.DataLoader(RichDataset(6), batch_size=3, pin_memory=True,
                                          **workers))
        assert batches[0]["x"].is_pinned()
        return
    with pytest.warns(UserWarning, match="pin_memory"):
        expected = list(tud.DataLoader(RichDataset(6), batch_size=3, pin_memory=True))
    with pytest.warns(UserWarning, match="pin_memory"):
        got = list(gpufeed.DataLoader(RichDataset(6), batch_size=3, pin_memory=True,
                                      **workers))
    assert_same_batches(expected, got)


def too_many_workers_warnings(make, epochs=2):
    """The "suggested max number of worker" warnings of building ``make()`` and iterating it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every call shows, not once per place
        loader = make()
        for _ in range(epochs):
            list(loader)
    return loader, [str(w.message) for w in caught
                    if "suggested max number of worker" in str(w.message)]


def test_too_many_workers_warns_once_per_loader_in_stocks_words(worker_type):
    """Stock warns when built and again at every iter(); gpufeed once per loader, with
    stock's words for process workers (tools match on them) and "worker threads" for
    threads. Changing num_workers warns again."""
    n = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()) + 1
    ds = tud.TensorDataset(torch.arange(8.0))
    _, stock = too_many_workers_warnings(lambda: tud.DataLoader(ds, batch_size=4, num_workers=n))
    assert len(stock) == 3 and len(set(stock)) == 1, stock
    loader, ours = too_many_workers_warnings(lambda: gpufeed.DataLoader(
        ds, batch_size=4, num_workers=n, worker_type=worker_type))
    words = stock[0] if worker_type == "process" else stock[0].replace(
        f"{n} worker processes", f"{n} worker threads")
    assert ours == [words]
    loader.num_workers = n + 1
    _, again = too_many_workers_warnings(lambda: loader)
    assert len(again) == 1 and f"create {n + 1} worker" in again[0]


def test_getitems_used_like_stock():
    """Stock calls __getitems__ with each batch: the values match, call ids aside."""
    expected = collect(tud.DataLoader, GetitemsDataset(23), batch_size=5)[0]
    got = collect(gpufeed.DataLoader, GetitemsDataset(23), batch_size=5, num_workers=2)[0]
    assert_same([b[:2] for b in expected], [b[:2] for b in got])


# -- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,exc,needle",
    [
        (dict(worker_type="gpu"), ValueError, "'gpu'"),
        (dict(worker_type=None), TypeError, "None"),  # a wrong type: TypeError
        (dict(ring_bytes=-1), ValueError, "-1"),
        (dict(ring_bytes="1GB"), TypeError, "'1GB'"),
        (dict(ring_bytes=1.5), TypeError, "1.5"),
        (dict(device_depth=0), ValueError, "device_depth=0"),
        (dict(device_depth=-3), ValueError, "-3"),
        (dict(multiprocessing_context="spawn", worker_type="thread", num_workers=2),
         ValueError, "multiprocessing_context"),
        (dict(device_transform=lambda b: b), ValueError, "device"),
    ],
    ids=["worker_type", "worker_type_none", "ring_neg", "ring_str", "ring_float", "depth0",
         "depth_neg", "mp_context_thread", "transform_without_device"],
)
def test_bad_arguments_name_the_value(kwargs, exc, needle):
    with pytest.raises(exc) as info:
        gpufeed.DataLoader(RichDataset(4), **kwargs)
    assert needle in str(info.value)


def test_huge_ring_bytes_works_or_is_rejected_clearly(worker_type, small_dataset):
    unraisable: list[str] = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: unraisable.append(f"{u.object!r}: {u.exc_value!r}")
    message = ""
    n_batches = None
    try:
        with no_leaks():
            try:
                batches = list_or_stop(gpufeed.DataLoader(small_dataset, batch_size=4,
                                                          num_workers=2, worker_type=worker_type,
                                                          ring_bytes=1 << 47))
                n_batches = len(batches)
                del batches  # the user's batches hold their memory (the first ones fall back)
            except Exception as e:  # rejecting is fine, if it says what to change
                message = f"{type(e).__name__}: {e}"
            gc.collect()  # the traceback is gone: whatever was half-built is collected here
    finally:
        sys.unraisablehook = old_hook
    assert unraisable == [], unraisable
    if n_batches is None:
        assert "ring_bytes" in message, message
    else:
        assert n_batches == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_workers=-1),
        dict(batch_sampler=[[0]], batch_size=2),
        dict(sampler=[0, 1], shuffle=True),
        dict(prefetch_factor=2),
        dict(persistent_workers=True),
        dict(batch_size=None, drop_last=True),
        dict(timeout=-1),
    ],
    ids=["neg_workers", "batch_sampler_and_size", "sampler_and_shuffle", "prefetch_no_workers",
         "persistent_no_workers", "none_drop_last", "neg_timeout"],
)
def test_stock_argument_errors_unchanged(kwargs):
    with pytest.raises(Exception) as stock:
        tud.DataLoader(RichDataset(4), **kwargs)
    with pytest.raises(Exception) as ours:
        gpufeed.DataLoader(RichDataset(4), **kwargs)
    assert type(ours.value) is type(stock.value)
    assert str(ours.value) == str(stock.value)


def test_shuffle_on_iterable_rejected_like_stock():
    with pytest.raises(ValueError) as stock:
        tud.DataLoader(RangeIterable(4), shuffle=True)
    with pytest.raises(ValueError) as ours:
        gpufeed.DataLoader(RangeIterable(4), shuffle=True)
    assert str(ours.value) == str(stock.value)


def test_process_workers_without_poll_are_refused_clearly(monkeypatch):
    """Windows has no select.poll: the error names the platform and the way out."""
    monkeypatch.delattr("select.poll")
    with pytest.raises(ValueError) as info:
        gpufeed.DataLoader(RichDataset(4), batch_size=2, num_workers=2)
    assert "worker_type='thread'" in str(info.value)
    loader = gpufeed.DataLoader(RichDataset(4), batch_size=2, num_workers=2, worker_type="thread")
    assert len(list(loader)) == 2
    assert len(list(gpufeed.DataLoader(RichDataset(4), batch_size=2))) == 2


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # stock's __del__
@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (1.5, TypeError),
                                              (2.0, TypeError), ("2", TypeError)])
def test_prefetch_factor_stock_rejects_is_rejected_at_once(value, error):
    """Stock takes these at construction and fails at ``iter()``; gpufeed raises at once,
    naming the value (not silently 2): stock's TypeError for a value that is no int, a
    ValueError for 0 (stock asserts; tests/host/test_arguments.py)."""
    with pytest.raises((AssertionError, TypeError)):  # stock fails at iter()
        list(tud.DataLoader(RichDataset(4), num_workers=1, prefetch_factor=value))
    with pytest.raises(error) as info:
        gpufeed.DataLoader(RichDataset(4), num_workers=1, prefetch_factor=value)
    assert "prefetch_factor" in str(info.value) and f"got {value!r}" in str(info.value)


@pytest.mark.parametrize("value", [1, True, np.int64(3)])
def test_prefetch_factor_stock_takes_is_taken(value):
    expected = list(tud.DataLoader(RichDataset(6), batch_size=2, num_workers=1,
                                   prefetch_factor=value))
    got = list(gpufeed.DataLoader(RichDataset(6), batch_size=2, num_workers=1,
                                  prefetch_factor=value))
    assert_same(expected, got)


def test_subscripts_like_the_stock_class():
    """``DataLoader[T]`` for annotations and generics, as with torch's class."""
    alias = gpufeed.DataLoader[int]
    assert typing.get_origin(alias) is gpufeed.DataLoader
    assert typing.get_args(alias) == typing.get_args(tud.DataLoader[int]) == (int,)

    class Mine(gpufeed.DataLoader[torch.Tensor]):
        pass

    assert len(list(Mine(RichDataset(4), batch_size=2))) == 2


class SlowCountingDataset(tud.Dataset):
    """Sleeps ``seconds`` per sample and counts fetches across thread and forked workers."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds
        self.count = multiprocessing.get_context("fork").Value("i", 0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.seconds)
        with self.count.get_lock():
            self.count.value += 1
        return i


def test_restarting_a_persistent_iterator_drops_the_abandoned_work_ahead(worker_type):
    """Batches dispatched ahead for an epoch abandoned by ``iter(loader)`` are not fetched:
    workers drop them, so the new epoch does not wait for them."""
    # 0.1 s a sample: a stall of the main thread around the restart (a GC pass, CPU steal)
    # stays well inside one sample, so the count below does not depend on it
    # 24 samples: more than the 18 the abandoned epoch has dispatched by the restart
    ds = SlowCountingDataset(24, seconds=0.1)
    loader = gpufeed.DataLoader(ds, batch_size=1, num_workers=2, prefetch_factor=8,
                                persistent_workers=True, worker_type=worker_type)
    it = iter(loader)
    assert [int(next(it)), int(next(it))] == [0, 1]  # 16 more batches are dispatched now
    time.sleep(0.15)  # workers are inside the abandoned epoch's tasks
    at_restart = ds.count.value
    assert [int(b) for b in iter(loader)] == list(range(24))
    after_restart = ds.count.value - 24 - at_restart
    # each worker may finish the sample it was fetching (and one more, racing the restart
    # message); finishing the work-ahead would take ~18 - at_restart more
    assert after_restart <= 2 * 2, (
        f"{after_restart} samples fetched for the abandoned epoch after the restart "
        f"({at_restart} before it)"
    )
