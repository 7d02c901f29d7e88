"""The slot ring: kept batches are never overwritten; growth, budget, fallback, recycling.

``it.ring_info()`` reports slot_bytes, live_bytes, in_use, grows, fallbacks and budget.
"""

from __future__ import annotations

import collections
import gc
import signal
import sys
import time
import types
import weakref

import numpy as np
import psutil
import pytest
import torch
import torch.utils.data as tud

import gpufeed
from gpufeed._base import cuda as _cuda
from gpufeed._base.cuda import Fences
from gpufeed._base.interrupts import interrupt_main_later
from gpufeed._memory.region import PAGE, Region, default_reserve, reserve_for
from gpufeed._memory.release import Releaser
from gpufeed._memory.ring import SlotRing
from support.compare import assert_same, assert_same_batches, list_or_stop
from support.fakes import (
    BlockDataset,
    EmptyLaterDataset,
    GrowingDataset,
    RichDataset,
    SleepDataset,
    VarLenDataset,
    pad_collate,
)
from support.leaks import no_leaks

RING_KEYS = {"slot_bytes", "live_bytes", "in_use", "fenced", "grows", "fallbacks", "budget"}


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


def test_kept_batches_are_never_overwritten(worker_type):
    """list(loader) keeps every batch: each one still equals stock's at the end."""
    expected = list(tud.DataLoader(BlockDataset(64), batch_size=4, shuffle=False))
    batches, info = _epoch(_loader(BlockDataset(64), worker_type, batch_size=4))
    assert set(info) == RING_KEYS
    assert info["grows"] > 0, f"the ring was never used: {info}"
    assert_same_batches(expected, batches)


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


def test_stats_count_slots_carved_while_the_epoch_runs(worker_type):
    """``stats()`` reports ring_grow / ring_fallback as slots are carved, not at the epoch's
    end: with a strict in-flight bound, most hand-outs stop because the window is full."""
    loader = _loader(BlockDataset(256), worker_type, batch_size=4, prefetch_factor=2,
                     ring_bytes=3 * 8192)
    it = iter(loader)
    try:
        for _ in range(12):
            next(it)
        info = it.ring_info()
        counters = loader.stats().counters
        assert info["grows"] > 0 and info["fallbacks"] > 0, info
        assert counters.get("ring_grow", 0) == info["grows"], (counters, info)
        assert counters.get("ring_fallback", 0) == info["fallbacks"], (counters, info)
    finally:
        it.close()


def test_default_budget_is_bounded_and_falls_back(worker_type):
    """Keeping 600 batches: the default budget stops growth, the rest falls back intact."""
    expected = list(tud.DataLoader(BlockDataset(2400, 16), batch_size=4))
    batches, info = _epoch(_loader(BlockDataset(2400, 16), worker_type, batch_size=4))
    assert_same_batches(expected, batches)
    assert info["budget"] > 0, info
    assert info["grows"] < len(batches) and info["fallbacks"] > 0, info


def test_default_budget_bounds_live_bytes(worker_type):
    """400 cheap batches then 40 slow ones, all kept: the ring stays within its budget."""
    batches, info = _epoch(_loader(SleepDataset(440, slow_from=400, seconds=0.015, once=False),
                                   worker_type, batch_size=1))
    assert len(batches) == 440
    assert info["live_bytes"] <= info["budget"], info


def test_ring_bytes_zero_always_falls_back(worker_type):
    expected = list(tud.DataLoader(RichDataset(23), batch_size=5))
    batches, info = _epoch(_loader(RichDataset(23), worker_type, batch_size=5, ring_bytes=0))
    assert_same_batches(expected, batches)
    assert info["grows"] == 0 and info["live_bytes"] == 0 and info["in_use"] == 0, info


