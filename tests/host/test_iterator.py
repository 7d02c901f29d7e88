"""The iterators' own bookkeeping (``_host/iterator.py``): what ``loader.stats()`` is fed."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset

import gpufeed


class SlowFetch(Dataset):
    """A batch of 8 takes ~1 ms to fetch."""

    def __len__(self) -> int:
        return 8 * 24

    def __getitem__(self, i: int) -> torch.Tensor:
        if i % 8 == 0:
            time.sleep(0.001)
        return torch.full((16,), float(i))


def test_without_workers_the_fetch_is_waiting_not_stepping():
    """num_workers=0: the loop waits while the main thread fetches, so stats() counts the
    fetch as "wait" (input-bound), not as the user's "step" (it did before the timeline)."""
    loader = gpufeed.DataLoader(SlowFetch(), batch_size=8, num_workers=0)
    for _ in loader:
        pass  # a step of ~0 s; each fetch takes ~1 ms
    stages = loader.stats().stages
    assert stages["step"].busy_s < 0.5 * stages["fetch"].busy_s
    waited = stages["wait"].blocked_s + stages["startup"].blocked_s  # the first: start-up
    assert waited >= stages["fetch"].busy_s + stages["collate"].busy_s
    assert loader.stats().input_bound > 0.5
