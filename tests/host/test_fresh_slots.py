"""NOTE [ Fresh slots ] in ``_host/workahead.py``: a new ring's cheap batches travel in shorter
chunks, so that fewer slots are faulted in; a warm ring takes the longer ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed._host.workahead import CHUNK_MAX, FRESH_CHUNK_MAX, WorkAhead


def _ahead() -> WorkAhead:
    return WorkAhead(num_workers=2, prefetch_factor=None, adaptive=True, device_depth=None,
                     pin=False)


def test_a_fresh_rings_chunk_is_capped_until_the_ring_is_warm():
    ahead = _ahead()
    ahead.adapt(1e-6, 4096)  # cheap batches: the time target alone would allow thousands
    assert ahead.chunk == FRESH_CHUNK_MAX
    assert ahead.slots_hint == 2 * FRESH_CHUNK_MAX * 2 + ahead.held
    ahead.ring_warmth(True)
    assert ahead.adapt(1e-6, 4096)  # the bound (and the ring's hint) changed
    assert ahead.chunk == CHUNK_MAX and ahead.in_flight_bound == 2 * CHUNK_MAX * 2
    ahead.ring_warmth(False)
    ahead.adapt(1e-6, 4096)
    assert ahead.chunk == FRESH_CHUNK_MAX


def test_costly_batches_keep_their_chunk_whatever_the_ring():
    ahead = _ahead()
    ahead.adapt(0.01, 4096)  # 10 ms a batch: 3 per message, under either cap
    fresh = ahead.chunk
    ahead.ring_warmth(True)
    ahead.adapt(0.01, 4096)
    assert fresh == ahead.chunk == 3


def _cheap_loader(worker_type: str, persistent: bool) -> gpufeed.DataLoader:
    rows = np.arange(8_000 * 4, dtype=np.float32).reshape(8_000, 4)
    return gpufeed.DataLoader(gpufeed.ArrayDataset(rows), batch_size=4, num_workers=2,
                              worker_type=worker_type, persistent_workers=persistent)


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_a_new_loaders_ring_holds_fresh_chunks_and_a_persistent_one_grows_once_warm(
        worker_type):
    """A loader's first epoch of cheap batches carves at most the slots of fresh chunks (half
    what 64-batch chunks take); a persistent loader's next epoch, its ring warm, may use
    longer chunks. Every batch arrives, once, in order, either way."""
    loader = _cheap_loader(worker_type, persistent=True)
    it = iter(loader)
    first = torch.cat([b[0] for b in it])
    held = it._work_ahead.held
    grows = it.ring_info()["grows"]
    assert grows <= 2 * (CHUNK_MAX // 2) * 2 + held, f"{grows} slots for a fresh ring"
    second = torch.cat([b[0] for b in loader])
    assert it._work_ahead.chunk_max == CHUNK_MAX
    assert it._work_ahead.chunk > FRESH_CHUNK_MAX  # cheap batches: the warm cap is reached
    expected = torch.arange(8_000 * 4, dtype=torch.float32).reshape(8_000, 4)
    assert torch.equal(first, expected) and torch.equal(second, expected)
    it.close()
