"""to_device: the stream/event/slot protocol (NOTE [ Device stage: streams, events and slots ]
in gpufeed/_device/prefetch.py), its backends (_device/streams.py) and the detection of copies
that cannot overlap (_device/pageable.py).

CPU tests drive the protocol through a fake backend whose events the test completes by
hand; ``cuda``-marked tests run the real thing on a GPU.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import weakref
from collections import namedtuple
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gpufeed._device.pageable import PageableCopyWarning, is_dense, staged_reason
from gpufeed._device.stage import to_device
from gpufeed._device.streams import CudaBackend, SyncBackend
from gpufeed._memory import pinning as _pinning
from support.cuda_memory import at_rest

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
    """Streams are names, copies are clones, events complete when the test says so.

    ``events``: side-stream events (E_copy, E_ready) in order, pending unless ``auto``.
    ``marks``: consumer-stream events (rule 8), complete at once unless ``consumer_auto``
    is False (a GPU that lags behind the CPU). ``resident``: tensors treated as already on
    the device.
    """

    def __init__(
        self, *, pinned: bool = True, needs_pinned: bool = True, auto: bool = False,
        consumer_auto: bool = True, resident: tuple[torch.Tensor, ...] = (),
    ) -> None:
        super().__init__(torch.device("cuda", 0))
        self.pinned, self.needs_pinned, self.auto = pinned, needs_pinned, auto
        self.consumer_auto, self.resident = consumer_auto, resident
        self.current, self.consumer = "consumer", "consumer"
        self.log: list[tuple[Any, ...]] = []
        self.events: list[FakeEvent] = []
        self.marks: list[FakeEvent] = []

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
        if stream == "side":
            event.done = self.auto
            self.events.append(event)
        else:
            event.done = self.consumer_auto
            self.marks.append(event)
        self.log.append(("record", stream, event))
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        self.log.append(("wait", stream, event))

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        self.log.append(("copy", self.current))
        return t.clone()

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        self.log.append(("record_stream", stream))

    def on_device(self, t: torch.Tensor) -> bool:
        return any(t is r for r in self.resident)

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
        assert [op[1] for op in syncs] == backend.events[: len(syncs)]  # oldest first


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
        ("record", "consumer"),  # next() again: M, what the user queued on batch 0 (rule 8)
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


class Flaky(Source):
    """Batch 1 raises; the batches after it come as usual (a worker's error in a loader)."""

    def __next__(self) -> torch.Tensor:
        if self.pulled == 1:
            self.pulled += 1
            self.refs.append(weakref.ref(torch.empty(0)))
            raise ValueError("batch 1 failed")
        return super().__next__()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_source_error_comes_in_order_and_the_batches_after_it_follow(depth: int) -> None:
    """The error comes after the batches before it; a loop that catches it goes on with the
    batches after it (it used to end there, losing them), and nothing is pulled past the error
    before it was raised."""
    backend = FakeBackend()
    src = Flaky(5)
    it = to_device(src, "cuda", depth=depth, backend=backend)
    outcomes: list[Any] = []
    while True:
        try:
            outcomes.append(int(next(it)[0]))
        except StopIteration:
            break
        except ValueError as exc:
            outcomes.append(str(exc))
            assert src.pulled == 2, "pulled past the error before raising it"
    assert outcomes == [0, "batch 1 failed", 2, 3, 4]
    assert src.alive() == []


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
        gpufeed.sources.ArrayDataset(data), batch_size=50, num_workers=2, device="cpu"
    )
    it = iter(loader)
    assert len(it) == 40
    assert torch.equal(torch.cat([b[0] for b in it]), data)
    assert it.stats().batches == 40


def test_gpu_benchmark_skips_cleanly_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour")
    from gpufeed._tools import bench_gpu as gpu

    doc = gpu.run_gpu_benchmark()
    assert doc["skipped"] == "no CUDA device: GPU benchmark skipped"
    assert doc["environment"]["torch"] == torch.__version__


