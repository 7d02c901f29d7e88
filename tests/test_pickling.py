"""Pickling and ``copy.deepcopy`` of loaders (ddp_spawn, frameworks that copy modules holding
loaders), compared with torch's DataLoader."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.utils.data as tud

import gpufeed

DATA = tud.TensorDataset(torch.arange(40).float().reshape(20, 2), torch.arange(20))

KINDS = [
    dict(num_workers=0),
    dict(num_workers=2),
    dict(num_workers=2, worker_type="thread"),
    dict(num_workers=2, persistent_workers=True),
]


def _batches(loader, seed=None):
    if seed is not None:
        torch.manual_seed(seed)  # stock shuffles draw from the global generator
    return [[t.tolist() for t in batch] for batch in loader]


def _copies(loader):
    return [pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_unstarted_loader_copies_iterate_to_the_same_batches(kind):
    stock = tud.DataLoader(DATA, batch_size=3, shuffle=True, **{
        k: v for k, v in kind.items() if k != "worker_type"})
    want = _batches(stock, seed=0)
    # as stock users write it: shuffle=True, no seed=
    loader = gpufeed.DataLoader(DATA, batch_size=3, shuffle=True, **kind)
    for copied in _copies(loader):
        assert type(copied) is gpufeed.DataLoader and copied.worker_type == loader.worker_type
        assert _batches(copied, seed=0) == want
    assert _batches(loader, seed=0) == want
    seeded = gpufeed.DataLoader(DATA, batch_size=3, shuffle=True, seed=5, **kind)
    for copied in _copies(seeded):
        assert _batches(copied) == _batches(gpufeed.DataLoader(
            DATA, batch_size=3, shuffle=True, seed=5, **kind))


def test_started_loader_behaves_like_stock():
    """A loader without persistent workers keeps no iterator: it pickles mid-epoch, and the
    copy starts a new epoch (with the state of epochs and stats so far). With persistent
    workers running, torch and gpufeed both refuse."""
    stock = tud.DataLoader(DATA, batch_size=4, num_workers=2)
    next(iter(stock))
    pickle.dumps(stock)
    loader = gpufeed.DataLoader(DATA, batch_size=4, shuffle=True, seed=3, num_workers=2)
    list(loader)  # epoch 0
    it = iter(loader)  # epoch 1 in progress
    next(it)
    for copied in _copies(loader):
        assert copied.stats().counters["batches"] == 6
        reference = gpufeed.DataLoader(DATA, batch_size=4, shuffle=True, seed=3)
        reference.set_epoch(2)
        assert _batches(copied) == _batches(reference)
        assert copied.state_dict()["epoch"] == 3 and copied.state_dict()["batches_delivered"] == 0
    del it

    for cls in (tud.DataLoader, gpufeed.DataLoader):
        persistent = cls(DATA, batch_size=4, num_workers=1, persistent_workers=True)
        it = iter(persistent)
        next(it)
        with pytest.raises(NotImplementedError):
            pickle.dumps(persistent)
        with pytest.raises(NotImplementedError):
            copy.deepcopy(persistent)
        del it


def test_module_holding_a_loader_deep_copies():
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.loader = gpufeed.DataLoader(DATA, batch_size=5, num_workers=1, seed=1,
                                             shuffle=True, worker_type="thread")

    holder = Holder()
    twin = copy.deepcopy(holder)
    assert twin.loader is not holder.loader and twin.loader.dataset is not holder.loader.dataset
    assert _batches(twin.loader) == _batches(holder.loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterator_refuses_copies_as_stocks_does_and_keeps_its_epoch(num_workers):
    """``copy.copy`` of a running iterator: torch's refuses; a copy sharing the workers would
    stop them when it is deleted and end the original's epoch early, silently."""
    loader = gpufeed.DataLoader(list(range(10)), batch_size=2, num_workers=num_workers)
    it = iter(loader)
    assert next(it).tolist() == [0, 1]
    for how in (copy.copy, pickle.dumps):
        with pytest.raises(NotImplementedError, match="cannot be pickled"):
            how(it)
    assert [b.tolist() for b in it] == [[2, 3], [4, 5], [6, 7], [8, 9]]


def test_a_loader_with_running_persistent_workers_copies_shallowly_as_stocks_does():
    loader = gpufeed.DataLoader(list(range(6)), batch_size=2, num_workers=1,
                                persistent_workers=True)
    first = [b.tolist() for b in loader]
    shallow = copy.copy(loader)
    assert shallow._iterator is loader._iterator  # as torch's copy.copy shares it
    assert [b.tolist() for b in shallow] == first
    with pytest.raises(NotImplementedError, match="persistent_workers=True cannot be pickled"):
        copy.deepcopy(loader)


def test_a_negative_worker_count_set_later_is_refused_in_stocks_words():
    loader = gpufeed.DataLoader(list(range(6)), batch_size=2)
    with pytest.raises(ValueError, match="num_workers option should be non-negative"):
        loader.num_workers = -1
    loader.num_workers = 1
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]
