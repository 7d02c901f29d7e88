"""Collation sample by sample (gpufeed._host.streaming, NOTE [ Streamed collation ]): the batch
equals the one collated at the end, samples that differ give that collation's own result or
error, and a worker never holds a whole batch of samples besides the batch.

The reference is ``collate_into``, the loader's ordinary collation, which behaves as
``default_collate`` does in a stock worker (it stacks into memory of the first tensor's dtype:
a float64 sample among float32 ones comes out float32, as there); the last test compares the
whole loader with the stock loader's workers."""

from __future__ import annotations

import re
import weakref
from collections import OrderedDict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset, IterableDataset

import gpufeed
from gpufeed._host import streaming
from gpufeed._host.collate import collate_into
from gpufeed._host.fetch import IterFetcher, MapFetcher
from gpufeed._host.streaming import STREAM_BYTES, StreamedBatch
from gpufeed._host.writer import SlotWriter
from support.compare import assert_same

Pair = namedtuple("Pair", "image label")
SIDE = 64  # 3 x 64 x 64 float32: 48 KiB, above STREAM_BYTES
assert 3 * SIDE * SIDE * 4 >= STREAM_BYTES


@pytest.fixture(autouse=True)
def _every_sample_counts_as_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The samples here take microseconds: stream them anyway (the loader's forked workers
    inherit the setting)."""
    monkeypatch.setattr(streaming, "STREAM_MIN_S", 0.0)


def _writer(size: int = 16 << 20) -> SlotWriter:
    writer = SlotWriter(torch.zeros(size, dtype=torch.uint8), shared_fallback=False)
    writer.begin(4096, size - 4096)
    return writer


def _image(i: int, *, side: int = SIDE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((3, side, side), float(i), dtype=dtype)


def _same(expected: Any, got: Any) -> None:
    assert_same(expected, got, strides=True)


def _streamed(samples: list[Any], writer: SlotWriter | None = None, n: int | None = None
              ) -> tuple[Any, StreamedBatch]:
    writer = writer or _writer()
    batch = StreamedBatch.start(samples[0], writer, len(samples) if n is None else n)
    assert batch is not None, "the first sample was expected to start a streamed batch"
    for s in samples[1:]:
        batch.add(s)
    return batch.finish(), batch


SAMPLES = {
    "tensor": lambda i: _image(i),
    "tuple": lambda i: (_image(i), i),
    "list": lambda i: [_image(i), float(i), f"name{i}"],
    "dict": lambda i: {"image": _image(i), "label": i, "small": torch.tensor([i, i + 1])},
    "namedtuple": lambda i: Pair(_image(i), i),
    "nested": lambda i: {"views": (_image(i), _image(-i)), "meta": {"id": i, "path": f"p{i}"}},
    "numpy": lambda i: (np.full((3, SIDE, SIDE), i, dtype=np.int32), np.int64(i)),
    "channels last": lambda i: (_image(i).permute(1, 2, 0).contiguous().permute(2, 0, 1), i),
    "non-contiguous": lambda i: _image(i, side=2 * SIDE)[:, ::2, ::2],
    "mapping kept whole": lambda i: (_image(i), OrderedDict(image=_image(-i), label=i)),
}


@pytest.mark.parametrize("kind", list(SAMPLES))
def test_a_streamed_batch_equals_the_ordinary_collation(kind: str) -> None:
    samples = [SAMPLES[kind](i) for i in range(5)]
    out, _ = _streamed(samples)
    _same(collate_into(samples, _writer()), out)


def test_rows_are_written_as_samples_come_into_the_slot() -> None:
    writer = _writer()
    batch = StreamedBatch.start(_image(7), writer, 4)
    assert batch is not None
    (out,) = batch.outs
    assert writer.owns_ptr(out.data_ptr())
    assert torch.equal(out[0], _image(7))  # before any other sample and before finish
    batch.add(_image(8))
    assert torch.equal(out[1], _image(8))


def test_small_or_quick_samples_and_batches_of_one_are_not_streamed(monkeypatch) -> None:
    assert StreamedBatch.start((torch.zeros(16), 1), _writer(), 64) is None
    assert StreamedBatch.start(_image(0), _writer(), 1) is None
    assert StreamedBatch.start(_image(0), None, 8) is None
    grad = _image(0).requires_grad_()
    assert StreamedBatch.start(grad, _writer(), 8) is None
    monkeypatch.setattr(streaming, "STREAM_MIN_S", 1e-3)
    assert StreamedBatch.start(_image(0), _writer(), 8, fetch_s=0.9e-3) is None
    assert StreamedBatch.start(_image(0), _writer(), 8, fetch_s=1.1e-3) is not None
    fetcher = MapFetcher(_Counted(8), auto_collation=True, collate_fn=None)
    fetcher.fetch(list(range(8)), _writer())  # samples of microseconds: kept, then stacked
    assert fetcher.dataset.most == 7


def test_a_short_batch_has_only_the_rows_taken() -> None:
    out, _ = _streamed([(_image(i), i) for i in range(3)], n=8)
    _same(collate_into([(_image(i), i) for i in range(3)], _writer()), out)


DIFFERENT = {
    "another shape": lambda i: _image(i, side=SIDE + (i == 3)),
    "another dtype": lambda i: _image(i, dtype=torch.float64 if i == 3 else torch.float32),
    "a tensor turned numpy": lambda i: _image(i).numpy() if i == 3 else _image(i),
    "swapped places": lambda i: (i, _image(i)) if i == 3 else (_image(i), i),
    "a missing key": lambda i: {"image": _image(i)} if i == 3 else {"image": _image(i), "y": i},
    "an extra key": lambda i: {"image": _image(i), "y": i, **({"z": i} if i == 3 else {})},
    "longer list": lambda i: [_image(i), i] + ([i] if i == 3 else []),
    "a tensor that needs grad": lambda i: _image(i).requires_grad_(i == 3),
    "a lazy conjugate": lambda i: (torch.full((SIDE, SIDE), complex(i, 1)).conj() if i == 3
                                   else torch.full((SIDE, SIDE), complex(i, 1))),
}


@pytest.mark.parametrize("kind", list(DIFFERENT))
def test_samples_that_differ_give_the_ordinary_result_or_error(kind: str) -> None:
    samples = [DIFFERENT[kind](i) for i in range(5)]
    try:
        expected = collate_into(samples, _writer())
    except Exception as e:  # the same error, whatever it is
        with pytest.raises(type(e), match=re.escape(str(e))):
            _streamed(samples)
    else:
        _same(expected, _streamed(samples)[0])


def test_a_column_where_a_marker_lands_among_strings_is_collated_the_ordinary_way() -> None:
    # sample 1 puts its image where sample 0 had a string: a string column would keep the
    # marker as it is, so the batch must be rebuilt rather than returned with a marker in it
    samples = [("name", _image(0), 1), (_image(1), "name", 2)]
    with pytest.raises(AttributeError):
        collate_into(samples, _writer())
    with pytest.raises(AttributeError):
        _streamed(samples)


class _Counted(Dataset):
    """Samples whose tensors it counts while alive: the most alive at once is the worker's
    heap of samples."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.alive: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
        self.most = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        self.most = max(self.most, len(self.alive))
        t = _image(i)
        self.alive.add(t)
        return t, i