@pytest.mark.parametrize("ring_bytes", [None, 3 * 4096])
def test_later_bigger_batches_are_not_truncated(worker_type, ring_bytes):
    """The first batch is the smallest; later ones outgrow the learnt slot."""
    ds = GrowingDataset(40, batch_size=4)
    expected = list(tud.DataLoader(ds, batch_size=4))
    batches, _ = _epoch(_loader(ds, worker_type, batch_size=4, ring_bytes=ring_bytes))
    assert_same_batches(expected, batches)
    assert batches[-1]["grow"].shape == (4, 1 + 9 * 700)


def test_variable_size_batches_with_padding_not_truncated(worker_type):
    expected = list(tud.DataLoader(VarLenDataset(60), batch_size=3, collate_fn=pad_collate))
    batches, _ = _epoch(_loader(VarLenDataset(60), worker_type, batch_size=3,
                                collate_fn=pad_collate))
    assert_same_batches(expected, batches)


def test_last_short_batch_not_padded_or_truncated(worker_type):
    expected = list(tud.DataLoader(BlockDataset(23, 100), batch_size=5))
    batches, _ = _epoch(_loader(BlockDataset(23, 100), worker_type, batch_size=5))
    assert batches[-1]["x"].shape == (3, 100)
    assert_same_batches(expected, batches)


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


def test_slots_return_when_the_user_drops_kept_batches(worker_type):
    """Held batches pin their slots; once dropped, every slot is free again, and the next
    epochs find them: no batch of theirs falls back to an allocation of its own.

    The epoch that keeps all 16 batches may fall back (by design: the ring is sized for the
    batches in flight and the loop's two, NOTE [ Slot lifetime ]); how many it keeps in slots
    follows how far ahead the workers were allowed, which follows their measured time per batch:
    on a loaded machine, fewer. So only the later epochs' fallbacks are counted."""
    loader = _loader(BlockDataset(64), worker_type, batch_size=4, persistent_workers=True)
    it = iter(loader)
    held = list(it)
    info = it.ring_info()
    assert info["in_use"] > 0, info
    kept_epoch_fallbacks = info["fallbacks"]
    del held
    gc.collect()
    info = it.ring_info()
    assert info["in_use"] == 0, f"dropped batches still hold slots: {info}"
    for _ in range(3):
        assert sum(1 for _b in loader) == 16
    info = it.ring_info()
    assert info["in_use"] == 0 and info["fallbacks"] == kept_epoch_fallbacks, info
    del it, loader
    gc.collect()


def test_empty_tensor_batches_after_slot_learnt(worker_type):
    expected = list(tud.DataLoader(EmptyLaterDataset(), batch_size=4))
    got = list_or_stop(_loader(EmptyLaterDataset(), worker_type, batch_size=4, num_workers=1))
    assert_same_batches(expected, got)


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


# -- the region and its budget, without workers ------------------------------------------------


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "private"])
def test_region_releases_its_descriptor_and_mapping_on_every_path(shared):
    with no_leaks(settle_s=0.5):
        with pytest.raises(OSError):
            Region(1 << 47, shared=shared)  # the whole address space: the mmap fails
        Region(1 << 20, shared=shared)  # dropped without close_fd(): the finalizer closes it
        r = Region(1 << 20, shared=shared)
        r.close_fd()
        r.close_fd()
        view = r.tensor[:10]
        r.release()  # a view is alive: its mapping stays, the descriptors go with it
        view.fill_(7)
        assert view.sum().item() == 70
        del view
        r.release()
        held = Region(1 << 20, shared=shared)
        held.release()  # nothing views it: unmapped now, though `held` is still referenced
        assert held.fd == -1 and held.mm is None
    gc.collect()


