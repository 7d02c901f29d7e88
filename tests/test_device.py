"""to_device: the stream/event/slot protocol (NOTE [ Device stage ] in gpufeed/_device.py).

CPU tests drive the protocol through a fake backend whose events the test completes by
hand; ``cuda``-marked tests run the real thing on a GPU.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections import namedtuple
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gpufeed import _pinning
from gpufeed._device import CudaBackend, PageableCopyWarning, SyncBackend, to_device

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass(frozen=True)
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    name: str


class FakeEvent:
    def __init__(self, backend: FakeBackend, stream: str) -> None:
        self.backend, self.stream, self.done = backend, stream, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.backend.log.append(("sync", self))
        self.done = True


class FakeBackend(SyncBackend):
    """Streams are names, copies are clones, events complete when the test says so."""

    def __init__(self, *, pinned: bool = True, needs_pinned: bool = True, auto: bool = False):
        super().__init__(torch.device("cuda", 0))
        self.pinned, self.needs_pinned, self.auto = pinned, needs_pinned, auto
        self.current, self.consumer = "consumer", "consumer"
        self.log: list[tuple[Any, ...]] = []
        self.events: list[FakeEvent] = []

    def new_stream(self) -> str:
        return "side"

    def current_stream(self) -> str:
        return self.consumer

    @contextmanager  # type: ignore[override]
    def use_stream(self, stream: Any) -> Any:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def record_event(self, stream: Any) -> FakeEvent:
        event = FakeEvent(self, stream)
        event.done = self.auto
        self.events.append(event)
        self.log.append(("record", stream, event))
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        self.log.append(("wait", stream, event))

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        self.log.append(("copy", self.current))
        return t.clone()

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        self.log.append(("record_stream", stream))

    def is_pinned(self, t: torch.Tensor) -> bool:
        return self.pinned

    def ops(self, kind: str) -> list[tuple[Any, ...]]:
        return [op for op in self.log if op[0] == kind]


class Source:
    """Yields batch i = tensor full of i; keeps no reference to what it yielded."""

    def __init__(self, n: int, shape: tuple[int, ...] = (4,)) -> None:
        self.n, self.shape, self.pulled, self.closed = n, shape, 0, 0
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def __iter__(self) -> Source:
        return self

    def __next__(self) -> torch.Tensor:
        if self.pulled == self.n:
            raise StopIteration
        t = torch.full(self.shape, float(self.pulled))
        self.refs.append(weakref.ref(t))
        self.pulled += 1
        return t

    def __len__(self) -> int:
        return self.n

    def close(self) -> None:
        self.closed += 1

    def alive(self) -> list[int]:
        return [i for i, r in enumerate(self.refs) if r() is not None]


def test_cpu_pass_through_keeps_order_types_and_tensors() -> None:
    x = torch.arange(6.0)
    batches = [
        (x, 1),
        [x, "a"],
        {"x": x, "meta": None},
        Pair(x, 2.5),
        Sample(x, x, "img"),
        x,
    ]
    out = list(to_device(batches, "cpu"))
    assert [type(b) for b in out] == [type(b) for b in batches]
    assert out[0] == (x, 1) and out[0][0] is x  # "cpu": the very same tensors
    assert out[2]["meta"] is None and out[3].y == 2.5 and out[4].name == "img"


def test_fake_cuda_copies_every_leaf_and_passes_other_leaves() -> None:
    backend = FakeBackend(auto=True)
    x = torch.arange(4.0)
    batch = {"pair": Pair(x, [x, 3]), "sample": Sample(x, x, "n"), "tag": "t"}
    (out,) = to_device([batch], "cuda", backend=backend)
    assert out["pair"].x is not x and torch.equal(out["pair"].x, x)
    assert out["pair"].y[1] == 3 and out["tag"] == "t" and out["sample"].name == "n"
    assert len(backend.ops("copy")) == 4


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_depth_bounds_batches_in_flight(depth: int) -> None:
    backend = FakeBackend(auto=True)
    src = Source(10)
    it = to_device(src, "cuda", depth=depth, backend=backend)
    for i in range(10):
        b = next(it)
        assert torch.equal(b, torch.full((4,), float(i)))  # order kept
        # rule (4): i+1..i+depth issued when batch i is returned, never more
        assert src.pulled == min(i + 1 + depth, 10)
        assert it.stats().in_flight == min(depth, 9 - i) <= depth
        assert it.stats().bytes_held == it.stats().in_flight * 16
    assert it.stats().peak_bytes_held == depth * 16
    with pytest.raises(StopIteration):
        next(it)
    assert it.stats().bytes_held == 0 and it.stats().batches == 10


def test_host_batch_released_only_after_its_copy_event() -> None:
    backend = FakeBackend()  # events stay pending until completed here
    src = Source(8)
    it = to_device(src, "cuda", depth=2, backend=backend)
    next(it)
    assert src.alive() == [0, 1, 2]  # batch 0 handed over, but its copy is not complete
    backend.events[0].done = True
    next(it)
    assert src.alive() == [1, 2, 3]  # 0 dropped once its copy event completed
    backend.events[1].done = backend.events[2].done = True
    next(it)
    assert src.alive() == [3, 4]
    backend.events[4].done = True  # out of order: the FIFO keeps 4 behind pending 3
    next(it)
    assert src.alive() == [3, 4, 5]
    assert not backend.ops("sync")  # no host wait: the depth + 1 bound was never exceeded


def test_host_batches_bounded_by_waiting_on_the_oldest_copy() -> None:
    backend = FakeBackend()
    src = Source(8)
    with to_device(src, "cuda", depth=2, backend=backend) as it:
        for _ in range(5):
            next(it)
            assert len(src.alive()) <= 3  # depth + 1
        syncs = backend.ops("sync")
        assert syncs and it.stats().host_waits == len(syncs)
        first_records = [op[2] for op in backend.ops("record")]
        assert [op[1] for op in syncs] == first_records[: len(syncs)]  # oldest first


def test_slot_recycled_only_after_copy_completed() -> None:
    """A ring slot returns when the host batch's last reference goes (a finalizer)."""
    backend = FakeBackend()
    released: list[int] = []
    early: list[int] = []

    def release(i: int) -> None:  # what the ring does when a slot's view is collected
        released.append(i)
        if not backend.events[i].done:  # one event per batch: no transform
            early.append(i)

    def batches() -> Any:
        for i in range(20):
            t = torch.zeros(4)
            weakref.finalize(t, release, i)
            yield t
            del t

    for n, _ in enumerate(to_device(batches(), "cuda", depth=3, backend=backend)):
        for e in backend.events[: n // 2]:  # the GPU completes copies late, in order
            e.done = True
    gc.collect()
    assert sorted(released) == list(range(20)) and early == []


def test_stream_protocol_for_one_batch() -> None:
    backend = FakeBackend(auto=True)
    seen: list[Any] = []

    def transform(batch: Any) -> Any:
        seen.append(backend.current)
        return [t * 2 for t in batch]

    x = torch.ones(3)
    it = to_device([[x, x]], "cuda", transform=transform, backend=backend)
    (out,) = list(it)
    assert torch.equal(out[0], x * 2) and seen == ["side"]
    kinds = [(op[0], op[1]) for op in backend.log]
    assert kinds == [
        ("copy", "side"),
        ("copy", "side"),
        ("record", "side"),  # E_copy: releases the host batch
        ("record", "side"),  # E_ready: after the transform
        ("wait", "consumer"),
        ("record_stream", "consumer"),
        ("record_stream", "consumer"),
    ]
    assert backend.ops("wait")[0][2] is backend.events[1]  # the consumer waits on E_ready


def test_consumer_stream_is_asked_at_each_handover() -> None:
    backend = FakeBackend(auto=True)
    it = to_device(Source(3), "cuda", backend=backend)
    next(it)
    backend.consumer = "other"
    next(it)
    assert [op[1] for op in backend.ops("wait")] == ["consumer", "other"]


def test_no_host_synchronize_in_steady_state() -> None:
    backend = FakeBackend(auto=True)
    assert len(list(to_device(Source(50), "cuda", backend=backend))) == 50
    assert backend.ops("sync") == []


def test_errors_are_raised_in_order_after_earlier_batches() -> None:
    def gen() -> Any:
        yield torch.zeros(1)
        yield torch.ones(1)
        raise KeyError("sample 7")

    it = to_device(gen(), "cuda", depth=4, backend=FakeBackend(auto=True))
    assert [float(b) for b in (next(it), next(it))] == [0.0, 1.0]
    with pytest.raises(KeyError, match="sample 7"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_transform_error_keeps_host_batch_until_copy_done() -> None:
    backend = FakeBackend()
    src = Source(3)

    def bad(batch: Any) -> Any:
        raise ValueError("bad transform")

    it = to_device(src, "cuda", transform=bad, backend=backend)
    with pytest.raises(ValueError, match="bad transform"):
        next(it)
    assert backend.ops("sync")  # exhaustion waited for the copy before dropping the batch
    assert src.alive() == []


def test_failed_copy_keeps_host_batch_until_earlier_leaves_are_copied() -> None:
    class Failing(FakeBackend):
        def copy(self, t: torch.Tensor) -> torch.Tensor:
            if len(self.ops("copy")) == 1:
                raise RuntimeError("CUDA out of memory")
            return super().copy(t)

    backend = Failing()
    it = to_device([[torch.zeros(2), torch.ones(2)]], "cuda", backend=backend)
    with pytest.raises(RuntimeError, match="out of memory"):
        next(it)
    # an event was recorded after the failed batch and waited for before it was dropped
    assert [op[0] for op in backend.log] == ["copy", "record", "sync"]


def test_pageable_source_is_counted_and_warned_once() -> None:
    loader = DataLoader(TensorDataset(torch.arange(20.0)), batch_size=4)  # not pinned
    it = to_device(loader, "cuda", backend=FakeBackend(pinned=False))
    with pytest.warns(PageableCopyWarning, match="pin_memory=True") as record:
        batches = list(it)
    assert len(record) == 1 and len(batches) == 5
    assert it.stats().pageable_batches == 5


def test_pinned_source_and_cpu_device_do_not_warn() -> None:
    for it in (to_device(Source(4), "cuda", backend=FakeBackend()), to_device(Source(4), "cpu")):
        assert len(list(it)) == 4 and it.stats().pageable_batches == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_over_a_stock_dataloader(workers: int) -> None:
    data = torch.arange(40.0).view(20, 2)
    loader = DataLoader(TensorDataset(data, torch.arange(20)), batch_size=3, num_workers=workers)
    it = to_device(loader, "cuda", backend=FakeBackend(auto=True, needs_pinned=False))
    assert len(it) == len(loader) == 7
    got = list(it)
    assert torch.equal(torch.cat([x for x, _ in got]), data)
    assert torch.equal(torch.cat([y for _, y in got]), torch.arange(20))


def test_len_needs_a_source_with_len() -> None:
    assert len(to_device([1, 2, 3], "cpu")) == 3
    with pytest.raises(TypeError, match="has no len"):
        len(to_device(iter([1]), "cpu"))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"depth": 0}, ValueError, "depth=0"),
        ({"depth": -3}, ValueError, ">= 1"),
        ({"depth": 1.5}, TypeError, "depth must be an int"),
        ({"depth": True}, TypeError, "depth must be an int"),
        ({"device": "cdua"}, ValueError, "'cuda', 'cuda:0' or 'cpu'"),
        ({"device": 2.0}, TypeError, "device must be"),
        ({"transform": 3}, TypeError, "transform must be callable"),
        ({"iterable": 5}, TypeError, "iterable of batches, got int"),
    ],
)
def test_argument_errors_name_the_value_and_fix(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    args: dict[str, Any] = {"iterable": [], "device": "cpu", **kwargs}
    with pytest.raises(error, match=match):
        to_device(args.pop("iterable"), args.pop("device"), **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_device_without_cuda_says_so() -> None:
    with pytest.raises(RuntimeError, match=r"CUDA is not available.*device='cpu'"):
        to_device([], "cuda")


def test_close_is_idempotent_waits_for_copies_and_closes_the_source() -> None:
    backend = FakeBackend()
    src = Source(10)
    with to_device(src, "cuda", backend=backend) as it:
        next(it)
        assert len(src.alive()) == 3
    assert src.alive() == [] and src.closed == 1
    assert all(e.done for e in backend.events)  # waited for, not just dropped
    it.close()
    assert src.closed == 1
    with pytest.raises(RuntimeError, match="closed"):
        next(it)


def test_garbage_collection_releases_but_leaves_the_source_open() -> None:
    backend = FakeBackend()
    src = Source(10)
    it = to_device(src, "cuda", backend=backend)
    next(it)
    del it
    gc.collect()
    assert src.alive() == [] and src.closed == 0
    assert all(e.done for e in backend.events)


def test_exhaustion_releases_but_leaves_the_source_open() -> None:
    src = Source(3)
    it = to_device(src, "cuda", backend=FakeBackend(auto=True))
    assert len(list(it)) == 3 and src.closed == 0
    it.close()
    with pytest.raises(StopIteration):
        next(it)


def test_recorder_gets_the_transfer_stage() -> None:
    calls: list[tuple[Any, ...]] = []

    class Recorder:
        def add(self, stage: str, busy_s: float = 0.0, blocked_s: float = 0.0) -> None:
            calls.append(("add", stage))

        def occupancy(self, stage: str, used: int, capacity: int) -> None:
            calls.append(("occupancy", stage, used, capacity))

        def count(self, name: str, k: int = 1) -> None:
            calls.append(("count", name))

    it = to_device(Source(3), "cuda", recorder=Recorder(), backend=FakeBackend(auto=True))
    list(it)
    assert calls.count(("add", "transfer")) == 3
    assert ("occupancy", "transfer", 2, 2) in calls


def test_over_gpufeed_dataloader_on_cpu() -> None:
    gpufeed = pytest.importorskip("gpufeed")
    if not hasattr(gpufeed, "DataLoader"):
        pytest.skip("the core loader is not there yet")
    data = torch.arange(2000 * 4, dtype=torch.int32).view(2000, 4)
    loader = gpufeed.DataLoader(
        gpufeed.ArrayDataset(data), batch_size=50, num_workers=2, device="cpu"
    )
    it = iter(loader)
    assert len(it) == 40
    assert torch.equal(torch.cat([b[0] for b in it]), data)
    assert it.stats().batches == 40


def test_gpu_benchmark_skips_cleanly_without_cuda(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour")
    from gpufeed.benchmarks import gpu

    assert gpu.main(["--out", str(tmp_path)]) == 0
    assert "no CUDA device: GPU benchmark skipped" in capsys.readouterr().out
    doc = gpu.run_gpu_benchmark(tmp_path / "gpu.json")
    assert doc["skipped"] == "no CUDA device: GPU benchmark skipped"
    assert doc["environment"]["torch"] == torch.__version__
    assert list(tmp_path.iterdir()) == []  # committed figures are never overwritten


# ---------------------------------------------------------------- CUDA (run on a GPU)


class PinnedRing:
    """A miniature of the loader's ring: a slot is free again when its batch view is gone."""

    def __init__(self, slots: int, numel: int) -> None:
        self.buf = torch.empty(slots, numel, dtype=torch.int32)
        self.handle = _pinning.register(self.buf)
        self.free = list(range(slots))
        self.fallbacks = 0

    def batch(self, i: int, base: torch.Tensor, on_release: Any = None) -> torch.Tensor:
        if self.free:
            k = self.free.pop()
            view = self.buf[k]
            weakref.finalize(view, self._release, k, i, on_release)
        else:
            self.fallbacks += 1
            view = torch.empty_like(base).pin_memory()
        torch.add(base, i, out=view)  # the CPU writes the slot, as a worker would
        return view

    def _release(self, k: int, i: int, on_release: Any) -> None:
        if on_release is not None:
            on_release(i)
        self.free.append(k)

    def close(self) -> None:
        _pinning.unregister(self.handle)


class RingSource:
    def __init__(self, ring: PinnedRing, n: int, base: torch.Tensor, on_release: Any = None):
        self.ring, self.n, self.base, self.i, self.on_release = ring, n, base, 0, on_release

    def __iter__(self) -> RingSource:
        return self

    def __next__(self) -> torch.Tensor:
        if self.i == self.n:
            raise StopIteration
        self.i += 1
        return self.ring.batch(self.i - 1, self.base, self.on_release)


@pytest.mark.cuda
@pytest.mark.parametrize("slow_side_stream", [False, True])
def test_cuda_non_blocking_equals_synchronous_under_load(slow_side_stream: bool) -> None:
    n, numel, depth = 1200, 1 << 18, 2
    base = torch.randint(0, 1 << 20, (numel,), dtype=torch.int32)
    ring = PinnedRing(depth + 2, numel)
    heavy = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()

    def slow(batch: torch.Tensor) -> torch.Tensor:  # keeps the side stream busy too
        heavy @ heavy
        return batch

    sums_async = torch.empty(n, dtype=torch.int64, device="cuda")
    transform = slow if slow_side_stream else None
    it = to_device(RingSource(ring, n, base), "cuda", depth=depth, transform=transform)
    for i, x in enumerate(it):
        heavy @ heavy  # the consumer stream is kept busy: the race of naive prefetchers
        sums_async[i] = x.sum(dtype=torch.int64)
    sums_sync = torch.empty(n, dtype=torch.int64, device="cuda")
    for i, host in enumerate(RingSource(ring, n, base)):
        sums_sync[i] = host.to("cuda").sum(dtype=torch.int64)
    expected = base.sum(dtype=torch.int64) + torch.arange(n, dtype=torch.int64) * numel
    assert torch.equal(sums_async.cpu(), expected)
    assert torch.equal(sums_sync.cpu(), expected)
    assert it.stats().pageable_batches == 0
    ring.close()


@pytest.mark.cuda
def test_cuda_no_slot_reused_before_its_copy_completed() -> None:
    events: dict[int, torch.cuda.Event] = {}
    early: list[int] = []

    class Tracking(CudaBackend):
        copying = False

        def copy(self, t: torch.Tensor) -> torch.Tensor:
            self.copying = True
            return super().copy(t)

        def record_event(self, stream: Any) -> Any:
            event = super().record_event(stream)
            if self.copying:  # the first event after a batch's copies is its E_copy
                events[len(events)] = event
                self.copying = False
            return event

    heavy = torch.randn(2048, 2048, device="cuda")

    def slow(batch: torch.Tensor) -> torch.Tensor:
        heavy @ heavy
        return batch

    def on_release(i: int) -> None:
        if not events[i].query():
            early.append(i)

    numel = 1 << 20
    ring = PinnedRing(4, numel)
    base = torch.zeros(numel, dtype=torch.int32)
    src = RingSource(ring, 300, base, on_release)
    dev = torch.device("cuda", torch.cuda.current_device())
    for x in to_device(src, dev, depth=2, transform=slow, backend=Tracking(dev)):
        heavy @ heavy
        del x
    gc.collect()
    torch.cuda.synchronize()
    assert early == [] and len(events) == 300
    ring.close()


@pytest.mark.cuda
def test_cuda_memory_returns_to_start_after_close() -> None:
    gc.collect()
    torch.cuda.synchronize()
    dev_start = torch.cuda.memory_allocated()
    numel = 1 << 20  # 4 MiB per int32 batch
    ring = PinnedRing(4, numel)
    base = torch.zeros(numel, dtype=torch.int32)
    assert _pinning.is_pinned(ring.buf)
    it = to_device(RingSource(ring, 100, base), "cuda", depth=3)
    peak = 0
    for i, x in enumerate(it):
        peak = max(peak, torch.cuda.memory_allocated() - dev_start)
        del x
        if i == 50:
            break
    assert it.stats().bytes_held == 3 * 4 * numel
    assert peak <= (3 + 1) * 4 * numel  # depth batches in flight + the one in use
    it.close()
    del it
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == dev_start
    assert ring.free and len(ring.free) == 4  # every slot came back
    ring.close()
    assert not _pinning.is_pinned(ring.buf)  # page-locked memory released


@pytest.mark.cuda
def test_cuda_pageable_copy_is_reported() -> None:
    batches = [torch.zeros(1 << 16) for _ in range(3)]
    it = to_device(batches, "cuda")
    with pytest.warns(PageableCopyWarning, match="pageable"):
        out = list(it)
    assert it.stats().pageable_batches == 3 and out[0].is_cuda


@pytest.mark.cuda
def test_cuda_consumer_on_a_side_stream_of_its_own() -> None:
    loader = DataLoader(TensorDataset(torch.arange(4096.0)), batch_size=64, pin_memory=True)
    stream = torch.cuda.Stream()
    total = torch.zeros((), device="cuda")
    stream.wait_stream(torch.cuda.current_stream())  # `total` was zeroed on the default stream
    with torch.cuda.stream(stream):
        for (x,) in to_device(loader, "cuda"):
            total += x.sum()
    stream.synchronize()
    assert float(total) == float(torch.arange(4096.0).sum())


@pytest.mark.cuda
def test_cuda_gpufeed_dataloader_pinned_ring_end_to_end() -> None:
    import gpufeed

    batches, bs, width = 1100, 64, 256
    data = torch.randint(0, 1 << 20, (batches * bs, width), dtype=torch.int32)
    expected = data.view(batches, bs, width).sum((1, 2), dtype=torch.int64)
    loader = gpufeed.DataLoader(
        gpufeed.ArrayDataset(data), batch_size=bs, num_workers=2, pin_memory=True, device="cuda"
    )
    heavy = torch.randn(2048, 2048, device="cuda")
    sums = torch.empty(batches, dtype=torch.int64, device="cuda")
    it = iter(loader)
    for i, batch in enumerate(it):
        heavy @ heavy  # keep the consumer stream busy while slots are recycled
        sums[i] = batch[0].sum(dtype=torch.int64)
    assert torch.equal(sums.cpu(), expected)
    assert it.stats().pageable_batches == 0  # the ring is page-locked


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_gpu_benchmark_runs_and_shows_overlap(tmp_path: Any) -> None:
    from gpufeed.benchmarks import gpu

    doc = gpu.run_gpu_benchmark(
        tmp_path / "gpu.json", batch_size=32, batches=8, repeats=1, num_workers=2,
        overlap_steps=50,
    )
    assert (tmp_path / "gpu.json").exists() and doc["environment"]["gpu"]
    assert all(v is None or v > 0 for v in doc["bandwidth"]["gb_per_s"].values())
    overlap = doc["overlap"]
    assert overlap["naive_over_T"] > 1.5 and overlap["to_device_over_T"] < 1.3
    assert "GB/s" in gpu.render_markdown(doc)
