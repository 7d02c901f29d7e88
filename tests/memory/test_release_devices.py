"""Release fences on every device and stream a user's copy can use (NOTE [ Slot lifetime ] (a)),
on the simulated CUDA runtime with several devices and per-thread current streams.

``DataLoader(pin_memory=True)`` and the user's own ``non_blocking`` copies: to another device
than the current one (a model on ``cuda:1``), scattered to every device (``nn.DataParallel``),
or with the batch dropped on another thread (a collection, a queue consumer) whose current
stream is not the consumer's. Each test failed on the code before per-device fences and the
hand-out stream; ``test_catches_*`` break one rule and see the failure.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import gpufeed
from gpufeed._base import cuda as _cuda
from gpufeed._memory import pinning as _pinning
from support.fakes import IndexDataset
from support.procs import deadline
from support.release_checks import Dropper, batch_sum, expected, problems, recorder
from support.sim_cuda import SimCuda


@pytest.fixture(autouse=True)
def _deadline() -> Iterator[None]:
    with deadline(90):
        yield


@pytest.fixture(params=[False, True], ids=["cpu-driven", "background-gpu"])
def sim(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[SimCuda]:
    """Two devices; the GPU advances when the CPU calls CUDA, or also on its own thread."""
    sim = SimCuda(0, max_steps=2, copy_cost=(1, 3), devices=2, background=request.param)
    sim.install(monkeypatch)
    yield sim
    sim.stop_background()
    sim.drain()


def loader_of(n_batches: int, bs: int = 4, **kw: Any) -> gpufeed.DataLoader:
    kw.setdefault("worker_type", "thread")
    return gpufeed.DataLoader(IndexDataset(n_batches * bs), batch_size=bs, num_workers=2,
                              prefetch_factor=2, pin_memory=True, **kw)


# -- 1. another device than the current one ------------------------------------------------------
def model_on_cuda1(sim: SimCuda, loader: Any) -> list[tuple[int, float]]:
    """The current device stays 0; the model lives on cuda:1, so the copies go there."""
    seen: list[tuple[int, float]] = []
    step = recorder(seen)
    for batch in loader:
        x = batch["x"].to("cuda:1", non_blocking=True)
        y = batch["y"].to("cuda:1", non_blocking=True)
        del batch
        sim.launch(sim.current_of(1), step, x, y, cost=6)
    sim.drain()
    return seen


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_copies_to_another_device_are_fenced(sim: SimCuda, worker_type: str) -> None:
    sim.launch(sim.consumer, lambda t: None, sim.empty((1,), torch.uint8), cost=1)  # context 0
    seen = model_on_cuda1(sim, loader_of(300, worker_type=worker_type))
    assert problems(sim, seen, expected(300, 4)) == []
    assert sim.registered == {}  # unregistered once their copies had run


def test_catches_fences_on_the_rings_device_only(
    sim: SimCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutation: fence the ring's own device only (the code before): cuda:1's copies read
    recycled slots."""
    monkeypatch.setattr(_cuda, "_has_context", lambda index: index == 0)
    sim.launch(sim.consumer, lambda t: None, sim.empty((1,), torch.uint8), cost=1)
    seen = model_on_cuda1(sim, loader_of(300))
    assert any("differ" in p or "unregister" in p for p in problems(sim, seen, expected(300, 4)))


def test_a_batch_scattered_to_every_device_is_fenced_on_each(sim: SimCuda) -> None:
    """``nn.DataParallel``'s scatter: each device copies its share on its own current stream."""
    parts: dict[int, list[tuple[int, float]]] = {0: [], 1: []}
    for batch in loader_of(200, bs=4):
        shares = [(d, batch["x"][2 * d:2 * d + 2].to(f"cuda:{d}", non_blocking=True),
                   batch["y"][2 * d:2 * d + 2].to(f"cuda:{d}", non_blocking=True))
                  for d in (0, 1)]
        del batch
        for d, x, y in shares:
            sim.launch(sim.current_of(d), recorder(parts[d]), x, y, cost=5)
    sim.drain()
    for d in (0, 1):
        want = [(4 * k + 2 * d, batch_sum(4 * k + 2 * d, 2)) for k in range(200)]
        assert problems(sim, parts[d], want) == [], f"device {d}"


# -- 2. dropped on another thread ----------------------------------------------------------------
def dropped_elsewhere(sim: SimCuda, loader: Any) -> list[tuple[int, float]]:
    """The loop runs on a stream of its own; each host batch is dropped by another thread (a
    queue consumer, or a collection that happens to run there), whose current stream is the
    default one."""
    other = sim.new_stream()
    seen: list[tuple[int, float]] = []
    step = recorder(seen)
    dropper = Dropper()
    with sim.use_stream(other):
        for batch in loader:
            x, y = batch["x"].cuda(non_blocking=True), batch["y"].cuda(non_blocking=True)
            sim.launch(None, step, x, y, cost=6)
            dropper.give(batch)
            del batch
            dropper.wait()
    dropper.stop()
    sim.drain()
    return seen


