"""The device stage end to end on a simulated asynchronous GPU (``sim_cuda.SimCuda``).

The consumer's work runs on the consumer stream, late, in seeded random interleavings with
the side stream's copies and transforms: a missing or misplaced synchronisation in
``DeviceIterator`` (NOTE [ Device stage: streams, events and slots ] in
gpufeed/_device/prefetch.py) shows as a wrong checksum or a recorded violation. The mutation
tests break one rule at a time to show that it does.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import gpufeed
from gpufeed._device import prefetch as _prefetch
from gpufeed._device.stage import to_device
from support.fakes import IndexDataset
from support.procs import deadline
from support.sim_cuda import SimCuda

WIDTH = 64  # floats per batch in the plain source
BATCH_BYTES = WIDTH * 4 + 8  # x (float32) and y (one int64)


def checksum(x: torch.Tensor, y: torch.Tensor) -> tuple[int, float]:
    return int(y.reshape(-1)[0]), float(x.double().sum())


class Source:
    """Batch i: ``{"x": arange(WIDTH) + i * WIDTH, "y": [i]}``; its checksum is taken when it
    is made (after ``host_fn``, the host twin of the transform). Keeps no reference to it."""

    def __init__(self, n: int, host_fn: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self.n, self.i, self.host_fn = n, 0, host_fn
        self.expected: list[tuple[int, float]] = []

    def __iter__(self) -> Source:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.i == self.n:
            raise StopIteration
        x = torch.arange(WIDTH, dtype=torch.float32) + self.i * WIDTH
        y = torch.tensor([self.i])
        fx = x if self.host_fn is None else self.host_fn(x)
        self.expected.append(checksum(fx, y))
        self.i += 1
        return {"x": x, "y": y}


def affine_host(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def affine(sim: SimCuda) -> Callable[[Any], Any]:
    """A transform as on CUDA: outputs allocated now, kernels enqueued on the current
    (side) stream, run later."""

    def transform(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = batch["x"]
        out = sim.empty(x.shape, torch.float32)

        def affine_kernel(src: torch.Tensor, dst: torch.Tensor) -> None:
            dst.copy_(src * 2 + 1)

        sim.launch(None, affine_kernel, x, out)
        return {"x": out, "y": batch["y"]}

    return transform


def consume(sim: SimCuda, batches: Any, cost: int, *, drop: bool = False) -> list[Any]:
    """The training loop: one kernel of ``cost`` steps per batch on the consumer stream,
    which records the checksum of what it reads when it runs. Then the GPU catches up.
    ``drop``: free each batch before asking for the next (a plain loop still holds it)."""
    seen: list[tuple[int, float]] = []

    def step_kernel(x: torch.Tensor, y: torch.Tensor) -> None:
        seen.append(checksum(x, y))

    for batch in batches:
        sim.launch(sim.consumer, step_kernel, batch["x"], batch["y"], cost=cost)
        if drop:
            del batch
    sim.drain()
    return seen


def problems(sim: SimCuda, seen: list[Any], expected: list[Any]) -> list[str]:
    out = list(dict.fromkeys(sim.violations))[:5]
    for k, (got, want) in enumerate(itertools.zip_longest(seen, expected)):
        if got != want:
            out.append(f"batch {k}: consumer saw {got}, expected {want}")
    return out


# Two regimes, each a stress for one race: a slow consumer stream (memory the consumer still
# reads must not be reused: record_stream) and slow copies (the consumer must not read a
# batch before its copy: wait_event). Values: (consumer kernel steps, copy steps lo..hi).
REGIMES = {"slow_consumer": (6, (1, 3)), "slow_copies": (1, (1, 8))}


def run(seed: int, depth: int, regime: str, *, n: int = 1000,
        transform: bool = False) -> tuple[SimCuda, list[str]]:
    cost, copy_cost = REGIMES[regime]
    sim = SimCuda(seed, max_steps=1 + seed % 3, copy_cost=copy_cost)
    src = Source(n, affine_host if transform else None)
    it = to_device(src, "cuda", depth=depth, backend=sim,
                   transform=affine(sim) if transform else None)
    seen = consume(sim, it, cost)
    return sim, problems(sim, seen, src.expected)


@pytest.fixture(autouse=True)
def _deadline() -> Iterator[None]:
    with deadline(60):
        yield


# -- 1. the protocol holds ---------------------------------------------------------------------
@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_consumer_sees_every_batch_intact(seed: int, depth: int, regime: str) -> None:
    sim, bad = run(seed, depth, regime)
    assert bad == []
    assert sim.reuses > 10 * sim.allocs  # device memory was recycled, not fresh every time


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize(("seed", "depth"), [(2, 1), (3, 2)])
def test_with_a_transform_on_the_side_stream(seed: int, depth: int, regime: str) -> None:
    _, bad = run(seed, depth, regime, n=400, transform=True)
    assert bad == []


def test_harness_interleaves_and_lags() -> None:
    """Not vacuous: the consumer really runs behind the CPU, and copies really run late."""
    sim = SimCuda(0, max_steps=2)
    it = to_device(Source(300, None), "cuda", depth=2, backend=sim)
    lag = []
    for batch in it:
        sim.launch(sim.consumer, lambda x: None, batch["x"], cost=6)
        lag.append(len(sim.consumer.ops))
    sim.drain()
    assert max(lag) >= 4 and it.stats().consumer_waits > 0 and it.stats().host_waits > 0


# -- 2. over gpufeed.DataLoader, ring slots recycled --------------------------------------------
class Tap:
    """Passes the loader's batches through, holding none of them; notes its ring's counters."""

    def __init__(self, it: Any) -> None:
        self.it, self.ring = it, {}

    def __iter__(self) -> Tap:
        return self

    def __next__(self) -> Any:
        return next(self.it)

    def close(self) -> None:
        self.ring = self.it.ring_info()
        self.it.close()


def loader_run(worker_type: str, seed: int, depth: int, regime: str, n: int = 1000,
               bs: int = 4) -> tuple[SimCuda, Tap, list[str]]:
    cost, copy_cost = REGIMES[regime]
    loader = gpufeed.DataLoader(  # an explicit prefetch_factor: a small ring (6 slots)
        IndexDataset(n * bs), batch_size=bs, num_workers=2, worker_type=worker_type,
        prefetch_factor=2,
    )
    tap = Tap(iter(loader))
    sim = SimCuda(seed, max_steps=1 + seed % 3, copy_cost=copy_cost)
    try:
        seen = consume(sim, to_device(tap, "cuda", depth=depth, backend=sim), cost)
    finally:
        tap.close()
    expected = [
        checksum(torch.arange(16 * bs, dtype=torch.float32) + k * 16 * bs, torch.tensor([k * bs]))
        for k in range(n)
    ]
    return sim, tap, problems(sim, seen, expected)


@pytest.mark.parametrize(("seed", "depth", "regime"), [(0, 1, "slow_copies"),
                                                       (1, 4, "slow_consumer")])
def test_over_gpufeed_dataloader_with_recycled_slots(
    worker_type: str, seed: int, depth: int, regime: str
) -> None:
    _, tap, bad = loader_run(worker_type, seed, depth, regime)
    assert bad == []
    # 1000 batches, most of them in a few recycled slots (the rest: no slot was free)
    assert tap.ring["grows"] <= 8 and tap.ring["fallbacks"] <= 100, tap.ring


# -- 3. mutations: each broken rule is caught --------------------------------------------------
def caught(regime: str, **kw: Any) -> list[int]:
    """The seeds (of 0, 1, 2) whose run at depth 2 shows a problem."""
    return [s for s in range(3) if run(s, 2, regime, n=200, **kw)[1]]


def test_catches_a_missing_wait_on_handover(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SimCuda, "wait_event", lambda self, stream, event: None)
    assert caught("slow_copies") == [0, 1, 2]


def test_catches_a_missing_record_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SimCuda, "record_stream", lambda self, t, stream: None)
    assert caught("slow_consumer") == [0, 1, 2]
    _, bad = run(0, 2, "slow_consumer", n=200)
    assert any("memory was reused" in p for p in bad)


def test_catches_a_host_batch_released_before_its_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_prefetch, "pop_completed",
                        lambda fifo: [fifo.popleft() for _ in range(len(fifo))])
    assert caught("slow_copies") == [0, 1, 2]
    _, _, bad = loader_run("thread", 0, 2, "slow_copies", n=200)
    assert any("host tensor was released before the copy ran" in p for p in bad)


def test_catches_a_transform_queued_off_the_side_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The transform's kernel on another stream: E_ready does not cover it, so the consumer
    may read the output before it is written."""
    real = SimCuda.launch

    def launch_elsewhere(self: SimCuda, stream: Any, *args: Any, **kw: Any) -> None:
        if stream is None:  # the transform's kernel
            stream = next((s for s in self.streams if s.name == "other"), None)
            if stream is None:
                stream = self.new_stream()
                stream.name = "other"
        real(self, stream, *args, **kw)

    monkeypatch.setattr(SimCuda, "launch", launch_elsewhere)
    assert caught("slow_copies", transform=True) == [0, 1, 2]