def test_consumer_lag_is_bounded_by_depth() -> None:
    """Rule (8): the CPU may run at most `depth` steps ahead of the consumer stream, else
    freed batches cannot be reused and every new batch needs fresh device memory."""
    backend = FakeBackend(auto=True, consumer_auto=False)  # the GPU never catches up
    it = to_device(Source(12), "cuda", depth=2, backend=backend)
    next(it)
    assert backend.marks == []  # nothing was queued on a batch before the first one
    for _ in range(3):
        next(it)
    # M1..M3 recorded on the consumer stream; issuing with 3 unfinished waited for M1
    assert [op[1].stream for op in backend.ops("sync")] == ["consumer"]
    assert backend.ops("sync")[0][1] is backend.marks[0]
    assert it.stats().consumer_waits == 1 and it.stats().host_waits == 0
    for _ in range(5):
        next(it)
        assert sum(not m.done for m in backend.marks) <= 2
    assert it.stats().consumer_waits == len(backend.marks) - 2  # oldest first, one per step
    it.close()


def test_consumer_that_keeps_up_is_never_waited_for() -> None:
    backend = FakeBackend(auto=True)  # consumer marks complete at once
    assert len(list(to_device(Source(20), "cuda", depth=2, backend=backend))) == 20
    assert len(backend.marks) == 20 and backend.ops("sync") == []


def test_consumer_waits_are_recorded_apart_from_transfer_waits() -> None:
    counts: dict[str, int] = {}

    class Recorder:
        def add(self, stage: str, busy_s: float = 0.0, blocked_s: float = 0.0) -> None:
            pass

        def occupancy(self, stage: str, used: int, capacity: int) -> None:
            pass

        def count(self, name: str, k: int = 1) -> None:
            counts[name] = counts.get(name, 0) + k

    backend = FakeBackend(auto=True, consumer_auto=False)
    it = to_device(Source(8), "cuda", depth=1, recorder=Recorder(), backend=backend)
    list(it)
    assert counts["consumer_waits"] == it.stats().consumer_waits > 0


def test_device_resident_leaves_wait_for_the_consumer_and_are_protected() -> None:
    """Rule (9): a leaf already on the device is read by the transform on the side stream:
    the side stream waits for the consumer (which may have produced it) and the leaf gets
    record_stream(side), so dropping it cannot recycle memory the transform still reads."""
    on_gpu = torch.ones(3)
    backend = FakeBackend(auto=True, resident=(on_gpu,))
    seen: list[Any] = []

    def transform(batch: Any) -> Any:
        seen.append(backend.current)
        return [t + 1 for t in batch]

    it = to_device([[on_gpu, torch.zeros(2)]], "cuda", transform=transform, backend=backend)
    (out,) = list(it)
    kinds = [(op[0], op[1]) for op in backend.log]
    assert kinds[:5] == [
        ("record", "consumer"),  # what the consumer queued so far (it may produce on_gpu)
        ("wait", "side"),  # the side stream waits for it before the transform reads on_gpu
        ("record_stream", "side"),  # on_gpu is read on the side stream
        ("copy", "side"),  # only the host leaf is copied
        ("record", "side"),
    ]
    assert backend.ops("wait")[0][2] is backend.marks[0] and seen == ["side"]
    assert torch.equal(out[0], on_gpu + 1)
    assert it.stats().bytes_copied == 8  # the host leaf's bytes; on_gpu was not sent


def test_host_only_batches_never_wait_for_the_consumer_when_issued() -> None:
    backend = FakeBackend(auto=True)
    list(to_device(Source(3), "cuda", backend=backend))
    assert [op[1] for op in backend.ops("wait")] == ["consumer"] * 3  # handovers only


@pytest.mark.parametrize(
    ("make", "dense"),
    [
        (lambda: torch.zeros(4, 6), True),
        (lambda: torch.zeros(4, 6).t(), True),  # permuted: torch copies it as it is
        (lambda: torch.zeros(2, 3, 4, 5).permute(0, 2, 3, 1), True),  # channels_last
        (lambda: torch.zeros(4, 6)[:, ::2], False),
        (lambda: torch.zeros(4, 6)[:, :3], False),
        (lambda: torch.zeros(1, 6).expand(4, 6), False),  # stride 0
        (lambda: torch.zeros(4, 1, 6)[:, :, 1:3], False),
        (lambda: torch.zeros(4, 6)[1:3], True),
        (lambda: torch.zeros(0, 6), True),
    ],
)
def test_is_dense(make: Any, dense: bool) -> None:
    assert is_dense(make()) is dense


