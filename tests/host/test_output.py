"""gpufeed.sources.batch_empty: user code building a whole batch builds it in its slot
(NOTE [ Batches built in the slot ] in _host/output.py)."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset

import gpufeed
from gpufeed._host.collate import pack, unpack
from gpufeed._host.fetch import MapFetcher
from gpufeed._host.output import building
from gpufeed._host.writer import SlotWriter


def _writer(size: int = 1 << 20) -> SlotWriter:
    writer = SlotWriter(torch.zeros(size, dtype=torch.uint8), shared_fallback=False)
    writer.begin(4096, 1 << 16)
    return writer


def passthrough(batch: Any) -> Any:
    """The collate_fn of a dataset whose ``__getitems__`` returns the batch (as torch's
    loader calls it: ``collate_fn(dataset.__getitems__(indices))``)."""
    return batch


def _in(t: torch.Tensor, writer: SlotWriter) -> bool:
    return writer.base + writer.start <= t.data_ptr() < writer.base + writer.end


class Crops(Dataset[Any]):
    """Rows of a fixed array, built into one batch array per ``__getitems__``: from
    ``batch_empty`` (or, with ``cache_after``, a buffer kept and refilled from that call on)."""

    def __init__(self, n: int = 96, cache_after: int | None = None) -> None:
        self.data = torch.arange(n * 48, dtype=torch.int32).reshape(n, 3, 4, 4) % 251
        self.cache_after = cache_after
        self.calls = 0
        self.kept: torch.Tensor | None = None
        self.ptrs: list[int] = []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        return self.data[i].to(torch.uint8), i

    def __getitems__(self, indices: Sequence[int]) -> Any:
        self.calls += 1
        if self.kept is not None:
            out = self.kept
        else:
            out = gpufeed.sources.batch_empty(len(indices), 3, 4, 4, dtype=torch.uint8)
            if self.cache_after is not None and self.calls >= self.cache_after:
                self.kept = out
        self.ptrs.append(out.data_ptr())
        for k, i in enumerate(indices):
            out[k] = self.data[i]
        return out, torch.as_tensor(list(indices))


def test_outside_a_worker_it_is_torch_empty() -> None:
    t = gpufeed.sources.batch_empty(2, 3, dtype=torch.uint8)
    assert t.shape == (2, 3) and t.dtype == torch.uint8
    assert gpufeed.sources.batch_empty((4,)).dtype == torch.get_default_dtype()
    assert gpufeed.sources.batch_empty(torch.Size([2, 2]), dtype=torch.int64).shape == (2, 2)
    assert gpufeed.sources.batch_empty(np.int64(3)).shape == (3,)


@pytest.mark.parametrize(("args", "kw", "err", "match"), [
    ((2.5,), {}, TypeError, "sizes must be integers, got 2.5"),
    (("3",), {}, TypeError, "sizes must be integers"),
    ((2, -1), {}, ValueError, "sizes must be >= 0, got -1"),
    ((2,), {"dtype": np.uint8}, TypeError, "dtype must be a torch.dtype"),
])
def test_bad_arguments_name_the_value(args: Any, kw: Any, err: type, match: str) -> None:
    with pytest.raises(err, match=match):
        gpufeed.sources.batch_empty(*args, **kw)


def test_a_batch_built_in_the_slot_is_packed_where_it_lies_without_a_copy() -> None:
    writer = _writer()
    previous = building(writer)
    try:
        out = gpufeed.sources.batch_empty(8, 5, dtype=torch.float32)
    finally:
        building(previous)
    assert _in(out, writer)
    out.copy_(torch.arange(40, dtype=torch.float32).reshape(8, 5))
    labels = torch.arange(8)
    taken = writer.cur
    packed = pack((out, labels), writer)
    assert packed.leaves[0][0] == 0  # the first leaf is where batch_empty put it
    # only the labels (built outside) were copied into the slot
    assert writer.cur - taken == 64
    wire = pickle.loads(ForkingPickler.dumps((packed.batch, packed.leaves)))
    base = writer.region.numpy()[writer.start:writer.start + packed.used + 64]
    x, y = unpack(wire, base)
    assert torch.equal(x, torch.arange(40, dtype=torch.float32).reshape(8, 5))
    assert torch.equal(y, labels)


def test_a_request_the_slot_cannot_hold_gets_ordinary_memory() -> None:
    writer = _writer()
    previous = building(writer)
    try:
        big = gpufeed.sources.batch_empty(1 << 17, dtype=torch.uint8)  # the slot is 64 KiB
    finally:
        building(previous)
    assert not _in(big, writer) and big.numel() == 1 << 17


def test_per_sample_getitem_of_a_collated_batch_gets_no_slot_memory() -> None:
    """batch_empty in __getitem__, whose samples the loader stacks, is torch.empty: the slot
    holds the stacked batch, not each sample."""

    class PerSample(Dataset[Any]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> torch.Tensor:
            t = gpufeed.sources.batch_empty(4, dtype=torch.int64)
            seen.append(t)
            return t.fill_(i)

    seen: list[torch.Tensor] = []
    writer = _writer()
    fetcher = MapFetcher(PerSample(), auto_collation=True, collate_fn=None)
    batch = fetcher.fetch([0, 1, 2], writer)
    assert seen and not any(_in(t, writer) for t in seen)
    assert _in(batch, writer)  # the stack, as before
    assert batch[:, 0].tolist() == [0, 1, 2]


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_batches_built_in_the_slot_equal_the_stock_loaders(worker_type: str) -> None:
    ds = Crops()
    stock = [tuple(t.clone() for t in b)
             for b in TorchLoader(ds, batch_size=8, collate_fn=passthrough)]
    loader = gpufeed.DataLoader(ds, batch_size=8, num_workers=2, worker_type=worker_type,
                                collate_fn=passthrough)
    for _ in range(2):  # slots recycled in the second epoch
        got = list(loader)
        assert len(got) == len(stock)
        for (x, y), (sx, sy) in zip(got, stock, strict=True):
            assert x.dtype == torch.uint8 and torch.equal(x, sx) and torch.equal(y, sy)


def test_thread_workers_hand_out_the_memory_batch_empty_gave() -> None:
    """No copy: the tensor the loop gets is the very memory the dataset filled (thread workers
    share the process, so the addresses compare)."""
    ds = Crops()
    loader = gpufeed.DataLoader(ds, batch_size=8, num_workers=1, worker_type="thread",
                                collate_fn=passthrough)
    handed = [x.data_ptr() for x, _ in loader]
    assert ds.ptrs[1:] == handed[1:]  # the first batch has no slot yet: it is copied


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_a_buffer_kept_past_its_batch_is_refused(worker_type: str) -> None:
    ds = Crops(cache_after=3)  # batch 3 on: the same slot memory, refilled
    loader = gpufeed.DataLoader(ds, batch_size=8, num_workers=1, worker_type=worker_type,
                                collate_fn=passthrough)
    with pytest.raises(Exception, match="kept past the batch it was made for"):
        held = list(loader)  # every batch held: the kept buffer's slot is never free
        del held


class SelfBatching(torch.utils.data.IterableDataset[Any]):
    """An iterable dataset that batches itself (``batch_size=None``), building each batch with
    ``batch_empty``."""

    def __init__(self, batches: int = 6) -> None:
        self.batches = batches
        self.ptrs: list[int] = []

    def __iter__(self) -> Any:
        for b in range(self.batches):
            out = gpufeed.sources.batch_empty(16, 8, dtype=torch.int16)
            self.ptrs.append(out.data_ptr())
            out.copy_(torch.arange(128, dtype=torch.int16).reshape(16, 8) + b)
            yield out


def test_an_iterable_that_batches_itself_builds_in_the_slot() -> None:
    ds = SelfBatching()
    stock = [t.clone() for t in TorchLoader(ds, batch_size=None)]
    ds.ptrs.clear()
    loader = gpufeed.DataLoader(ds, batch_size=None, num_workers=1, worker_type="thread")
    got = list(loader)
    assert len(got) == len(stock)
    assert all(torch.equal(a, b) for a, b in zip(got, stock, strict=True))
    assert [t.data_ptr() for t in got[1:]] == ds.ptrs[1:]  # handed out where it was built
