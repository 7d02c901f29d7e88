"""A dataset seen drawing from a global generator in thread workers is named once per loader,
with the fix; nothing is said for the per-sample generators, process workers, or the training
loop's own draws (``_host/random_watch.py``)."""

from __future__ import annotations

import random
import time
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

import gpufeed
from gpufeed._host.random_watch import fingerprint
from gpufeed._order.sample_rng import SampleScope

DRAWS = {
    "torch": lambda: torch.rand(1).item(),
    "numpy": lambda: float(np.random.rand()),
    "random": random.random,
    "sample_generator": lambda: torch.rand(1, generator=gpufeed.random.sample_generator()).item(),
}


class _Draws(Dataset):
    """10 ms a sample (so the loop mostly waits), then one draw from ``DRAWS[how]``."""

    def __init__(self, how: str, n: int = 24) -> None:
        self.how, self.n = how, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.01)
        return torch.tensor([i, DRAWS[self.how]()])


def _said(loader: gpufeed.DataLoader, epochs: int = 2, loop_draws: bool = False) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(epochs):
            for _batch in loader:
                if loop_draws:  # a training loop that draws from every global generator
                    for draw in list(DRAWS.values())[:3]:
                        draw()
    return [str(w.message) for w in caught
            if issubclass(w.category, gpufeed.random.RandomStateWarning)]


@pytest.mark.parametrize("how,name", [("torch", "torch's"), ("numpy", "numpy's"),
                                      ("random", "Python's random")])
def test_global_draws_in_thread_workers_are_named_once(how, name):
    loader = gpufeed.DataLoader(_Draws(how), batch_size=2, num_workers=2, worker_type="thread")
    said = _said(loader)
    assert len(said) == 1, said
    assert f"drew from {name} global random generator" in said[0]
    assert "gpufeed.random.sample_generator()" in said[0] and "worker_type='process'" in said[0]


@pytest.mark.parametrize("how,kind", [("sample_generator", "thread"), ("torch", "process")])
def test_nothing_is_said_where_draws_are_reproducible(how, kind):
    """The per-sample generators under threads, whatever the loop draws; global draws in
    process workers, which own their generators."""
    loader = gpufeed.DataLoader(_Draws(how), batch_size=2, num_workers=2, worker_type=kind,
                                seed=0)
    assert _said(loader, loop_draws=True) == []


def test_the_fingerprint_sees_each_generator():
    before = fingerprint()
    assert fingerprint() == before
    for draw in list(DRAWS.values())[:3]:
        draw()
        after = fingerprint()
        assert sum(a != b for a, b in zip(before, after, strict=True)) == 1
        before = after
    scope = SampleScope()  # as in a fetch: the per-sample generators leave them alone
    scope.open(base=1, epoch=0)
    try:
        torch.rand(1, generator=gpufeed.random.sample_generator())
        gpufeed.random.sample_rng().random()
        gpufeed.random.sample_random().random()
    finally:
        scope.close()
    assert fingerprint() == before
