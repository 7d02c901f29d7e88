"""A pinned ring's slots over their whole life: retired, kept past the epoch, kept across epochs
(NOTE [ Slot lifetime ], NOTE [ Registered memory lifetime ]), on the simulated CUDA runtime.

Each test failed on the code before it: retiring a slot lost every fenced slot; closing the
ring at an epoch end unregistered slots the user still held (their batches turned unpinned);
and without persistent workers every epoch registered the ring again and waited for the GPU.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import gpufeed
from gpufeed._base.cuda import Fences
from gpufeed._memory import keeper as _keeper
from gpufeed._memory import pinning as _pinning
from gpufeed._memory.region import PAGE
from gpufeed._memory.ring import SlotRing
from support.cuda_memory import finish_closed_rings
from support.fakes import IndexDataset
from support.procs import deadline
from support.release_checks import batch_sum
from support.sim_cuda import SimCuda


@pytest.fixture(autouse=True)
def _deadline() -> Iterator[None]:
    with deadline(90):
        yield


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimCuda]:
    sim = SimCuda(0, max_steps=2, copy_cost=(1, 3))
    sim.install(monkeypatch)
    yield sim
    sim.drain()
    gc.collect()
    finish_closed_rings()  # while the sim is installed


def loader_of(n_batches: int, worker_type: str = "thread", **kw: Any) -> gpufeed.DataLoader:
    return gpufeed.DataLoader(IndexDataset(n_batches * 4), batch_size=4, num_workers=2,
                              worker_type=worker_type, prefetch_factor=2, pin_memory=True, **kw)


# -- retiring ------------------------------------------------------------------------------------
def test_retiring_a_slot_keeps_every_fenced_slot(sim: SimCuda) -> None:
    """Batches grew: a free slot too small is retired while two released slots still wait
    for their copies. Those two must come back to the free list, not vanish."""
    ring = SlotRing(reserve=1 << 24, budget=None, shared=False, pin=True, slots_hint=8)
    ring.learn(PAGE)
    a, b, c = (ring.acquire() for _ in range(3))
    assert a is not None and b is not None and c is not None
    ring.release(a[0])  # a worker did not fill it: free at once
    sim.launch(None, lambda t: None, sim.empty((1,), torch.uint8), cost=40)  # the GPU is busy
    bases = [ring.lease(s[0], PAGE) for s in (b, c)]
    copies = [torch.from_numpy(base).cuda(non_blocking=True) for base in bases]
    del bases  # dropped with their copies queued: fenced
    assert ring.fenced == 2
    ring.learn(2 * PAGE)
    new = ring.acquire()  # retires a
    assert new is not None
    sim.drain()
    ring._collect_released()
    ring._unfence()
    assert ring.fenced == 0
    assert ring.in_use == 1, f"slots lost: {ring.in_use - 1} neither free nor fenced"
    assert sorted(ring._free) == sorted([b[0], c[0]])
    assert ring.live_bytes == sum(size for _, size in ring._slots.values())
    del copies
    ring.close()


# -- kept past the epoch -------------------------------------------------------------------------
@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_batches_kept_past_the_epoch_stay_pinned(sim: SimCuda, worker_type: str) -> None:
    """``list(loader)``: the epoch ends with every batch kept. They stay page-locked (as stock's
    pinned batches do), so copies queued later are still asynchronous, and intact."""
    batches = list(loader_of(40, worker_type))
    ring_batches = batches[8:]  # past the first ones, pinned the ordinary way
    assert all(_pinning.is_pinned(b["x"]) for b in ring_batches), "kept batches were unpinned"
    copies = [b["x"].cuda(non_blocking=True) for b in ring_batches]
    del batches, ring_batches
    gc.collect()
    sim.drain()
    assert sim.violations == []
    assert [float(x.double().sum()) for x in copies] == [batch_sum(4 * k) for k in range(8, 40)]
    finish_closed_rings()
    assert sim.registered == {}  # unregistered once released and their copies ran


def test_a_closed_rings_slots_are_unregistered_once_released(sim: SimCuda) -> None:
    """A ring closed for good (its loader gone) while the user holds batches: only those slots
    stay registered, each until it is released and its copies have run."""
    loader = loader_of(24)
    kept = list(loader)[8:]
    del loader
    gc.collect()  # the loader, and with it its kept ring, are gone
    assert 0 < len(sim.registered) <= len({b["x"].data_ptr() // PAGE for b in kept}) + 2
    x = kept[0]["x"].cuda(non_blocking=True)
    del kept
    gc.collect()
    finish_closed_rings()
    assert sim.registered == {} and sim.violations == []
    sim.drain()
    assert float(x.double().sum()) == batch_sum(32)


# -- kept across epochs ----------------------------------------------------------------------------
@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_the_pinned_ring_is_kept_across_epochs(sim: SimCuda, worker_type: str) -> None:
    """Without persistent workers each epoch starts new workers but keeps the ring: no slot
    is registered again, none unregistered, and the CPU never waits for the GPU at an epoch
    end. Every batch of every epoch is intact."""
    loader = loader_of(40, worker_type)
    sums: list[float] = []
    registered_after: list[int] = []
    for _ in range(3):
        for batch in loader:
            x = batch["x"].cuda(non_blocking=True)
            del batch
            sim.launch(None, lambda t: sums.append(float(t.double().sum())), x, cost=3)
        registered_after.append(sum(1 for c in sim.calls if c[0] == "register"))
    assert registered_after[0] > 0
    assert registered_after == [registered_after[0]] * 3, registered_after
    assert not any(c[0] == "unregister" for c in sim.calls)
    assert sim.syncs == 0  # no host wait for the GPU at any epoch end
    sim.drain()
    assert sums == [batch_sum(4 * k) for k in range(40)] * 3
    del loader
    gc.collect()
    assert sim.registered == {}  # the loader gone: the ring is closed and unregistered


def test_a_kept_ring_is_not_shared_by_two_iterators_at_once(sim: SimCuda) -> None:
    loader = loader_of(10)
    first = iter(loader)
    second = iter(loader)
    a = [b["x"].clone() for b in first]
    b = [b["x"].clone() for b in second]
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert first._ring is not second._ring  # type: ignore[attr-defined]


def test_stats_report_fenced_slots_apart_from_those_in_use(sim: SimCuda) -> None:
    """A slot waiting for the GPU (fenced) is not "in use" by the loop: stats say which."""
    loader = loader_of(60)
    it = iter(loader)
    sim.launch(None, lambda t: None, sim.empty((1,), torch.uint8), cost=10_000)  # GPU stalls
    for batch in itertools_islice(it, 30):
        x = batch["x"].cuda(non_blocking=True)
        del batch, x
    info = it.ring_info()  # type: ignore[attr-defined]
    assert info["fenced"] > 0
    assert info["in_use"] <= 6  # the work-ahead, not the fenced ones
    stats = loader.stats()
    fenced = stats.stages.get("ring_fenced")
    assert fenced is not None and fenced.occupancy_max > 0
    it.close()  # type: ignore[attr-defined]


def itertools_islice(it: Any, n: int) -> Any:
    import itertools

    return itertools.islice(it, n)


def test_batches_kept_from_one_epoch_do_not_starve_the_next(sim: SimCuda) -> None:
    """Every batch of epoch 1 kept (a cached epoch): the kept ring's budget is not taken by
    them, so later epochs recycle their slots as a fresh ring would (the code before the
    carried slots: about one fallback per batch, 1188 in 3 x 400 batches)."""
    loader = loader_of(400)
    kept = list(loader)
    first = loader.stats().counters.get("ring_fallback", 0)
    for _ in range(2):
        for batch in loader:
            x = batch["x"].cuda(non_blocking=True)
            del batch
            sim.launch(None, lambda t: None, x, cost=2)
    later = loader.stats().counters.get("ring_fallback", 0) - first
    assert later <= 2 * first + 10, (first, later)
    sim.drain()
    assert float(kept[7]["x"].double().sum()) == batch_sum(28)  # still intact
    del kept, loader


def test_an_interrupted_retire_keeps_its_slot(sim: SimCuda) -> None:
    """Ctrl-C while retiring a slot (unregister waits for a device stage's copies): the slot
    stays free and registered, so a later acquire or close still gives it back."""
    from support.release_checks import InterruptOnce

    ring = SlotRing(reserve=1 << 22, budget=None, shared=False, pin=True, slots_hint=8)
    ring.learn(PAGE)
    a = ring.acquire()
    assert a is not None
    ring.release(a[0])
    ring.learn(2 * PAGE)
    stage = Fences()
    stage.add(InterruptOnce(), None)
    _pinning.track_copies(stage)
    try:
        with pytest.raises(KeyboardInterrupt):
            ring.acquire()  # retires a: its unregister waits for the stage's copy
    finally:
        _pinning.untrack_copies(stage)
    assert a[0] in ring._pins and a[0] in ring._free
    assert ring.close() is True and sim.registered == {}


def test_another_loaders_batch_collected_inside_a_stage_drop_is_still_fenced(
    sim: SimCuda,
) -> None:
    """A collection that runs while a device stage drops its own copied batches finalizes a
    batch of another loader, whose copy is still queued: that slot must be fenced, not freed
    (the marker was thread-wide before: the slot was freed and unregistered under the copy)."""
    from gpufeed._base import cuda as _cuda

    sim.max_steps = 0  # the GPU stands still
    ring = SlotRing(reserve=1 << 22, budget=None, shared=False, pin=True, slots_hint=8)
    ring.learn(PAGE)
    acquired = ring.acquire()
    assert acquired is not None
    base = ring.lease(acquired[0], PAGE)
    x = torch.from_numpy(base).cuda(non_blocking=True)  # queued, not run
    cycle: list[Any] = [base]
    cycle.append(cycle)
    del base, cycle
    with _cuda.copies_complete([12345]):  # a stage drops a batch of its own
        gc.collect()
    ring._collect_released()
    assert acquired[0] not in ring._free and ring.fenced == 1
    _keeper.close_ring(ring)
    assert sim.violations == []
    sim.max_steps = 2
    sim.drain()
    finish_closed_rings()
    assert sim.registered == {} and sim.violations == []
    del x


def test_forked_workers_map_a_kept_ring_of_their_own(sim: SimCuda) -> None:
    """Epochs after the first fork their workers after the ring was registered. A driver may
    leave registered ranges out of a child's copy of the address space (MADV_DONTFORK, as
    ROCm's did): here the parent marks the ring so, and the workers of epoch 2 must still
    write every batch (each maps the memory file afresh) instead of dying of SIGSEGV."""
    import mmap

    if not hasattr(mmap, "MADV_DONTFORK"):
        pytest.skip("no MADV_DONTFORK on this platform")
    loader = loader_of(40, "process")
    first = [float(b["x"].double().sum()) for b in loader]
    ring = loader._keeper.kept
    assert ring is not None and ring.region.fd >= 0
    ring.region.mm.madvise(mmap.MADV_DONTFORK)  # what such a driver does to pinned pages
    second = [float(b["x"].double().sum()) for b in loader]
    assert first == second == [batch_sum(4 * k) for k in range(40)]
