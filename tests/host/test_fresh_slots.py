"""NOTE [ Fresh slots ] in ``_host/workahead.py``: cheap batches travel in chunks of at most
``CHUNK_MAX`` batches, which bounds the ring's slots (each faulted in on a new ring's first
epoch, every epoch of a loader without persistent workers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed._host.workahead import CHUNK_MAX, WorkAhead

FAULTED_IN_BEFORE = 2 * 64 * 2 + 2  # two workers' slots of 64-batch chunks, the old cap


def test_cheap_batches_chunk_at_the_cap_and_costly_ones_by_their_time():
    ahead = WorkAhead(num_workers=2, prefetch_factor=None, adaptive=True, device_depth=None,
                      pin=False)
    assert ahead.adapt(1e-6, 4096)  # the time target alone would allow thousands
    assert ahead.chunk == CHUNK_MAX <= 32
    assert ahead.slots_hint == 2 * CHUNK_MAX * 2 + ahead.held < FAULTED_IN_BEFORE
    for _ in range(50):  # 10 ms a batch: 3 per message (the moving average settles)
        ahead.adapt(0.01, 4096)
    assert ahead.chunk == 3 and ahead.in_flight_bound == 2 * 3 * 2


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_a_loaders_ring_of_cheap_batches_holds_its_chunks_slots_and_no_more(worker_type):
    """Two epochs of cheap batches, a persistent loader: every batch arrives, once, in order,
    and the ring carves only the slots of its chunks in flight and the loop's."""
    rows = np.arange(8_000 * 4, dtype=np.float32).reshape(8_000, 4)
    loader = gpufeed.DataLoader(gpufeed.sources.ArrayDataset(rows), batch_size=4, num_workers=2,
                                worker_type=worker_type, persistent_workers=True)
    it = iter(loader)
    first = torch.cat([b[0] for b in it])
    second = torch.cat([b[0] for b in loader])
    expected = torch.from_numpy(rows)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert it._work_ahead.chunk > 1  # chunked (at the cap, 32, unless the machine crawls)
    grows = it.ring_info()["grows"]
    assert grows <= 2 * CHUNK_MAX * 2 + it._work_ahead.held < FAULTED_IN_BEFORE, grows
    it.close()
