"""The slot ring: kept batches are never overwritten; growth, budget, fallback, recycling.

``it.ring_info()`` reports slot_bytes, live_bytes, in_use, grows, fallbacks and budget.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.utils.data as tud

import gpufeed
from helpers import (
    BlockDataset,
    EmptyLaterDataset,
    GrowingDataset,
    RichDataset,
    SleepDataset,
    VarLenDataset,
    assert_same,
    assert_same_batches,
    drain,
    pad_collate,
)

WORKER_TYPES = ["process", "thread"]
RING_KEYS = {"slot_bytes", "live_bytes", "in_use", "grows", "fallbacks", "budget"}


def _loader(dataset, worker_type, **kwargs):
    kwargs.setdefault("num_workers", 2)
    return gpufeed.DataLoader(dataset, worker_type=worker_type, **kwargs)


def _epoch(loader):
    """(batches, ring_info) of one epoch, every batch kept."""
    it = iter(loader)
    try:
        batches = list(it)
    except BaseException:
        it.close()
        raise
    return batches, it.ring_info()


def _clone(batch):
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {k: _clone(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_clone(v) for v in batch)
    return batch


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_kept_batches_are_never_overwritten(worker_type):
    """list(loader) keeps every batch: each one still equals stock's at the end."""
    expected = list(tud.DataLoader(BlockDataset(64), batch_size=4, shuffle=False))
    batches, info = _epoch(_loader(BlockDataset(64), worker_type, batch_size=4))
    assert set(info) == RING_KEYS
    assert info["grows"] > 0, f"the ring was never used: {info}"
    assert_same_batches(expected, batches)


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_batches_kept_across_persistent_epochs(worker_type):
    """Epoch 2 reuses the same ring: epoch 1's kept batches must stay intact."""
    loader = _loader(BlockDataset(48), worker_type, batch_size=4, persistent_workers=True)
    first = list(loader)
    snapshot = [_clone(b) for b in first]
    second = list(loader)
    third = list(loader)
    assert_same_batches(snapshot, first)
    assert_same_batches(snapshot, second)
    assert_same_batches(snapshot, third)
    del loader
    gc.collect()


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_kept_views_and_leaves_keep_their_slot(worker_type):
    """Keeping only a slice, a reshaped view or the numpy view of a leaf keeps its bytes."""
    kept = []
    for b in _loader(BlockDataset(200, 64), worker_type, batch_size=4):
        pick = len(kept) % 3
        if pick == 0:
            kept.append(("slice", b["x"][1:3]))
        elif pick == 1:
            kept.append(("view", b["x"].view(-1)[::7]))
        else:
            kept.append(("numpy", b["x"].numpy()[2]))
        del b
    for k, (how, v) in enumerate(kept):
        first = 4 * k
        if how == "slice":
            want = torch.tensor([first + 1, first + 2], dtype=torch.float32)[:, None].expand(2, 64)
            assert torch.equal(v, want), f"batch {k} ({how}) was overwritten"
        elif how == "view":
            full = torch.arange(first, first + 4, dtype=torch.float32)[:, None].expand(4, 64)
            assert torch.equal(v, full.reshape(-1)[::7]), f"batch {k} ({how}) was overwritten"
        else:
            assert (v == first + 2).all(), f"batch {k} ({how}) was overwritten"


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_ring_grows_to_budget_then_falls_back(worker_type):
    expected = list(tud.DataLoader(BlockDataset(64), batch_size=4))
    # a slot for one batch (4 x 256 float32 + 4 int64) is 1-2 pages: room for a few slots
    budget = 5 * 8192
    batches, info = _epoch(_loader(BlockDataset(64), worker_type, batch_size=4,
                                   ring_bytes=budget))
    assert_same_batches(expected, batches)
    assert info["budget"] == budget
    assert info["grows"] > 0 and info["grows"] * info["slot_bytes"] <= budget, info
    assert info["live_bytes"] <= budget, info
    assert info["fallbacks"] > 0, f"16 kept batches cannot all fit in {budget} bytes: {info}"


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_default_budget_is_bounded_and_falls_back(worker_type):
    """Keeping 600 batches: the default budget stops growth, the rest falls back intact."""
    expected = list(tud.DataLoader(BlockDataset(2400, 16), batch_size=4))
    batches, info = _epoch(_loader(BlockDataset(2400, 16), worker_type, batch_size=4))
    assert_same_batches(expected, batches)
    assert info["budget"] > 0, info
    assert info["grows"] < len(batches) and info["fallbacks"] > 0, info


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_default_budget_bounds_live_bytes(worker_type):
    """400 cheap batches then 40 slow ones, all kept: the ring stays within its budget."""
    batches, info = _epoch(_loader(SleepDataset(440, slow_from=400, seconds=0.015, once=False),
                                   worker_type, batch_size=1))
    assert len(batches) == 440
    assert info["live_bytes"] <= info["budget"], info


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_ring_bytes_zero_always_falls_back(worker_type):
    expected = list(tud.DataLoader(RichDataset(23), batch_size=5))
    batches, info = _epoch(_loader(RichDataset(23), worker_type, batch_size=5, ring_bytes=0))
    assert_same_batches(expected, batches)
    assert info["grows"] == 0 and info["live_bytes"] == 0 and info["in_use"] == 0, info


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
@pytest.mark.parametrize("ring_bytes", [None, 3 * 4096])
def test_later_bigger_batches_are_not_truncated(worker_type, ring_bytes):
    """The first batch is the smallest; later ones outgrow the learnt slot."""
    ds = GrowingDataset(40, batch_size=4)
    expected = list(tud.DataLoader(ds, batch_size=4))
    batches, _ = _epoch(_loader(ds, worker_type, batch_size=4, ring_bytes=ring_bytes))
    assert_same_batches(expected, batches)
    assert batches[-1]["grow"].shape == (4, 1 + 9 * 700)


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_variable_size_batches_with_padding_not_truncated(worker_type):
    expected = list(tud.DataLoader(VarLenDataset(60), batch_size=3, collate_fn=pad_collate))
    batches, _ = _epoch(_loader(VarLenDataset(60), worker_type, batch_size=3,
                                collate_fn=pad_collate))
    assert_same_batches(expected, batches)


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_last_short_batch_not_padded_or_truncated(worker_type):
    expected = list(tud.DataLoader(BlockDataset(23, 100), batch_size=5))
    batches, _ = _epoch(_loader(BlockDataset(23, 100), worker_type, batch_size=5))
    assert batches[-1]["x"].shape == (3, 100)
    assert_same_batches(expected, batches)


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_slots_are_recycled_when_batches_are_dropped(worker_type):
    """2,000 batches, each dropped before the next: a bounded ring, never a fallback."""
    n_batches = 2000
    it = iter(_loader(BlockDataset(n_batches, 16), worker_type, batch_size=1))
    count = 0
    for b in it:
        assert b["y"].item() == count
        count += 1
        del b
    info = it.ring_info()
    assert count == n_batches
    assert info["fallbacks"] == 0, f"slots were not recycled: {info}"
    assert info["grows"] <= n_batches // 4, f"slots were not recycled: {info}"


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_slots_return_when_the_user_drops_kept_batches(worker_type):
    """Held batches pin their slots; once dropped, every slot is free again."""
    loader = _loader(BlockDataset(64), worker_type, batch_size=4, persistent_workers=True)
    it = iter(loader)
    held = list(it)
    info = it.ring_info()
    assert info["in_use"] > 0, info
    del held
    gc.collect()
    info = it.ring_info()
    assert info["in_use"] == 0, f"dropped batches still hold slots: {info}"
    for _ in range(3):
        assert sum(1 for _b in loader) == 16
    info = it.ring_info()
    assert info["in_use"] == 0 and info["fallbacks"] == 0, info
    del it, loader
    gc.collect()


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_empty_tensor_batches_after_slot_learnt(worker_type):
    expected = list(tud.DataLoader(EmptyLaterDataset(), batch_size=4))
    got = drain(_loader(EmptyLaterDataset(), worker_type, batch_size=4, num_workers=1))
    assert_same_batches(expected, got)


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_in_place_changes_by_the_user_stay_in_their_batch(worker_type):
    """A user writing into a batch must not change any other batch."""
    expected = list(tud.DataLoader(BlockDataset(40, 32), batch_size=4))
    got = []
    for b in _loader(BlockDataset(40, 32), worker_type, batch_size=4):
        got.append(b)
        b["x"].mul_(0).add_(-1)
    for k, b in enumerate(got):
        assert (b["x"] == -1).all(), f"batch {k} was overwritten after the user wrote it"
        assert_same(expected[k]["y"], b["y"], f"batch {k}['y']")
