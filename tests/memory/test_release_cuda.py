"""The pinned ring under user copies on a real GPU (skipped without CUDA): the same rules as
tests/memory/test_release_sim.py, test_release_devices.py and test_ring_lifetime.py, where each
is checked on the simulated backend on CPU."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import gpufeed
from gpufeed._memory import pinning as _pinning
from gpufeed._memory import release as _release
from support.cuda_memory import finish_closed_rings
from support.release_checks import Dropper

BUSY_CYCLES = 2_000_000  # about 1 ms of torch.cuda._sleep on current GPUs
WIDTH = 4096


class Rows(Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((WIDTH,), float(i))


def sums(n: int, bs: int) -> torch.Tensor:
    rows = torch.arange(n * bs, dtype=torch.float64).reshape(n, bs)
    return rows.sum(1) * WIDTH


@pytest.mark.cuda
def test_cuda_pin_memory_then_non_blocking_copy_every_batch_intact(worker_type: str) -> None:
    """The seed idiom with the current stream kept busy: a copy queued behind the sleep reads
    its slot late; a slot recycled before it would give another batch's sums."""
    n, bs = 1000, 8
    loader = gpufeed.DataLoader(Rows(n * bs), batch_size=bs, num_workers=2,
                                worker_type=worker_type, prefetch_factor=2, pin_memory=True)
    out = torch.empty(n, device="cuda", dtype=torch.float64)
    it = iter(loader)
    ring = it._ring  # type: ignore[attr-defined]
    k = 0
    for batch in it:
        torch.cuda._sleep(BUSY_CYCLES)
        x = batch.cuda(non_blocking=True)
        del batch
        out[k] = x.double().sum()
        k += 1  # noqa: SIM113 (enumerate's tuple would hold the host batch a step longer)
        if k == 50:
            assert ring._pins, "the ring should be registered"
    assert torch.equal(out.cpu(), sums(n, bs))
    assert _pinning.registered_bytes() > 0  # kept, registered, for the next epoch
    del it, ring, loader
    gc.collect()
    finish_closed_rings()
    assert _pinning.registered_bytes() == 0  # the loader gone: unregistered


@pytest.mark.cuda
def test_cuda_registration_failure_goes_on_with_ordinary_pinning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = torch.cuda.cudart()

    class Refusing:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def cudaHostRegister(self, ptr: int, n: int, flags: int) -> int:
            return 2  # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Refusing())
    monkeypatch.setattr(_release, "_warned", False)
    loader = gpufeed.DataLoader(Rows(64 * 8), batch_size=8, num_workers=2,
                                worker_type="thread", pin_memory=True)
    total = torch.zeros((), device="cuda", dtype=torch.float64)
    with pytest.warns(_release.PinningFallbackWarning):
        for batch in loader:
            assert batch.is_pinned()  # pinned the ordinary way
            total += batch.cuda(non_blocking=True).double().sum()
    assert float(total) == float(sums(64, 8).sum())
    assert _pinning.registered_bytes() == 0


@pytest.mark.cuda
def test_cuda_next_inside_graph_capture_raises() -> None:
    loader = gpufeed.DataLoader(Rows(64), batch_size=8, num_workers=2, worker_type="thread",
                                pin_memory=True)
    it = iter(loader)
    next(it)
    static = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with (torch.cuda.stream(s), pytest.raises(RuntimeError, match="capturing"),
          torch.cuda.graph(graph)):
        static += 1
        next(it)
    torch.cuda.current_stream().wait_stream(s)
    assert len(list(it)) == 7  # the batch asked for during capture was not taken


@pytest.mark.cuda
def test_cuda_device_means_the_current_device_at_iteration_start() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    loader = gpufeed.DataLoader(Rows(64), batch_size=8, num_workers=2, worker_type="thread",
                                device="cuda")
    previous = torch.cuda.current_device()
    torch.cuda.set_device(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            devices = {batch.device for batch in loader}
    finally:
        torch.cuda.set_device(previous)
    assert devices == {torch.device("cuda", 1)}


@pytest.mark.cuda
def test_cuda_batches_kept_past_the_epoch_stay_pinned_and_copy_intact() -> None:
    n, bs = 200, 8
    loader = gpufeed.DataLoader(Rows(n * bs), batch_size=bs, num_workers=2,
                                worker_type="thread", prefetch_factor=2, pin_memory=True)
    batches = list(loader)
    assert all(b.is_pinned() for b in batches)
    torch.cuda._sleep(BUSY_CYCLES)
    copies = [b.cuda(non_blocking=True) for b in batches]
    del batches, loader
    gc.collect()
    out = torch.stack([x.double().sum() for x in copies])
    assert torch.equal(out.cpu(), sums(n, bs))
    finish_closed_rings()
    del copies
    assert _pinning.registered_bytes() == 0


@pytest.mark.cuda
def test_cuda_release_on_another_thread_fences_the_consumers_stream() -> None:
    n, bs = 400, 8
    loader = gpufeed.DataLoader(Rows(n * bs), batch_size=bs, num_workers=2,
                                worker_type="thread", prefetch_factor=2, pin_memory=True)
    dropper = Dropper()
    side = torch.cuda.Stream()
    out = torch.empty(n, device="cuda", dtype=torch.float64)
    with torch.cuda.stream(side):
        for k, batch in enumerate(loader):
            torch.cuda._sleep(BUSY_CYCLES)
            x = batch.cuda(non_blocking=True)
            out[k] = x.double().sum()
            dropper.give(batch)
            del batch
            dropper.wait()
    dropper.stop()
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out.cpu(), sums(n, bs))


@pytest.mark.cuda
def test_cuda_copies_to_another_device_are_fenced() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    n, bs = 400, 8
    loader = gpufeed.DataLoader(Rows(n * bs), batch_size=bs, num_workers=2,
                                worker_type="thread", prefetch_factor=2, pin_memory=True)
    out = torch.empty(n, device="cuda:1", dtype=torch.float64)
    k = 0
    for batch in loader:
        with torch.cuda.device(1):
            torch.cuda._sleep(BUSY_CYCLES)
        x = batch.to("cuda:1", non_blocking=True)
        del batch
        out[k] = x.double().sum()
        k += 1  # noqa: SIM113
    assert torch.equal(out.cpu(), sums(n, bs))
