"""Batched fetch: ArrayDataset (arrays, memory maps, tensors), TensorDataset, __getitems__."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import gpufeed
from gpufeed.sources import ArrayDataset
from support.compare import assert_same, assert_same_batches, collect, list_or_stop
from support.fakes import GetitemsDataset

WORKERS = [
    pytest.param(dict(num_workers=0), id="main"),
    pytest.param(dict(num_workers=2), id="process"),
    pytest.param(dict(num_workers=2, worker_type="thread"), id="thread"),
]


class PerSample(tud.Dataset):
    """The same samples, one ``__getitem__`` at a time (no batched path anywhere)."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return self.inner[i]


def _arrays(n=37):
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((n, 3, 4)).astype(np.float32),
        rng.integers(0, 1000, n).astype(np.int64),
        rng.integers(0, 255, (n, 5)).astype(np.uint8),
        rng.random(n) > 0.5,
        rng.standard_normal((n, 2)).astype(np.float16),
    )


def _memmaps(tmp_path, n=37):
    out = []
    for k, a in enumerate(_arrays(n)):
        mm = np.lib.format.open_memmap(tmp_path / f"a{k}.npy", mode="w+", dtype=a.dtype,
                                       shape=a.shape)
        mm[:] = a
        mm.flush()
        del mm
        out.append(np.load(tmp_path / f"a{k}.npy", mmap_mode="r"))
    return tuple(out)


def _sources(kind, tmp_path):
    if kind == "numpy":
        return _arrays()
    if kind == "memmap":
        return _memmaps(tmp_path)
    if kind == "tensor":
        return tuple(torch.from_numpy(a.copy()) for a in _arrays())
    arrays = _arrays()
    return (arrays[0], torch.from_numpy(arrays[1].copy()), _memmaps(tmp_path)[2])  # mixed


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("kind", ["numpy", "memmap", "tensor", "mixed"])
def test_array_dataset_batches_equal_per_sample(kind, workers, tmp_path):
    ds = ArrayDataset(*_sources(kind, tmp_path))
    kwargs = dict(batch_size=8, shuffle=True)
    expected = collect(tud.DataLoader, PerSample(ds), **kwargs)[0]
    got = collect(gpufeed.DataLoader, ds, **kwargs, **workers)[0]
    assert_same_batches(expected, got)
    assert type(got[0]) is list and len(got[0]) == len(ds.arrays)  # like TensorDataset


@pytest.mark.parametrize("kind", ["numpy", "memmap", "tensor"])
def test_array_dataset_samples(kind, tmp_path):
    sources = _sources(kind, tmp_path)
    ds = ArrayDataset(*sources)
    assert len(ds) == 37
    for i in (0, 5, 36, -1):
        sample = ds[i]
        assert type(sample) is tuple and len(sample) == len(sources)
        for a, t in zip(sources, sample, strict=True):
            want = torch.from_numpy(np.array(a[i])) if not isinstance(a, torch.Tensor) else a[i]
            assert_same(want, t, f"sample {i}")
    items = ds.__getitems__([3, 0, 3, 36])
    assert len(items) == 4
    for got, i in zip(items, [3, 0, 3, 36], strict=True):
        assert_same(ds[i], tuple(got))


def test_memmap_dataset_stays_read_only_and_unchanged(tmp_path):
    arrays = _memmaps(tmp_path)
    before = [np.array(a) for a in arrays]
    ds = ArrayDataset(*arrays)
    for b in gpufeed.DataLoader(ds, batch_size=5, num_workers=2):
        b[0].add_(1)  # the user owns the batch: writing it must not reach the file
    for a, want in zip(arrays, before, strict=True):
        assert np.array_equal(a, want)


@pytest.mark.parametrize("workers", WORKERS)
def test_array_dataset_with_other_loader_features(workers):
    ds = ArrayDataset(*_arrays())
    for kwargs in (
        dict(batch_size=None),
        dict(batch_size=4, collate_fn=lambda b: [s[1] for s in b]),
        dict(batch_size=6, drop_last=True),
        dict(sampler=[5, 1, 1, 30], batch_size=3),
        dict(batch_sampler=[[2, 3], [36], [0, 0, 0]]),
    ):
        expected = collect(tud.DataLoader, PerSample(ds), **kwargs)[0]
        got = collect(gpufeed.DataLoader, ds, **kwargs, **workers)[0]
        assert_same_batches(expected, got)