def test_staged_reasons() -> None:
    x = torch.zeros(4, 6)
    assert staged_reason(x, True) is None
    assert "pageable" in str(staged_reason(x, False))
    assert "non-dense" in str(staged_reason(x[:, ::2], True))
    assert staged_reason(torch.zeros(0), False) is None  # nothing to copy


def test_non_dense_pinned_leaf_is_reported_as_staged() -> None:
    """torch copies a non-dense CPU tensor through a pageable contiguous temporary."""
    batches = [torch.zeros(4, 6)[:, ::2] for _ in range(3)]
    it = to_device(batches, "cuda", backend=FakeBackend(auto=True, pinned=True))
    with pytest.warns(PageableCopyWarning, match="non-dense layout") as record:
        list(it)
    assert len(record) == 1 and it.stats().pageable_batches == 3


def test_empty_leaves_are_not_reported() -> None:
    it = to_device([torch.zeros(0)], "cuda", backend=FakeBackend(auto=True, pinned=False))
    assert len(list(it)) == 1 and it.stats().pageable_batches == 0


def test_cuda_backend_asks_about_the_bytes_copied_not_the_storage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tensor.is_pinned() answers for the first byte of the *storage* (ATen:
    isPinnedPtr(self.storage().data())); a ring slot is a slice of a region whose storage
    starts at the region. The backend must ask about the slice's own bytes."""
    region = torch.zeros(3 * 4096, dtype=torch.uint8)
    pinned = (region.data_ptr(), 4096)  # only the first slot is page-locked
    monkeypatch.setattr(_pinning, "cuda_usable", lambda: True)
    monkeypatch.setattr(
        torch.Tensor, "is_pinned",
        lambda self: pinned[0] <= self.untyped_storage().data_ptr() < sum(pinned),
    )
    backend = CudaBackend(torch.device("cuda", 0))
    assert region[4096:8192].is_pinned()  # torch's answer: about the region's first byte
    assert not backend.is_pinned(region[4096:8192])
    assert backend.is_pinned(region[:4096]) and not backend.is_pinned(region[:4097])


def test_unregister_waits_for_copies_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule (10): a ring closed before the device stage (a worker error) unregisters its
    slots while copies from them may still run; unregister waits for them first."""
    seen: list[bool] = []
    backend = FakeBackend()  # copies stay in flight until waited for

    class Cudart:
        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
            return 0

        def cudaHostUnregister(self, ptr: int) -> int:
            seen.append(all(e.done for e in backend.events))
            return 0

    monkeypatch.setattr(_pinning, "cuda_usable", lambda: True)
    monkeypatch.setattr(_pinning, "_pinned_ptr", lambda ptr: False)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    handle = _pinning.register(torch.zeros(1024))
    src = Source(6)
    it = to_device(src, "cuda", depth=2, backend=backend)
    next(it)
    assert not any(e.done for e in backend.events)
    _pinning.unregister(handle)
    assert seen == [True]
    assert len(src.alive()) == 3  # waited for, not dropped: the stage still owns them
    it.close()
    _pinning.unregister(_pinning.register(torch.zeros(8)))  # a closed stage is not waited on
    assert len(seen) == 2


def test_collection_in_a_forked_child_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked child has a copy of the iterator but no CUDA context: collecting it there
    must not wait on events (CUDA calls fail in a child forked after CUDA was initialised)."""
    backend = FakeBackend()
    it = to_device(Source(5), "cuda", backend=backend)
    next(it)
    pid = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: pid + 1)
    del it
    gc.collect()
    assert backend.ops("sync") == []


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