class _CountedStream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.counted = _Counted(n)

    def __iter__(self) -> Any:
        return (self.counted[i] for i in range(self.counted.n))


def test_a_worker_holds_one_sample_besides_the_batch() -> None:
    data = _Counted(8)
    fetcher = MapFetcher(data, auto_collation=True, collate_fn=None)
    images, labels = fetcher.fetch(list(range(8)), _writer())
    assert torch.equal(images, torch.stack([_image(i) for i in range(8)]))
    assert labels.tolist() == list(range(8))
    assert data.most <= 1, f"{data.most} samples alive at once: the batch's samples were kept"


def test_a_seeded_worker_and_an_iterable_stream_hold_one_sample_too() -> None:
    data = _Counted(8)
    seeded = MapFetcher(data, auto_collation=True, collate_fn=None, seed=3)
    seeded.fetch(list(range(8)), _writer())
    assert data.most <= 1
    stream = _CountedStream(7)
    fetcher = IterFetcher(stream, auto_collation=True, collate_fn=None, drop_last=False)
    first = fetcher.fetch(5, _writer())
    last = fetcher.fetch(5, _writer())  # the stream's end: a short batch of 2
    assert stream.counted.most <= 1
    assert torch.equal(first[0], torch.stack([_image(i) for i in range(5)]))
    assert torch.equal(last[0], torch.stack([_image(i) for i in (5, 6)]))
    assert last[1].tolist() == [5, 6]


class _Images(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> Any:
        if i == 33:
            return {"image": _image(i, side=SIDE + 1), "label": i}
        return {"image": _image(i), "label": i, "path": f"img{i}.png"}


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_the_loader_gives_the_stock_loaders_batches_and_errors(worker_type: str) -> None:
    kw: dict[str, Any] = {"batch_size": 8, "num_workers": 2}
    ours = gpufeed.DataLoader(_Images(), worker_type=worker_type, **kw)
    stock = TorchLoader(_Images(), **kw)
    mine, theirs = iter(ours), iter(stock)
    for _ in range(4):
        _same(next(theirs), next(mine))
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        next(theirs)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        next(mine)


def test_thread_workers_making_markers_at_once_agree_on_each(monkeypatch) -> None:
    """Each index has one marker, whichever thread worker made it first: a batch's columns are
    matched by the marker's identity and index."""
    import threading
    import time

    monkeypatch.setattr(streaming, "_MARKERS", type(streaming._MARKERS)())
    init = streaming._Marker.__init__

    def slow_init(self: Any, i: int) -> None:  # a thread switch inside the making
        time.sleep(0.001)
        init(self, i)

    monkeypatch.setattr(streaming._Marker, "__init__", slow_init)
    got: list[list[Any]] = []
    start = threading.Barrier(6)

    def make(order: list[int]) -> None:
        start.wait()
        got.append([streaming._marker(i) for i in order])

    threads = [threading.Thread(target=make, args=(list(range(12))[::1 - 2 * (k % 2)],))
               for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for markers in got:
        assert sorted(m.i for m in markers) == list(range(12))
        assert all(streaming._marker(m.i) is m for m in markers)
