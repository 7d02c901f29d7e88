"""The pinned ring under the user's own copies, on the simulated CUDA runtime (sim_cuda).

``DataLoader(..., pin_memory=True)`` without ``device=``, then ``x.cuda(non_blocking=True)``
and the host batch dropped: the copy is queued behind the consumer's work and reads the
slot's bytes when it runs, so the slot must not be recycled before (NOTE [ Slot lifetime ],
release fences, in gpufeed/_memory/ring.py), nor unregistered (NOTE [ Registered memory lifetime ]
in gpufeed/_memory/pinning.py). The tests of the rules failed on the code before them (release
fences, teardown, registration failure, device guards, device at iteration start, capture);
the ``test_catches_*`` tests break one rule at a time and see the failure. The tests of
current-stream changes record what happens, covered or not (NOTE [ Slot lifetime ] (a)).
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import gpufeed
from gpufeed._base.cuda import Fences
from gpufeed._device import prefetch as _prefetch
from gpufeed._memory import keeper as _keeper
from gpufeed._memory import pinning as _pinning
from gpufeed._memory import release as _release
from gpufeed._memory import ring as _ring
from gpufeed._memory.release import PinningFallbackWarning
from gpufeed._memory.ring import SlotRing
from support.cuda_memory import finish_closed_rings
from support.fakes import IndexDataset
from support.procs import deadline
from support.release_checks import expected, problems, recorder
from support.sim_cuda import SimCuda


@pytest.fixture(autouse=True)
def _deadline() -> Iterator[None]:
    with deadline(90):
        yield


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> SimCuda:
    sim = SimCuda(0, max_steps=2, copy_cost=(1, 3), devices=4)
    sim.install(monkeypatch)
    monkeypatch.setattr("gpufeed._memory.release._warned", False)
    return sim


def user_loop(sim: SimCuda, loader: Any, *, idiom: str = "cuda", cost: int = 6,
              stop: int | None = None) -> list[tuple[int, float]]:
    """The idiom in the wild: copy, drop the host batch, queue a step on the (busy)
    current stream; the step records what it read when it runs."""
    seen: list[tuple[int, float]] = []
    step = recorder(seen)

    for k, batch in enumerate(loader):
        if idiom == "cuda":
            x, y = batch["x"].cuda(non_blocking=True), batch["y"].cuda(non_blocking=True)
        else:
            x = batch["x"].to("cuda", non_blocking=True)
            y = batch["y"].to(torch.device("cuda"), non_blocking=True)
        del batch
        sim.launch(None, step, x, y, cost=cost)
        if stop is not None and k + 1 == stop:
            break
    sim.drain()
    return seen


# -- 1. release fences: a slot is never rewritten under a pending copy --------------------------
@pytest.mark.parametrize(("worker_type", "idiom", "n"), [
    ("thread", "cuda", 250), ("process", "to", 250)])
def test_pin_memory_then_non_blocking_copy_sees_every_batch_intact(
    sim: SimCuda, worker_type: str, idiom: str, n: int
) -> None:
    bs = 4
    loader = gpufeed.DataLoader(IndexDataset(n * bs), batch_size=bs, num_workers=2,
                                worker_type=worker_type, prefetch_factor=2, pin_memory=True)
    seen = user_loop(sim, loader, idiom=idiom)
    assert problems(sim, seen, expected(n, bs)) == []
    assert sum(1 for c in sim.calls if c[0] == "register") >= 1  # the ring was registered
    assert len(sim.consumer.ops) == 0 and sim.registered  # kept for the next epoch
    del loader
    gc.collect()
    assert sim.registered == {}  # the loader gone: all unregistered


def test_catches_a_release_without_fence(sim: SimCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: the slot straight back to the free list (the code before release fences)."""
    monkeypatch.setattr(_release.Releaser, "__call__", lambda self, sid: self.released.append(sid))
    loader = gpufeed.DataLoader(IndexDataset(800), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, pin_memory=True)
    bad = problems(sim, user_loop(sim, loader), expected(200, 4))
    assert any("differ from a synchronous copy" in p for p in bad), bad