def test_a_release_on_another_thread_fences_the_consumers_stream(sim: SimCuda) -> None:
    seen = dropped_elsewhere(sim, loader_of(300))
    assert problems(sim, seen, expected(300, 4)) == []


def test_catches_a_fence_on_the_releasing_threads_stream_only(
    sim: SimCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutation: forget the stream the batch was handed out on (the code before)."""
    from gpufeed._memory import ring as _ring

    real = _ring.SlotRing.hand_out
    monkeypatch.setattr(_ring.SlotRing, "hand_out",
                        lambda self, sid, streams: real(self, sid, streams=False))
    seen = dropped_elsewhere(sim, loader_of(300))
    assert any("differ" in p for p in problems(sim, seen, expected(300, 4)))


# -- 3. what a release costs -----------------------------------------------------------------------
def calls_per_batch(sim: SimCuda, monkeypatch: pytest.MonkeyPatch, devices_used: int) -> dict:
    """CUDA events, device guards and pointer probes of the plain idiom, per batch held in a
    ring slot and per batch pinned the ordinary way (the ring full of fenced slots), with
    ``devices_used`` devices holding a context."""
    guards = probes = 0
    real_guard, real_probe = _cuda.device_guard, _pinning._pinned_ptr

    def guard(index: int | None) -> Any:
        nonlocal guards
        guards += 1
        return real_guard(index)

    def probe(ptr: int) -> bool:
        nonlocal probes
        probes += 1
        return real_probe(ptr)

    monkeypatch.setattr(_cuda, "device_guard", guard)
    monkeypatch.setattr(_pinning, "_pinned_ptr", probe)
    for d in range(devices_used):
        sim.launch(sim.consumers[d], lambda t: None, sim.empty((1,), torch.uint8), cost=1)
        sim.contexts.add(d)  # the user's model lives there
    n = 200
    it = iter(loader_of(n))
    for _ in range(20):  # past the first batches, which were pinned the ordinary way
        next(it)
    sim.calls.clear()
    guards = probes = in_ring = 0
    for batch in itertools.islice(it, n - 40):
        x = batch["x"].cuda(non_blocking=True)
        in_ring += sim._is_registered(batch["x"].data_ptr(), batch["x"].numel() * 4)
        del batch
        sim.launch(None, lambda t: None, x, cost=2)
    events = sum(1 for c in sim.calls if c[0] == "event")
    carved = sum(1 for c in sim.calls if c[0] == "register")  # one guard and probe each
    it.close()  # type: ignore[attr-defined]
    return {"in_ring": in_ring, "ordinary": n - 40 - in_ring, "events": events,
            "guards": guards - carved, "probes": probes - carved}


@pytest.mark.parametrize("devices_used", [1, 8])
def test_a_release_costs_one_event_per_device_and_no_guard_or_probe(
    monkeypatch: pytest.MonkeyPatch, devices_used: int
) -> None:
    """A batch in a ring slot: one event per device with a context at its release, no device
    guard, no pointer probe (the code before: a guard and two probes per leaf, and the ring's
    device only). A batch pinned the ordinary way: its two leaves checked under a guard."""
    sim = SimCuda(0, max_steps=2, devices=8)
    sim.install(monkeypatch)
    cost = calls_per_batch(sim, monkeypatch, devices_used)
    assert cost["in_ring"] > 100, cost
    assert cost["events"] == devices_used * cost["in_ring"], cost
    assert cost["guards"] <= 2 * cost["ordinary"] and cost["probes"] <= 4 * cost["ordinary"], cost
    sim.drain()


def test_a_release_while_its_hand_out_stream_captures_a_graph_is_parked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop runs on stream ``s``; a batch is dropped on another thread (whose current
    stream is the default one) while ``s`` captures a CUDA graph: no event may be recorded on
    ``s`` (it would be part of the graph); the slot is parked, and fenced once the capture is
    over, with its copy still covered."""
    sim = SimCuda(0, max_steps=2, devices=1)
    sim.install(monkeypatch)
    other = sim.new_stream()
    seen: list[tuple[int, float]] = []
    dropper = Dropper()
    it = iter(loader_of(60))
    parked = 0
    k = -1
    with sim.use_stream(other):
        for batch in itertools.islice(it, 40):  # not enumerate: its tuple holds the batch
            k += 1
            x, y = batch["x"].cuda(non_blocking=True), batch["y"].cuda(non_blocking=True)
            sim.launch(None, recorder(seen), x, y, cost=6)
            sim.capturing_streams = {other} if k % 3 == 0 else set()
            dropper.give(batch)
            del batch
            dropper.wait()
            sim.capturing_streams = set()
            parked += len(it._ring._parked)  # type: ignore[attr-defined]
    dropper.stop()
    it.close()  # type: ignore[attr-defined]
    sim.drain()
    assert [v for v in sim.violations if "captures" in v] == []
    assert parked > 0
    assert problems(sim, seen, expected(40, 4)) == []