def _memory_kb() -> tuple[int, int]:
    """(this process's resident anonymous + shmem pages, the machine's shmem pages)."""
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    with open("/proc/meminfo") as f:
        meminfo = dict(line.split(":", 1) for line in f)
    rss = sum(int(status[k].split()[0]) for k in ("RssAnon", "RssShmem"))
    return rss, int(meminfo["Shmem"].split()[0])


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "private"])
def test_discarded_slots_give_their_pages_back(shared):
    """A retired slot's pages return to the system, not only leave this process's page table
    (MADV_DONTNEED on a shared anonymous mapping would leave them in shmem)."""
    touched = 128 << 20
    region = Region(2 * touched, shared=shared)
    rss0, shm0 = _memory_kb()
    region.array[:touched] = 1
    rss1, _ = _memory_kb()
    assert rss1 - rss0 > (touched >> 10) // 2
    region.discard(0, touched)
    rss2, shm2 = _memory_kb()
    assert rss2 - rss0 < (touched >> 10) // 4, "the pages are still resident"
    assert shm2 - shm0 < (touched >> 10) // 2, "the pages stayed in shared memory"
    assert not region.array[:touched].any()
    region.release()


def test_a_budget_past_the_reservation_falls_back():
    """The budget is a cap: slots are carved up to the reservation, then batches fall back."""
    ring = SlotRing(reserve=4 * PAGE, budget=1 << 40, shared=False, pin=False, slots_hint=2)
    assert ring.budget == 4 * PAGE  # what the ring can hold, reported as such
    ring.learn(PAGE)
    slots = [ring.acquire() for _ in range(5)]
    assert all(s is not None for s in slots[:4]) and slots[4] is None
    assert ring.grows == 4 and ring.fallbacks == 1
    ring.close()


def test_an_unpinned_slot_returns_once_the_last_view_of_its_batch_is_gone():
    """See NOTE [ Slot lifetime ]: each lease's weak reference names its own slot, whatever order
    batches are dropped in, and a view outliving its batch's base keeps the slot."""
    ring = SlotRing(reserve=8 * PAGE, budget=None, shared=False, pin=False, slots_hint=3)
    ring.learn(PAGE)
    sids = [ring.acquire()[0] for _ in range(3)]  # type: ignore[index]
    bases = [ring.lease(sid, 100) for sid in sids]
    views = [torch.frombuffer(b, dtype=torch.uint8)[:10] for b in bases]  # type: ignore[arg-type]
    del bases
    assert ring.in_use == 3
    del views[2]  # the last slot's batch first, then the first's
    assert ring.in_use == 2
    del views[0]
    assert ring.in_use == 1
    ring._collect_released()
    assert sorted(ring._free) == [sids[0], sids[2]] and list(ring._leases) == [sids[1]]
    keep = views.pop()[2:]  # a view of a view keeps the base alive
    assert ring.in_use == 1
    del keep
    assert ring.in_use == 0 and ring.acquire() is not None
    ring.close()


def test_huge_ring_bytes_reserve_at_most_the_physical_memory():
    assert reserve_for(1 << 47) <= psutil.virtual_memory().total
    assert reserve_for(1 << 20) == 1 << 20
    assert reserve_for(None) == default_reserve()


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "private"])
def test_a_ring_that_cannot_be_mapped_names_ring_bytes(shared):
    with no_leaks(settle_s=0.5), pytest.raises(ValueError) as info:
        SlotRing(reserve=1 << 47, budget=1 << 47, shared=shared, pin=False, slots_hint=2)
    msg = str(info.value)
    assert f"ring_bytes= (it is {1 << 47})" in msg and "ring_bytes=0" in msg, msg


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.leaks(settle_s=0.5)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_platforms_without_memfd_share_an_unlinked_file(monkeypatch, context):
    """macOS and the BSDs have no memfd: the ring is an unlinked temporary file instead, with
    the same batches, recycling and cleanup (fork inherits the mapping, spawn gets the fd)."""
    monkeypatch.delattr("os.memfd_create")
    expected = list(tud.DataLoader(BlockDataset(48), batch_size=4))
    loader = gpufeed.DataLoader(BlockDataset(48), batch_size=4, num_workers=2,
                                multiprocessing_context=context)
    it = iter(loader)
    got = [_clone(b) for b in it]
    info = it.ring_info()
    del it, loader
    gc.collect()
    assert info["grows"] > 0, f"the ring was never used: {info}"
    assert_same_batches(expected, got)