BUSY_CYCLES = 2_000_000  # torch.cuda._sleep: ~1 ms, far longer than a copy of a test batch


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("side_busy", "consumer_busy"),
    [
        (False, True),  # frees early without record_stream -> next copy overwrites it
        (True, True),  # copies late and slots recycled: early slot release is seen
        (True, False),  # copies late, consumer idle: a missing wait_event reads stale data
    ],
)
def test_cuda_non_blocking_equals_synchronous_under_load(
    side_busy: bool, consumer_busy: bool
) -> None:
    """The races of naive prefetchers, each made observable: every batch differs (base + i),
    so reading a stale or overwritten buffer changes its sum."""
    n, numel, depth = 1200, 1 << 18, 2
    base = torch.randint(0, 1 << 20, (numel,), dtype=torch.int32)
    ring = PinnedRing(depth + 2, numel)
    torch.cuda.synchronize()

    def slow(batch: torch.Tensor) -> torch.Tensor:  # on the side stream: later copies wait
        torch.cuda._sleep(BUSY_CYCLES)
        return batch

    sums_async = torch.empty(n, dtype=torch.int64, device="cuda")
    it = to_device(RingSource(ring, n, base), "cuda", depth=depth,
                   transform=slow if side_busy else None)
    for i, x in enumerate(it):
        if consumer_busy:
            torch.cuda._sleep(BUSY_CYCLES)  # keeps the consumer stream behind the copies
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
def test_cuda_device_memory_bounded_when_the_cpu_runs_ahead() -> None:
    """Rule (8): with a consumer far behind the CPU (no sync in the loop), freed batches
    cannot be reused yet; the stage must not make the CPU allocate batch after batch."""
    numel, depth, n = 1 << 22, 2, 200  # 16 MiB batches: >= 10 MiB, so no 20 MiB segments
    bufs = [torch.full((numel,), k, dtype=torch.int32).pin_memory() for k in range(4)]
    acc = torch.zeros(1, dtype=torch.int32, device="cuda")
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    it = to_device((bufs[i % 4] for i in range(n)), "cuda", depth=depth)
    for x in it:
        torch.cuda._sleep(BUSY_CYCLES)  # ~1 ms a step: the CPU gets far ahead without rule 8
        acc.add_(x[:1])  # in place: the loop itself allocates nothing
    torch.cuda.synchronize()
    batch = numel * 4
    assert torch.cuda.max_memory_reserved() - start <= (2 * depth + 2) * batch
    assert it.stats().consumer_waits > n // 2  # the GPU, not the input, set the pace
    assert int(acc) == sum(i % 4 for i in range(n))


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

    def slow(batch: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(BUSY_CYCLES)
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
        torch.cuda._sleep(BUSY_CYCLES)
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
    pinned_start = _pinning.registered_bytes()
    numel = 1 << 20  # 4 MiB per int32 batch
    ring = PinnedRing(4, numel)
    base = torch.zeros(numel, dtype=torch.int32)
    assert _pinning.is_pinned(ring.buf) and _pinning.is_pinned(ring.buf[3])
    assert _pinning.registered_bytes() == pinned_start + 4 * 4 * numel
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
    assert _pinning.registered_bytes() == pinned_start


@pytest.mark.cuda
def test_cuda_pageable_and_strided_copies_are_reported() -> None:
    batches = [torch.zeros(1 << 16) for _ in range(3)]
    it = to_device(batches, "cuda")
    with pytest.warns(PageableCopyWarning, match="pageable"):
        out = list(it)
    assert it.stats().pageable_batches == 3 and out[0].is_cuda
    strided = [torch.zeros(256, 256).pin_memory()[:, ::2] for _ in range(2)]
    it = to_device(strided, "cuda")
    with pytest.warns(PageableCopyWarning, match="non-dense"):
        assert len(list(it)) == 2
    pinned = [torch.zeros(256, 256).pin_memory() for _ in range(2)]
    it = to_device(pinned, "cuda")
    assert len(list(it)) == 2 and it.stats().pageable_batches == 0


@pytest.mark.cuda
def test_cuda_consumer_on_a_side_stream_of_its_own() -> None:
    """Handover waits on the *current* stream at next(): here a user stream. The transform
    sleeps on the side stream, so later copies land late: waiting on any other stream (the
    default one) would let the user stream read them too early."""
    loader = DataLoader(TensorDataset(torch.arange(4096.0)), batch_size=64, pin_memory=True)
    stream = torch.cuda.Stream()
    total = torch.zeros((), device="cuda")
    stream.wait_stream(torch.cuda.current_stream())  # `total` was zeroed on the default stream

    def slow(batch: Any) -> Any:
        torch.cuda._sleep(BUSY_CYCLES)
        return batch

    with torch.cuda.stream(stream):
        for (x,) in to_device(loader, "cuda", transform=slow):
            total += x.sum()
    stream.synchronize()
    assert float(total) == float(torch.arange(4096.0).sum())


@pytest.mark.cuda
def test_cuda_device_resident_source_is_ordered_after_the_consumer() -> None:
    """Rule (9): batches already on the GPU, produced on the consumer stream, are read by the
    transform on the side stream only after the consumer has written them."""
    n = 200

    def produce() -> Any:
        for i in range(n):
            x = torch.empty(1 << 20, device="cuda")
            torch.cuda._sleep(BUSY_CYCLES)  # the write lands late on the consumer stream
            x.fill_(float(i))
            yield x

    sums = [float(y.sum()) for y in to_device(produce(), "cuda", transform=lambda b: b * 2)]
    assert sums == [2.0 * i * (1 << 20) for i in range(n)]


@pytest.mark.cuda
@pytest.mark.parametrize("slow_transform", [False, True])
def test_cuda_gpufeed_dataloader_pinned_ring_end_to_end(
    slow_transform: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpufeed

    pins: list[int] = []
    pin_memory = torch.Tensor.pin_memory

    def counting_pin(self: torch.Tensor, *args: Any) -> torch.Tensor:
        pins.append(self.numel())
        return pin_memory(self, *args)

    registered_start = at_rest()[0]
    monkeypatch.setattr(torch.Tensor, "pin_memory", counting_pin)
    batches, bs, width = 1100, 64, 256
    data = torch.randint(0, 1 << 20, (batches * bs, width), dtype=torch.int32)
    expected = data.view(batches, bs, width).sum((1, 2), dtype=torch.int64)

    def slow(batch: Any) -> Any:  # delays later copies: a slot recycled early is overwritten
        torch.cuda._sleep(BUSY_CYCLES)
        return batch

    loader = gpufeed.DataLoader(
        gpufeed.sources.ArrayDataset(data), batch_size=bs, num_workers=2, pin_memory=True,
        device="cuda", device_transform=slow if slow_transform else None,
    )
    sums = torch.empty(batches, dtype=torch.int64, device="cuda")
    it = iter(loader)
    registered = 0
    pins_then = fallbacks_then = 0
    for i, batch in enumerate(it):
        torch.cuda._sleep(BUSY_CYCLES // 4)  # the consumer stream stays busy too
        sums[i] = batch[0].sum(dtype=torch.int64)
        registered = max(registered, _pinning.registered_bytes() - registered_start)
        if i == 100:  # the ring has learnt its slot size and grown by now
            pins_then = len(pins)
            fallbacks_then = loader.stats().counters.get("ring_fallback", 0)
    assert torch.equal(sums.cpu(), expected)
    assert it.stats().pageable_batches == 0  # the ring is page-locked
    # Every slot of the ring is registered (not only the one at the region's start), so its
    # batches need no per-batch pin_memory(): only those that fell back are pinned that way.
    fallbacks = loader.stats().counters.get("ring_fallback", 0) - fallbacks_then
    assert registered > 0 and len(pins) - pins_then <= fallbacks * len(batch)
    del it, batch
    gc.collect()
    torch.cuda.synchronize()  # the last copies from the ring are done
    assert _pinning.registered_bytes() > registered_start  # kept for the loader's next epoch
    del loader
    gc.collect()
    assert _pinning.registered_bytes() == registered_start  # unregistered with its loader


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_gpu_benchmark_runs_and_shows_overlap() -> None:
    from gpufeed._tools import bench_gpu as gpu

    doc = gpu.run_gpu_benchmark(batch_size=32, batches=8, repeats=1, num_workers=2,
                                overlap_steps=50)
    assert doc["environment"]["gpu"]
    assert all(v is None or v > 0 for v in doc["bandwidth"]["gb_per_s"].values())
    overlap = doc["overlap"]
    assert overlap["naive_over_T"] > 1.5 and overlap["to_device_over_T"] < 1.3
    assert "GB/s" in gpu.render_markdown(doc)
