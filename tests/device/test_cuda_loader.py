"""``gpufeed.DataLoader`` on a real GPU (skipped without CUDA), against the stock loader with
``.to("cuda")``: batches of several leaves held by the loop while later ones arrive, a device
transform that fails, an early break, ``pin_memory_device``, slots bound late, Lightning.
Each rule is checked on the simulated backend in the tests beside this file; here the driver
itself is the judge."""

from __future__ import annotations

import gc
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.data as tud

import gpufeed
from gpufeed._memory import pinning as _pinning
from support.cuda_memory import at_rest

BUSY_CYCLES = 2_000_000  # about 1 ms of torch.cuda._sleep


class Mixed(tud.Dataset):
    """Sample ``i``: a uint8 image, an int64 label, float features and a name, all from ``i``,
    so a batch overwritten by another (or read before its copy landed) changes every sum."""

    def __init__(self, n: int, sleep_s: float = 0.0) -> None:
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        g = torch.Generator().manual_seed(i)
        return {
            "image": torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8, generator=g),
            "label": torch.tensor(i, dtype=torch.int64),
            "features": torch.randn(7, generator=g),
            "name": f"s{i}",
        }


def _on_host(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}


def _stock(dataset: tud.Dataset, epochs: int, **kwargs: Any) -> list[dict[str, Any]]:
    loader = tud.DataLoader(dataset, **kwargs)
    out = []
    for epoch in range(epochs):
        if kwargs.get("generator") is not None:
            kwargs["generator"].manual_seed(epoch)
        out.extend(_on_host(b) for b in loader)
    return out


def _same(ours: list[dict[str, Any]], stock: list[dict[str, Any]]) -> None:
    assert len(ours) == len(stock)
    for k, (a, b) in enumerate(zip(ours, stock, strict=True)):
        assert a["name"] == b["name"], k
        for key in ("image", "label", "features"):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (k, key)


def _given_back(start: tuple[int, int]) -> None:
    """Called once the test dropped its batches, its iterator and then (the GPU done with
    them) its loader: every registered page and device byte is back where the test started,
    with no later ring needed to reap them."""
    gc.collect()
    torch.cuda.synchronize()
    gc.collect()
    assert (_pinning.registered_bytes(), torch.cuda.memory_allocated()) == start


@pytest.mark.cuda
@pytest.mark.parametrize(("num_workers", "worker_type"),
                         [(0, "thread"), (2, "process"), (2, "thread")])