def test_dropping_an_unpinned_batch_runs_no_python_code():
    """See NOTE [ Ctrl-C and slot releases ]: a Ctrl-C raised inside Python code run by a release
    would be dropped, so an unpinned slot comes back through a C callback only."""
    ring = SlotRing(reserve=1 << 20, budget=None, shared=False, pin=False, slots_hint=4)
    try:
        ring.learn(100)
        sid, _, _ = ring.acquire()
        base = ring.lease(sid, 100)
        assert ring.in_use == 1
        entered: list[str] = []

        def profile(frame, event, arg):
            if event == "call":
                entered.append(frame.f_code.co_qualname)

        gc.disable()
        sys.setprofile(profile)
        try:
            del base
        finally:
            sys.setprofile(None)
            gc.enable()
        assert entered == []
        assert ring.in_use == 0 and ring.acquire()[0] == sid  # and the slot is free again
    finally:
        ring.close()


def _drop_and_expect_the_interrupt(releaser: Releaser, sid: int) -> None:
    """Drop a batch base whose finalizer is ``releaser`` (as ``lease`` does for a pinned slot);
    the KeyboardInterrupt raised inside must reach this frame within milliseconds."""
    base = np.zeros(8)
    weakref.finalize(base, releaser, sid).atexit = False
    with pytest.raises(KeyboardInterrupt):
        del base
        for _ in range(500):  # never waited out
            time.sleep(0.01)


def test_a_ctrl_c_inside_a_pinned_release_still_stops_the_loop(monkeypatch):
    """A KeyboardInterrupt raised inside a pinned slot's release (Python code, run by a
    finalizer) reaches the loop instead of being printed and dropped; the slot is parked
    for a later fence, never freed twice."""
    released, parked, fences = collections.deque(), collections.deque(), Fences()
    pins = {3: types.SimpleNamespace(ptr=0, nbytes=PAGE)}
    releaser = Releaser(released, fences, parked, pins, None)

    def ctrl_c_here():  # the point where a Ctrl-C's handler raised
        raise KeyboardInterrupt

    monkeypatch.setattr(_cuda, "cuda_initialized", ctrl_c_here)
    _drop_and_expect_the_interrupt(releaser, 3)
    assert list(parked) == [3] and not released and len(fences) == 0


def test_a_ctrl_c_after_the_fence_never_frees_the_slot_twice(monkeypatch):
    """The interrupt lands just after the slot went behind its fence, and meanwhile an
    ``acquire`` on another thread found the event complete and freed the slot: parking it
    as well would free it a second time (two batches in one slot)."""
    released, parked = collections.deque(), collections.deque()

    class FreedMeanwhile(Fences):
        def add(self, event, payload=None):
            super().add(event, payload)
            self.done_elsewhere = self._entries.popitem()[1]  # another thread's acquire took it
            raise KeyboardInterrupt  # where a Ctrl-C's handler raised

    fences = FreedMeanwhile()
    pins = {3: types.SimpleNamespace(ptr=0, nbytes=PAGE)}
    releaser = Releaser(released, fences, parked, pins, 0)
    monkeypatch.setattr(_cuda, "copies_completed", lambda start, end: False)
    monkeypatch.setattr(_cuda, "cuda_initialized", lambda: True)
    monkeypatch.setattr(_cuda, "capturing", lambda device: False)
    monkeypatch.setattr(_cuda, "release_event", lambda device, also=(): "event")
    _drop_and_expect_the_interrupt(releaser, 3)
    assert fences.done_elsewhere == ("event", 3)
    assert not parked and not released and len(fences) == 0


def test_interrupting_again_runs_the_programs_own_sigint_handler():
    """A program with its own SIGINT handler (e.g. one that saves and stops) gets it run."""
    seen: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        interrupt_main_later(0.01)
        deadline = time.monotonic() + 5.0
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        signal.signal(signal.SIGINT, old)
    assert seen == [signal.SIGINT]
