"""The pinned ring under the user's own copies, on the simulated CUDA runtime (sim_cuda).

``DataLoader(..., pin_memory=True)`` without ``device=``, then ``x.cuda(non_blocking=True)``
and the host batch dropped: the copy is queued behind the consumer's work and reads the
slot's bytes when it runs, so the slot must not be recycled before (NOTE [ Slot lifetime ],
release fences, in gpufeed/_ring.py), nor unregistered (NOTE [ Registered memory lifetime ]
in gpufeed/_pinning.py). Each test here failed before the rule it checks was implemented.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import gpufeed
from gpufeed import _pinning, _prefetch, _ring
from gpufeed._ring import PinningFallbackWarning, SlotRing
from helpers import deadline
from sim_cuda import SimCuda

WIDTH = 16


class IndexDataset(Dataset[dict[str, Any]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.arange(WIDTH, dtype=torch.float32) + i * WIDTH, "y": i}


def expected(n: int, bs: int) -> list[tuple[int, float]]:
    """What a synchronous copy of batch k holds (its checksum)."""
    return [
        (k * bs, float((torch.arange(WIDTH * bs, dtype=torch.float64) + k * WIDTH * bs).sum()))
        for k in range(n)
    ]


@pytest.fixture(autouse=True)
def _deadline() -> Iterator[None]:
    with deadline(90):
        yield


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> SimCuda:
    sim = SimCuda(0, max_steps=2, copy_cost=(1, 3), devices=4)
    sim.install(monkeypatch)
    monkeypatch.setattr("gpufeed._ring._warned_pinning", False)
    return sim


def problems(sim: SimCuda, seen: list[Any], want: list[Any]) -> list[str]:
    out = list(dict.fromkeys(sim.violations))[:5]
    bad = [k for k, (a, b) in enumerate(itertools.zip_longest(seen, want)) if a != b]
    if bad:
        out.append(f"{len(bad)} of {len(want)} batches differ from a synchronous copy, "
                   f"first {bad[:5]}")
    return out


def user_loop(sim: SimCuda, loader: Any, *, idiom: str = "cuda", cost: int = 6,
              stop: int | None = None) -> list[tuple[int, float]]:
    """The idiom in the wild: copy, drop the host batch, queue a step on the (busy)
    current stream; the step records what it read when it runs."""
    seen: list[tuple[int, float]] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        seen.append((int(y[0]), float(x.double().sum())))

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
    ("thread", "cuda", 1000), ("process", "to", 1000)])
def test_pin_memory_then_non_blocking_copy_sees_every_batch_intact(
    sim: SimCuda, worker_type: str, idiom: str, n: int
) -> None:
    bs = 4
    loader = gpufeed.DataLoader(IndexDataset(n * bs), batch_size=bs, num_workers=2,
                                worker_type=worker_type, prefetch_factor=2, pin_memory=True)
    seen = user_loop(sim, loader, idiom=idiom)
    assert problems(sim, seen, expected(n, bs)) == []
    assert sum(1 for c in sim.calls if c[0] == "register") >= 1  # the ring was registered
    assert len(sim.consumer.ops) == 0 and sim.registered == {}  # all unregistered at the end


def test_catches_a_release_without_fence(sim: SimCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: the slot straight back to the free list (the code before release fences)."""
    monkeypatch.setattr(_ring._Releaser, "__call__", lambda self, sid: self.released.append(sid))
    loader = gpufeed.DataLoader(IndexDataset(800), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, pin_memory=True)
    bad = problems(sim, user_loop(sim, loader), expected(200, 4))
    assert any("differ from a synchronous copy" in p for p in bad), bad


def test_catches_unregistering_under_a_pending_copy(
    sim: SimCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutation: unregister without waiting (epoch end while the last copies are queued)."""
    monkeypatch.setattr(_pinning, "_wait_for_copies", lambda h: None)
    loader = gpufeed.DataLoader(IndexDataset(80), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, pin_memory=True)
    bad = problems(sim, user_loop(sim, loader), expected(20, 4))
    assert any("cudaHostUnregister" in p and "still queued" in p for p in bad), bad


def test_device_stage_batches_need_no_fence_so_slots_recycle(sim: SimCuda) -> None:
    """With ``device=`` the stage drops a host batch only after its copy completed: its slot
    is free at once (no release event), so the ring stays as small as before."""
    loader = gpufeed.DataLoader(IndexDataset(1600), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, device="cuda")
    seen: list[tuple[int, float]] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        seen.append((int(y[0]), float(x.double().sum())))

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


# -- 2. teardown in any order ------------------------------------------------------------------
def test_a_stage_collected_after_the_ring_is_still_waited_for(
    sim: SimCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a garbage cycle weak references are cleared before any finalizer runs, so a weak
    registry of stages forgot a stage whose copies were still queued, and the ring collected
    with it was unregistered under them. Modelled: the stage's own finalizer runs last (here:
    never), and the cycle is collected; unregistering must still wait for its copies."""
    monkeypatch.setattr(_pinning, "_tracked", set())
    monkeypatch.setattr(_prefetch.DeviceIterator, "__del__", lambda self: None)
    sim.copy_cost = (6, 9)  # copies still queued when the cycle goes
    loader = gpufeed.DataLoader(IndexDataset(400), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, device="cuda")
    it = iter(loader)
    for _ in range(10):  # past the first batches (no slot yet: pinned the ordinary way)
        next(it)
    stage = it.inner  # type: ignore[attr-defined]
    assert len(stage._copies) > 0  # copies in flight
    stage._cycle = stage
    del it, stage
    gc.collect()
    assert sim.registered == {}  # the ring went with the cycle
    assert [v for v in sim.violations if "unregister" in v] == []
    sim.drain()
    assert [v for v in sim.violations if "unregister" in v] == []


def test_catches_a_weak_registry_of_stages(
    sim: SimCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutation: the registry weak again (the code before): the same cycle unregisters under
    the stage's queued copies."""
    import weakref

    monkeypatch.setattr(_pinning, "_tracked", weakref.WeakSet())
    monkeypatch.setattr(_prefetch.DeviceIterator, "__del__", lambda self: None)
    sim.copy_cost = (6, 9)
    loader = gpufeed.DataLoader(IndexDataset(400), batch_size=4, num_workers=2,
                                worker_type="thread", prefetch_factor=2, device="cuda")
    it = iter(loader)
    for _ in range(10):  # past the first batches (no slot yet: pinned the ordinary way)
        next(it)
    stage = it.inner  # type: ignore[attr-defined]
    stage._cycle = stage
    del it, stage
    gc.collect()
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