# -- 4. device memory bound (rule 8) -----------------------------------------------------------
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_device_memory_bounded_when_the_consumer_is_far_behind(depth: int) -> None:
    """2 * depth + 1 batches when the loop frees each batch before the next next(); a plain
    ``for`` loop still holds the previous batch while next() issues one: one batch more."""
    for drop, bound in ((True, 2 * depth + 1), (False, 2 * depth + 2)):
        sim = SimCuda(depth, max_steps=2)
        it = to_device(Source(200, None), "cuda", depth=depth, backend=sim)
        seen = consume(sim, it, cost=60, drop=drop)
        assert len(seen) == 200 and sim.violations == []
        assert it.stats().consumer_waits > 150  # the consumer was far behind
        assert sim.peak_bytes <= bound * BATCH_BYTES, (drop, sim.peak_bytes / BATCH_BYTES)


def test_memory_bound_needs_the_consumer_marks() -> None:
    """Not vacuous: without rule 8's marks the same run needs far more device memory."""
    sim = SimCuda(2, max_steps=2)
    it = to_device(Source(200, None), "cuda", depth=2, backend=sim)
    it._marks = deque(maxlen=0)  # appends vanish: no consumer waits
    consume(sim, it, cost=60, drop=True)
    assert it.stats().consumer_waits == 0 and sim.peak_bytes > 20 * BATCH_BYTES