def test_catches_unregistering_under_a_pending_copy(
    sim: SimCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutation: a fenced slot counted free before its event completed (so unregistered, when
    the loader goes, with the last copies still queued)."""

    def done_at_once(self: Any, sink: Any = None) -> list[Any]:
        out = [payload for _, payload in self._entries.values()]
        self._entries.clear()
        if sink is not None:
            sink.extend(out)
        return out

    monkeypatch.setattr(Fences, "done", done_at_once)
    loader = gpufeed.DataLoader(IndexDataset(80), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, pin_memory=True)
    seen: list[tuple[int, float]] = []
    for batch in loader:
        x, y = batch["x"].cuda(non_blocking=True), batch["y"].cuda(non_blocking=True)
        del batch
        sim.launch(None, recorder(seen), x, y, cost=40)
    del loader
    gc.collect()
    sim.drain()
    bad = problems(sim, seen, expected(20, 4))
    assert any("cudaHostUnregister" in p and "still queued" in p for p in bad), bad


def test_device_stage_batches_need_no_fence_so_slots_recycle(sim: SimCuda) -> None:
    """With ``device=`` the stage drops a host batch only after its copy completed: its slot
    is free at once (no release event), so the ring stays as small as before."""
    loader = gpufeed.DataLoader(IndexDataset(1600), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, device="cuda")
    seen: list[tuple[int, float]] = []
    step = recorder(seen)

    it = iter(loader)
    for batch in it:
        sim.launch(None, step, batch["x"], batch["y"], cost=6)
    sim.drain()
    assert problems(sim, seen, expected(400, 4)) == []
    # no release fence per batch: events only from the close (one per slot unregistered)
    events = sum(1 for c in sim.calls if c[0] == "event")
    assert events <= sum(1 for c in sim.calls if c[0] == "unregister") <= 10
    stats = loader.stats()
    assert stats.counters.get("ring_grow", 0) <= 10, stats.counters


def test_default_ring_leaves_room_for_a_gpu_two_steps_behind(sim: SimCuda) -> None:
    """Fenced slots count against the ring's budget; the default one holds two of them, so a
    loop that syncs on the step two back (``loss.item()`` of the step before the last) needs
    no ordinary allocation. Without the slack about one batch in ten fell back."""
    loader = gpufeed.DataLoader(IndexDataset(1200), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, pin_memory=True)
    marks: list[Any] = []
    for batch in loader:
        x = batch["x"].cuda(non_blocking=True)
        del batch
        sim.launch(None, lambda t: None, x, cost=3)
        marks.append(sim._release_event())  # stands in for the step's loss
        while len(marks) > 2:
            marks.pop(0).synchronize()
    sim.drain()
    assert loader.stats().counters.get("ring_fallback", 0) == 0, loader.stats().counters


# -- 2. teardown in any order ------------------------------------------------------------------
def collect_a_stage_cycle_with_copies_queued(sim: SimCuda) -> None:
    """A device stage in a garbage cycle with its loader's ring, collected while its copies
    are still queued on the simulated side stream."""
    sim.copy_cost = (6, 9)  # copies still queued when the cycle goes
    loader = gpufeed.DataLoader(IndexDataset(400), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, device="cuda")
    it = iter(loader)
    for _ in range(10):  # past the first batches (no slot yet: pinned the ordinary way)
        next(it)
    stage = it.inner
    assert len(stage._copies) > 0  # copies in flight
    stage._cycle = stage
    del it, stage, loader  # the loader too: its kept ring is closed with the cycle
    gc.collect()
    # The host batches went without their stage's word that their copies completed: their
    # slots are fenced on the consumer's stream, which is idle; each reap below may find such
    # a fence passed while the side stream's copy is still queued, and unregister the slot.
    for _ in range(30):
        _keeper.reap_closed()


def test_a_stage_collected_after_the_ring_is_still_waited_for(
    sim: SimCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a garbage cycle weak references are cleared before any finalizer runs, so a weak
    registry of stages forgot a stage whose copies were still queued, and the ring collected
    with it was unregistered under them. Modelled: the stage's own finalizer runs last (here:
    never), and the cycle is collected; unregistering must still wait for its copies."""
    monkeypatch.setattr(_pinning, "_tracked", set())
    monkeypatch.setattr(_prefetch.DeviceIterator, "__del__", lambda self: None)
    collect_a_stage_cycle_with_copies_queued(sim)
    assert [v for v in sim.violations if "unregister" in v] == []
    sim.drain()
    finish_closed_rings()
    assert sim.registered == {}  # the ring went with the cycle
    assert [v for v in sim.violations if "unregister" in v] == []


def test_catches_a_weak_registry_of_stages(
    sim: SimCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutation: the registry weak again (the code before): the same cycle unregisters under
    the stage's queued copies."""
    import weakref

    monkeypatch.setattr(_pinning, "_tracked", weakref.WeakSet())
    monkeypatch.setattr(_prefetch.DeviceIterator, "__del__", lambda self: None)
    collect_a_stage_cycle_with_copies_queued(sim)
    sim.drain()
    assert any("unregister" in v for v in sim.violations), sim.violations


def test_a_ring_collected_with_fenced_slots_waits_for_their_copies(sim: SimCuda) -> None:
    """A ring dropped without close() (its handles collected in any order) unregisters only
    after the release events of its slots, which its handles hold strongly."""
    loader = gpufeed.DataLoader(IndexDataset(400), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, pin_memory=True)
    it = iter(loader)
    xs = []
    for _ in range(6):
        batch = next(it)
        sim.launch(None, lambda x: None, batch["x"].cuda(non_blocking=True), cost=8)
        xs.append(batch["y"].cuda(non_blocking=True))
        del batch
    ring = it._ring  # type: ignore[attr-defined]
    assert ring.fenced > 0
    ring._cycle = ring
    it._closed = True  # type: ignore[attr-defined]  # its close() will not run: GC only
    it._pool.close()  # type: ignore[attr-defined]
    del it, ring
    gc.collect()
    assert sim.registered == {}
    assert [v for v in sim.violations if "unregister" in v] == []
    sim.drain()
    assert [int(y[0]) for y in xs] == [4 * k for k in range(6)]


# -- 3. CUDA hygiene ---------------------------------------------------------------------------
def test_registration_failure_warns_once_and_goes_on_with_ordinary_pinning(
    sim: SimCuda,
) -> None:
    sim.register_code = 2  # cudaErrorMemoryAllocation (e.g. past RLIMIT_MEMLOCK)
    loader = gpufeed.DataLoader(IndexDataset(200), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, pin_memory=True,
                                persistent_workers=True)
    with pytest.warns(PinningFallbackWarning, match=r"out of memory.*ulimit -l") as record:
        seen = user_loop(sim, loader)
    assert len(record) == 1
    assert problems(sim, seen, expected(50, 4)) == []
    it = loader._iterator
    ring = it._ring  # type: ignore[union-attr]
    assert ring.pin is False and ring._pins == {} and sim.registered == {}
    assert _pinning.registered_bytes() == 0
    assert ring.grows >= 1 and ring.live_bytes == ring.grows * ring.slot_bytes  # consistent
    assert sum(1 for c in sim.calls if c[0] == "register") == 1  # not retried per slot
    assert sum(1 for c in sim.calls if c[0] == "pin_memory") >= 50  # ordinary pinning
    seen = user_loop(sim, loader)  # a second epoch: no second warning (pytest: an error)
    assert problems(sim, seen, expected(50, 4)) == []
    it.close()  # type: ignore[union-attr]


@pytest.mark.parametrize("how", ["device", "pin_memory_device"])
def test_every_cuda_call_runs_under_the_loaders_device(sim: SimCuda, how: str) -> None:
    """Rank 3 of 4 (current device still 0, as before ``set_device``): registration, release
    fences, unregistration and every stream/event call happen under device 3."""
    kw: dict[str, Any] = ({"device": "cuda:3"} if how == "device"
                          else {"pin_memory": True, "pin_memory_device": "cuda:3"})
    sim.device = torch.device("cuda", 3)
    loader = gpufeed.DataLoader(IndexDataset(160), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, **kw)
    for batch in loader:
        if how == "pin_memory_device":
            with sim.device_ctx(3):  # the user's copy to their device
                x = batch["x"].cuda(non_blocking=True)
                del batch
                sim.launch(None, lambda t: None, x, cost=4)
    sim.drain()
    devices = {d for what, d in sim.calls if what != "h2d"}
    assert devices == {3}, sorted(set(sim.calls))
    assert sim.device_index == 0  # and the user's current device is left as it was
    assert sum(1 for c in sim.calls if c[0] == "register") >= 1


def test_cuda_means_the_current_device_when_iteration_starts(sim: SimCuda) -> None:
    sim.device = torch.device("cuda", 2)
    loader = gpufeed.DataLoader(IndexDataset(40), batch_size=4, num_workers=2,
                                worker_type="thread", device="cuda")
    sim.set_device(2)  # torch.cuda.set_device(local_rank) after the loader was built
    it = iter(loader)
    assert it.inner.device == torch.device("cuda", 2)  # type: ignore[attr-defined]
    list(it)
    sim.drain()
    assert {d for _, d in sim.calls} == {2}


def test_cuda_is_not_initialised_before_the_workers_start(sim: SimCuda) -> None:
    """``pin_memory=True`` alone: the ring's device is asked at its first registration, not
    when the iterator starts (before the process workers fork)."""
    loader = gpufeed.DataLoader(IndexDataset(40), batch_size=4, num_workers=2,
                                worker_type="process", pin_memory=True)
    it = iter(loader)
    assert not sim.initialized
    assert len(list(it)) == 10 and sim.initialized
    assert {d for _, d in sim.calls} == {0}


def test_page_size_is_the_systems() -> None:
    import mmap

    assert _ring.PAGE == mmap.PAGESIZE
    ring = SlotRing(reserve=1 << 22, budget=None, shared=False, pin=False, slots_hint=2)
    ring.learn(100)
    assert ring.slot_bytes == mmap.PAGESIZE
    ring.close()


def test_next_during_graph_capture_raises_clearly(sim: SimCuda) -> None:
    for kw in ({"pin_memory": True}, {"device": "cuda"}):
        loader = gpufeed.DataLoader(IndexDataset(40), batch_size=4, num_workers=2,
                                    worker_type="thread", **kw)
        it = iter(loader)
        next(it)
        sim.capture = True
        with pytest.raises(RuntimeError, match=r"capturing a (CUDA )?graph"):
            next(it)
        sim.capture = False
        assert len(list(it)) == 9  # nothing lost: the batch was not taken
    sim.drain()


def test_a_slot_released_during_capture_is_fenced_after_it(sim: SimCuda) -> None:
    """A release that cannot record its event (capture) parks the slot; the next acquire
    outside capture fences it on the current stream, so the pending copy is still covered."""
    loader = gpufeed.DataLoader(IndexDataset(400), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, pin_memory=True)
    seen: list[tuple[int, float]] = []
    step = recorder(seen)

    parked, k = 0, -1
    it = iter(loader)
    for batch in it:
        k += 1
        x, y = batch["x"].cuda(non_blocking=True), batch["y"].cuda(non_blocking=True)
        sim.launch(None, step, x, y, cost=6)
        sim.capture = k % 3 == 0  # the host batch is dropped while capturing
        del batch
        sim.capture = False
        if k < 90:
            parked += len(it._ring._parked)  # type: ignore[attr-defined]
    sim.drain()
    assert problems(sim, seen, expected(100, 4)) == []
    assert parked > 10


# -- 4. the consumer's current stream changes inside the loop ----------------------------------
def test_copy_on_another_stream_dropped_inside_its_block_is_covered(sim: SimCuda) -> None:
    """Covered: the batch dropped while the stream of its copy is current."""
    other = sim.new_stream()
    loader = gpufeed.DataLoader(IndexDataset(1600), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, pin_memory=True)
    seen: list[tuple[int, float]] = []
    step = recorder(seen)

    # Not enumerate(loader): its reused result tuple would hold the batch until the next
    # iteration, so the last reference would go outside the block (then: not covered).
    k = -1
    for batch in loader:
        k += 1
        stream = other if k % 2 else sim.consumer
        with sim.use_stream(stream):
            x, y = batch["x"].cuda(non_blocking=True), batch["y"].cuda(non_blocking=True)
            del batch
            sim.launch(None, step, x, y, cost=6)
    sim.drain()
    assert problems(sim, sorted(seen), expected(400, 4)) == []


def test_copy_on_another_stream_dropped_outside_it_is_the_users_to_order(sim: SimCuda) -> None:
    """Not covered (NOTE [ Slot lifetime ] (a)): the fence goes on the stream current at the
    drop, which does not wait for the other stream; the copy may read a recycled slot."""
    other = sim.new_stream()
    loader = gpufeed.DataLoader(IndexDataset(1600), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, pin_memory=True)
    seen: list[tuple[int, float]] = []
    step = recorder(seen)

    for batch in loader:
        with sim.use_stream(other):
            x, y = batch["x"].cuda(non_blocking=True), batch["y"].cuda(non_blocking=True)
            sim.launch(None, step, x, y, cost=6)
        del batch  # on the consumer stream, idle: its fence completes at once
    sim.drain()
    assert any("differ" in p for p in problems(sim, seen, expected(400, 4)))


def test_device_stage_follows_a_change_of_current_stream(sim: SimCuda) -> None:
    """With ``device=``: each batch is ordered before (and kept alive for) the stream current
    at its next(); a loop that alternates streams sees every batch intact."""
    other = sim.new_stream()
    loader = gpufeed.DataLoader(IndexDataset(1600), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, device="cuda")
    seen: list[tuple[int, float]] = []
    step = recorder(seen)

    it = iter(loader)
    for k in itertools.count():
        with sim.use_stream(other if k % 2 else sim.consumer):
            try:
                batch = next(it)
            except StopIteration:
                break
            sim.launch(None, step, batch["x"], batch["y"], cost=6)
            del batch
    sim.drain()
    assert problems(sim, sorted(seen), expected(400, 4)) == []


def test_pageable_warning_still_names_the_users_line() -> None:
    """The device guard added a frame to next(): the warning must still point at the caller."""
    sim = SimCuda(0)
    sim.needs_pinned = True
    sim.is_pinned = lambda t: False  # type: ignore[method-assign]
    it = gpufeed.to_device([torch.ones(3)], "cuda", backend=sim)
    with pytest.warns(gpufeed.errors.PageableCopyWarning) as record:
        next(it)
    assert record[0].filename == __file__
    it.close()