def test_array_dataset_with_stock_loader_uses_getitems():
    ds = ArrayDataset(*_arrays())
    expected = list(tud.DataLoader(PerSample(ds), batch_size=7))
    got = list(tud.DataLoader(ds, batch_size=7))
    assert_same_batches(expected, got)


@pytest.mark.parametrize(
    "args,exc,needle",
    [
        ((), ValueError, "at least one"),
        (([1, 2, 3],), TypeError, "list"),
        ((np.zeros(3), np.zeros(4)), ValueError, "[3, 4]"),
        ((np.float32(1.0),), (TypeError, ValueError), ""),
        ((np.array(5.0),), ValueError, "0-d"),
        ((np.array([object(), object()]),), TypeError, "object"),
        ((np.array(["a", "b"]),), TypeError, "dtype <U1, which no torch tensor holds"),
        ((np.arange(2).astype("datetime64[s]"),), TypeError, "datetime64[s], which no"),
    ],
    ids=["none", "list", "lengths", "scalar", "0d", "object", "str", "datetime"],
)
def test_array_dataset_rejects_bad_input(args, exc, needle):
    with pytest.raises(exc) as info:
        ArrayDataset(*args)
    assert needle in str(info.value)


def test_array_dataset_out_of_range_index_is_an_index_error():
    ds = ArrayDataset(np.arange(10))
    with pytest.raises(IndexError):
        ds[10]
    loader = gpufeed.DataLoader(ds, sampler=[0, 1, 99], batch_size=3, num_workers=1)
    with pytest.raises(IndexError):
        list_or_stop(loader)


def test_negative_indices_count_from_the_end_as_a_list_does():
    """A sampler may give negative indices: a[i] and the stock loader count them from the
    end, so the batched gather does too (index_select alone refuses them)."""
    x, y = torch.arange(12.0).view(6, 2), np.arange(6)
    for ds in (ArrayDataset(x, y), tud.TensorDataset(x, torch.from_numpy(y))):
        want = list(tud.DataLoader(ds, sampler=[[-1, 0, -6]], batch_size=None))
        for nw in (0, 1):
            got = list_or_stop(gpufeed.DataLoader(ds, sampler=[[-1, 0, -6]], batch_size=None,
                                                  num_workers=nw))
            assert_same_batches(want, got)
    with pytest.raises(IndexError, match="index -7 is out of range for 6 samples"):
        ArrayDataset(x).__getitems__([0, -7])


def test_tensors_that_require_grad_batch_as_the_stock_loader_does():
    """Without workers the stock loader stacks the rows into a batch that requires grad; the
    gather gives the same values, requiring grad, instead of failing in ``out=``."""
    w = torch.arange(8.0).view(4, 2).requires_grad_()
    for ds in (ArrayDataset(w), tud.TensorDataset(w)):
        want = next(iter(tud.DataLoader(ds, batch_size=3)))
        got = next(iter(gpufeed.DataLoader(ds, batch_size=3)))
        assert torch.equal(got[0], want[0]) and got[0].requires_grad


def test_big_endian_arrays_read_as_native_numbers():
    a = np.arange(12, dtype=">i4").reshape(6, 2)
    ds = ArrayDataset(a)
    assert torch.equal(ds[1][0], torch.tensor([2, 3], dtype=torch.int32))
    for nw in (0, 1):
        got = list_or_stop(gpufeed.DataLoader(ds, batch_size=4, num_workers=nw))
        assert torch.equal(torch.cat([b[0] for b in got]), torch.from_numpy(a.astype("<i4")))


@pytest.mark.parametrize("workers", WORKERS)
def test_tensor_dataset_matches_stock(workers):
    x = torch.randn(29, 3, generator=torch.Generator().manual_seed(0))
    y = torch.arange(29)
    ds = tud.TensorDataset(x, y)
    kwargs = dict(batch_size=4, shuffle=True)
    expected = collect(tud.DataLoader, ds, **kwargs)[0]
    got = collect(gpufeed.DataLoader, ds, **kwargs, **workers)[0]
    assert_same_batches(expected, got)


