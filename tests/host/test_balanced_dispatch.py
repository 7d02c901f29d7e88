"""NOTE [ Balanced dispatch ] in ``_host/workahead.py``: thread workers on a map-style dataset
take batches one by one, each to the worker holding the fewest; everything else keeps the
turn, in windows of a chunk per worker."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch
from torch.utils.data import Dataset

import gpufeed
from gpufeed._host.workahead import WorkAhead
from gpufeed._host.worker_iter import WorkerIter


def _ahead(balanced: bool) -> WorkAhead:
    return WorkAhead(num_workers=2, prefetch_factor=None, adaptive=True, device_depth=None,
                     pin=False, balanced=balanced)


def test_a_balanced_pool_refills_one_batch_at_a_time():
    turn, balanced = _ahead(False), _ahead(True)
    assert turn.in_flight_bound == balanced.in_flight_bound == 4
    # The turn waits for a window of one batch per worker; balanced, one batch fits.
    assert turn.refill_at == 2 and turn.window(False, 3) == 0
    assert balanced.refill_at == 3 and balanced.window(False, 3) == 1
    # An epoch's first window is one batch per worker either way.
    assert balanced.window(True, 0) == 2
    # Cheap batches, chunked: windows of a chunk per worker again.
    for _ in range(50):
        balanced.adapt(0.002, 4096)
    assert balanced.chunk > 1 and balanced.share == balanced.chunk * 2
    assert balanced.refill_at == balanced.in_flight_bound - balanced.share


def test_a_batch_goes_to_the_worker_holding_fewest_the_turns_first_among_equals():
    it = SimpleNamespace(_num_workers=3, _active=[True, True, True], _tasks={})
    assert WorkerIter._least_held(it, 1) == 1
    it._tasks = {10: 0, 11: 1, 12: 1, 13: 2}
    assert WorkerIter._least_held(it, 1) in (0, 2) and WorkerIter._least_held(it, 2) == 2
    # Inactive workers and retiring ones (ids past the count) take nothing.
    it._active = [False, True, True]
    it._tasks = {10: 1, 11: 2, 12: 3, 13: 3}
    assert WorkerIter._least_held(it, 1) == 1


class _Stalls(Dataset):
    """Index 3 takes long in whichever worker fetches it; the rest take 35 ms, more than a
    message's worth (CHUNK_TARGET_S): one batch per message."""

    def __init__(self) -> None:
        self.fetched_by: dict[int, str] = {}

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        self.fetched_by[i] = threading.current_thread().name
        time.sleep(0.6 if i == 3 else 0.035)
        return torch.tensor([i])


def test_while_one_thread_worker_stalls_the_other_takes_the_new_batches():
    data = _Stalls()
    loader = gpufeed.DataLoader(data, batch_size=1, num_workers=2, worker_type="thread",
                                persistent_workers=True)
    it = iter(loader)
    assert it._work_ahead.balanced
    got = [int(b) for b in it]
    assert got == list(range(24))  # in order, each once
    stalled = data.fetched_by[3]
    # Dealt in turn, the stalled worker would hold batches 5 and 7 behind batch 3; balanced,
    # it holds one at most (dealt while both held one), the other worker takes the rest.
    assert sum(data.fetched_by[i] == stalled for i in range(4, 8)) <= 1
    process = gpufeed.DataLoader(data, batch_size=1, num_workers=2)
    assert not iter(process)._work_ahead.balanced