def test_cuda_device_batches_held_by_the_loop_equal_stock(num_workers: int,
                                                          worker_type: str) -> None:
    """Every batch of two shuffled epochs is kept until the end while the consumer stream
    is busy: a device buffer or pinned slot reused while a batch is held, or a batch read
    before its copy landed, makes it differ from the stock loader's."""
    n, bs = 600, 8
    ours_gen, stock_gen = torch.Generator(), torch.Generator()
    loader = gpufeed.DataLoader(Mixed(n), batch_size=bs, shuffle=True, generator=ours_gen,
                                num_workers=num_workers, worker_type=worker_type,
                                pin_memory=True, device="cuda", persistent_workers=num_workers > 0)
    held = []
    for epoch in range(2):
        ours_gen.manual_seed(epoch)
        for batch in loader:
            assert batch["image"].is_cuda and batch["label"].is_cuda
            torch.cuda._sleep(BUSY_CYCLES // 4)
            batch["features"].mul_(1.0)  # the loop writes to it on its own stream
            held.append(batch)
    torch.cuda.synchronize()
    _same([_on_host(b) for b in held],
          _stock(Mixed(n), 2, batch_size=bs, shuffle=True, generator=stock_gen,
                 num_workers=num_workers, persistent_workers=num_workers > 0))


@pytest.mark.cuda
@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_cuda_every_leaf_of_a_ring_batch_is_pinned_and_copies_intact(worker_type: str) -> None:
    """``pin_memory=True`` without ``device=``: each leaf's storage starts at its own bytes
    inside a registered slot; torch must see every leaf as pinned (so ``non_blocking`` is
    asynchronous and no extra copy is made), and a copy queued behind a busy stream must
    still read the batch it was queued for."""
    n, bs = 800, 8
    start = at_rest()
    loader = gpufeed.DataLoader(Mixed(n), batch_size=bs, num_workers=2, worker_type=worker_type,
                                pin_memory=True)
    copies = []
    unpinned = 0
    for batch in loader:
        leaves = [batch["image"], batch["label"], batch["features"]]
        unpinned += sum(not t.is_pinned() for t in leaves)
        torch.cuda._sleep(BUSY_CYCLES // 4)
        copies.append({k: v.to("cuda", non_blocking=True) if torch.is_tensor(v) else v
                       for k, v in batch.items()})
        del batch, leaves
    torch.cuda.synchronize()
    assert unpinned == 0
    _same([_on_host(c) for c in copies], _stock(Mixed(n), 1, batch_size=bs))
    assert _pinning.registered_bytes() > start[0]  # the ring, kept for the next epoch
    del copies
    torch.cuda.synchronize()
    del loader
    _given_back(start)


@pytest.mark.cuda
@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_cuda_a_failing_device_transform_then_everything_is_given_back(worker_type: str) -> None:
    """The transform fails on batch 1: the error reaches the loop, the batches after it are
    right, and once the iterator goes no page stays registered and no device memory is left."""
    start = at_rest()

    def fail_on_1(batch: dict[str, Any]) -> dict[str, Any]:
        if int(batch["label"][0]) == 8:
            raise ValueError("transform failed on batch 1")
        return batch

    loader = gpufeed.DataLoader(Mixed(80), batch_size=8, num_workers=2, worker_type=worker_type,
                                pin_memory=True, device="cuda", device_transform=fail_on_1)
    it = iter(loader)
    got: list[Any] = []
    while True:
        try:
            got.append(_on_host(next(it)))
        except ValueError as e:
            assert "batch 1" in str(e)
            got.append("error")
        except StopIteration:
            break
    assert got[1] == "error" and len(got) == 10
    stock = _stock(Mixed(80), 1, batch_size=8)
    _same([got[0], *got[2:]], [stock[0], *stock[2:]])
    del it, got, stock
    gc.collect()
    torch.cuda.synchronize()
    del loader
    _given_back(start)


@pytest.mark.cuda
@pytest.mark.parametrize("num_workers", [0, 2])
def test_cuda_an_early_break_gives_everything_back_and_the_next_epoch_is_whole(
        num_workers: int) -> None:
    start = at_rest()
    loader = gpufeed.DataLoader(Mixed(160), batch_size=8, num_workers=num_workers,
                                pin_memory=True, device="cuda")
    for k, _batch in enumerate(loader):
        if k == 2:
            break
    del _batch
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == start[1]  # no batch on the GPU once dropped
    _same([_on_host(b) for b in loader], _stock(Mixed(160), 1, batch_size=8))
    torch.cuda.synchronize()
    del loader
    _given_back(start)


@pytest.mark.cuda
def test_cuda_pin_memory_device_as_the_stock_loader() -> None:
    """``pin_memory_device="cuda"`` (the stock loader's argument, deprecated in newer torch):
    both loaders give pinned host batches with the same values."""
    kwargs: dict[str, Any] = dict(batch_size=8, num_workers=2, pin_memory=True,
                                  pin_memory_device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock = [b for b in tud.DataLoader(Mixed(64), **kwargs)]
        ours = [b for b in gpufeed.DataLoader(Mixed(64), **kwargs)]
    assert [b["image"].is_pinned() for b in ours] == [b["image"].is_pinned() for b in stock]
    assert all(not b["image"].is_cuda for b in ours)
    _same(ours, stock)


@pytest.mark.cuda
def test_cuda_slots_bound_late_stay_intact_under_non_blocking_copies() -> None:
    """Batches slow enough (>= LATE_BIND_S of worker time) that workers ask for their slot as
    they collate; slots carved and registered while copies from older ones are in flight."""
    n, bs = 48, 8
    loader = gpufeed.DataLoader(Mixed(n * bs, sleep_s=0.004), batch_size=bs, num_workers=2,
                                pin_memory=True, device="cuda")
    it = iter(loader)
    host = it.inner._source  # type: ignore[attr-defined]  # the host iterator under the stage
    held, late = [], []
    for batch in it:
        late.append(host._late.on)
        torch.cuda._sleep(BUSY_CYCLES * 4)
        held.append(batch)
    torch.cuda.synchronize()
    assert any(late[1:])  # the first batch's cost is measured: later slots were bound late
    _same([_on_host(b) for b in held], _stock(Mixed(n * bs), 1, batch_size=bs))


@pytest.mark.cuda
@pytest.mark.parametrize("device", [None, "cuda"])
def test_cuda_lightning_trains_on_the_stock_loaders_batches(device: str | None,
                                                            tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from support.frameworks import Pairs, lightning_module, trainer

    def on_cuda(batch: Any) -> None:
        assert batch[0].is_cuda

    def fit(loader: Any) -> list[list[int]]:
        module = lightning_module(on_batch=on_cuda)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer(tmp_path, epochs=2, accelerator="gpu", devices=1).fit(module, loader)
        return module.seen

    stock = fit(tud.DataLoader(Pairs(64), batch_size=4, shuffle=True, num_workers=2,
                               generator=torch.Generator().manual_seed(3)))
    ours = fit(gpufeed.DataLoader(Pairs(64), batch_size=4, shuffle=True, num_workers=2,
                                  generator=torch.Generator().manual_seed(3), pin_memory=True,
                                  device=device))
    assert ours == stock and len(ours) == 32