def test_tensor_dataset_with_strided_tensor():
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    ds = tud.TensorDataset(base.t(), torch.arange(10))  # non-contiguous rows
    expected = list(tud.DataLoader(ds, batch_size=3))
    got = list_or_stop(gpufeed.DataLoader(ds, batch_size=3, num_workers=1))
    assert_same_batches(expected, got)


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("batch_size", [1, 5])
def test_getitems_called_once_per_batch(workers, batch_size):
    n = 23
    batches = collect(gpufeed.DataLoader, GetitemsDataset(n), batch_size=batch_size,
                      **workers)[0]
    calls: dict[str, int] = {}
    seen = []
    for b in batches:
        idx, size, call = b
        seen.extend(idx.tolist())
        assert len(set(call)) == 1, f"one batch came from several __getitems__ calls: {call}"
        assert set(size.tolist()) == {len(idx)}, "__getitems__ got a different batch size"
        calls[call[0]] = len(idx)
    assert seen == list(range(n))
    assert len(calls) == len(batches), "__getitems__ was called more often than once per batch"
    assert "per-sample" not in calls


@pytest.mark.parametrize("workers", WORKERS)
def test_getitems_not_used_without_auto_collation(workers):
    """batch_size=None fetches single samples with __getitem__, as stock does."""
    expected = collect(tud.DataLoader, GetitemsDataset(5), batch_size=None)[0]
    got = collect(gpufeed.DataLoader, GetitemsDataset(5), batch_size=None, **workers)[0]
    assert_same_batches(expected, got)
    assert {b[2] for b in got} == {"per-sample"}


class OddGetitems(tud.Dataset):
    """__getitems__ that returns samples as a list of dicts with numpy leaves."""

    def __len__(self):
        return 11

    def __getitem__(self, i):
        raise AssertionError("__getitem__ must not be called")

    def __getitems__(self, indices):
        return [{"i": i, "v": np.full(3, i, dtype=np.int32)} for i in indices]


@pytest.mark.parametrize("workers", WORKERS)
def test_getitems_results_collated_like_stock(workers):
    expected = list(tud.DataLoader(OddGetitems(), batch_size=4))
    got = collect(gpufeed.DataLoader, OddGetitems(), batch_size=4, **workers)[0]
    assert_same_batches(expected, got)


def test_repr_is_torchvisions_layout():
    ds = ArrayDataset(np.zeros((10, 3), np.float32), torch.arange(10))
    assert repr(ds).splitlines() == [
        "Dataset ArrayDataset", "    Number of datapoints: 10",
        "    Arrays: ndarray float32 (10, 3) (120 B), Tensor int64 (10,) (80 B)"]


class _ShapeByGroup(tud.Dataset):
    """Sample ``i`` is a tensor whose shape depends on ``i % 3`` (and a label)."""

    def __len__(self):
        return 60

    def __getitem__(self, i):
        return torch.arange(i, i + (i % 3 + 1) * 2, dtype=torch.float32).reshape(-1, 2), i


# batches of changing sizes and shapes, so the same slots see different leaves every time
_BATCHES = [[0, 3, 6, 9], [1, 4], [2, 5, 8, 11, 14, 17], [12, 15, 18], [7, 10, 13],
            [20, 23, 26, 29, 32], [21], [19, 22, 25, 28], [24, 27], [30, 33, 36, 39, 42, 45]]


@pytest.mark.parametrize("workers", WORKERS[1:])
@pytest.mark.parametrize("kind", ["array", "samples"])
def test_changing_batch_shapes_through_recycled_slots_match_stock(kind, workers):
    """Carved slot views are kept per offset, shape and dtype (NOTE [ Carved views ] in
    _host/writer.py): batches of changing shapes through the same few recycled slots (each
    batch copied and dropped at once, little work ahead), over epochs of persistent workers,
    must still come back byte for byte as stock's."""
    ds = ArrayDataset(*_arrays(60)) if kind == "array" else _ShapeByGroup()
    batches = _BATCHES * 3
    expected = collect(tud.DataLoader, ds, epochs=3, batch_sampler=batches)
    loader = gpufeed.DataLoader(ds, batch_sampler=batches, persistent_workers=True,
                                prefetch_factor=1, **workers)
    got = [[[t.clone() for t in b] for b in loader] for _ in range(3)]  # slots go back at once
    assert 0 < loader.stats().counters["ring_slots"] < len(batches)  # so they were recycled
    for e, g in zip(expected, got, strict=True):
        assert_same_batches(e, g)
    del loader
