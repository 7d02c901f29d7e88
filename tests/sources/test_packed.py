"""PackedList: list semantics from one buffer; the copy-on-write warning at process start."""

import os
import pickle
import sys
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, Subset

import gpufeed
from gpufeed._sources import packed as _packed


@pytest.mark.parametrize("items", [
    ["a", "", "héllo wörld", "x" * 300, "\x00nul"],
    [b"", b"\x00\xff", b"abc"],
    [1, -2, 3, 2**40],
    [0.5, -1.25, 1e300],
    [True, False, True],
])
def test_scalars_round_trip(items):
    packed = gpufeed.sources.PackedList(items)
    assert len(packed) == len(items)
    got = list(packed)
    assert got == items and [type(x) for x in got] == [type(x) for x in items]
    assert packed[-1] == items[-1] and packed == items
    assert list(packed[1:3]) == items[1:3] and list(packed[::-2]) == items[::-2]
    assert list(pickle.loads(pickle.dumps(packed))) == items
    with pytest.raises(IndexError, match="out of range"):
        packed[len(items)]


def test_rows_become_one_array_and_ragged_rows_keep_lengths():
    rows = [[float(i), i + 0.5, -i] for i in range(5)]
    packed = gpufeed.sources.PackedList(rows, dtype=np.float32)
    assert packed.kind == "row" and packed._data.shape == (5, 3)
    assert packed._data.dtype == np.float32
    np.testing.assert_array_equal(packed[2], np.float32(rows[2]))
    ragged = gpufeed.sources.PackedList([[1, 2], [3], [], [4, 5, 6]])
    assert ragged.kind == "ragged" and [list(r) for r in ragged] == [[1, 2], [3], [], [4, 5, 6]]
    packed[0][:] = 7  # a row is a copy: the shared buffer is never written
    assert packed[0][0] == 0 and not packed._data.flags.writeable


def test_an_empty_row_keeps_integer_rows_exact():
    """One empty document among token ids: the rows stay int64 (an empty list's default
    dtype is float64), values of any size come back exactly, and so does the loader's batch."""
    big = 2**60 + 1
    packed = gpufeed.sources.PackedList([[1, 2], [], [big]])
    assert packed.kind == "ragged" and packed._data.dtype == np.int64
    assert int(packed[2][0]) == big and packed[1].dtype == np.int64
    rows = gpufeed.sources.PackedList([[1, 2], [], [3, 4]])
    batch = next(iter(gpufeed.DataLoader(rows, batch_size=None)))
    assert batch.dtype == torch.int64
    assert gpufeed.sources.PackedList([[0.5], []])._data.dtype == np.float64


@pytest.mark.parametrize("items", [[[1, 2], [3, 4], [5, 6]], [[1, 2], [3], [4, 5, 6]]])
def test_rows_answer_in_index_and_count_as_a_list_does(items):
    packed = gpufeed.sources.PackedList(items)
    assert items[1] in packed and tuple(items[1]) in packed and np.array(items[1]) in packed
    assert [9, 9] not in packed and 3 not in packed and "a" not in packed
    assert packed.index(items[2]) == 2 and packed.count(items[0]) == 1
    assert packed.index(items[0], 0, 1) == 0
    with pytest.raises(ValueError, match="not in the PackedList"):
        packed.index(items[0], 1)
    assert gpufeed.sources.PackedList(["a", "b"]).count("b") == 1
    assert gpufeed.sources.PackedList(list("abc")) != "abc"  # a list never equals a str
    assert gpufeed.sources.PackedList(["a", "b"])[1:1].kind == "str"


def test_bad_items_are_named():
    with pytest.raises(TypeError, match="mix numbers with other things"):
        gpufeed.sources.PackedList([1, "a"])
    with pytest.raises(TypeError, match="item 1 is a int"):
        gpufeed.sources.PackedList(["a", 1])
    with pytest.raises(TypeError, match="cannot pack dict"):
        gpufeed.sources.PackedList([{"a": 1}])
    with pytest.raises(TypeError, match="indices must be ints"):
        gpufeed.sources.PackedList([1, 2])["a"]


def test_no_per_item_objects():
    n = 200_000
    strings = [f"file_{i:07d}.jpg" for i in range(n)]
    packed = gpufeed.sources.PackedList(strings)
    assert packed.nbytes == 16 * n + 8 * (n + 1)  # the text and the offsets, nothing per item
    assert packed.nbytes < sum(map(sys.getsizeof, strings)) / 2  # each str object: ~65 bytes
    assert packed[123_456] == strings[123_456]


class ListDataset(Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return torch.as_tensor(self.rows[i])


def _loader_warnings(dataset, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = gpufeed.DataLoader(dataset, batch_size=50_000, num_workers=1, **kw)
        it = iter(loader)
        next(it)
        del it
    return [w for w in caught if issubclass(w.category, gpufeed.errors.CopyOnWriteWarning)]


def test_warns_once_naming_attribute_and_remedies(monkeypatch):
    monkeypatch.setattr(_packed, "COW_THRESHOLD", 1000)
    ds = ListDataset([float(i) for i in range(2000)])
    got = _loader_warnings(ds)
    assert len(got) == 1
    msg = str(got[0].message)
    assert "ListDataset.rows is a Python list of ~2,000 objects" in msg
    assert "gpufeed.sources.PackedList" in msg and "worker_type='thread'" in msg
    assert not _loader_warnings(ds)  # once per dataset
    # wrapped datasets are looked into; packed lists and thread workers are quiet
    assert "dataset.rows" in str(_loader_warnings(Subset(ListDataset(list(range(2000))),
                                                         range(10)))[0].message)
    assert not _loader_warnings(ListDataset(gpufeed.sources.PackedList(list(range(2000)))))
    assert not _loader_warnings(ListDataset(list(range(2000))), worker_type="thread")
    assert not _loader_warnings(ListDataset(list(range(999))))


def test_packed_dataset_batches_equal_the_list_ones():
    rows = [[i, i * 2.0] for i in range(40)]
    want = list(torch.utils.data.DataLoader(ListDataset(rows), batch_size=8))
    got = list(gpufeed.DataLoader(ListDataset(gpufeed.sources.PackedList(rows)), batch_size=8,
                                  num_workers=2))
    assert len(got) == len(want)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w.double(), g.double())


def _private_dirty_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("Private_Dirty"))


def _child_growth_kb(items) -> int:
    """Private memory a forked child gains by reading every item (copy-on-write copies)."""
    r, w = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+: fork with threads alive warns
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        try:
            before = _private_dirty_kb()
            total = 0
            for i in range(len(items)):
                total += len(items[i])
            os.write(w, str(_private_dirty_kb() - before).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    got = int(os.read(r, 64))
    os.close(r)
    return got


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux smaps")
def test_forked_reader_copies_a_list_but_not_a_packed_list():
    strings = [f"caption number {i} of the set" for i in range(300_000)]
    packed = gpufeed.sources.PackedList(strings)
    listed = _child_growth_kb(strings)
    assert listed > 8_000  # ~20 MB of str objects: their refcounts were written
    assert _child_growth_kb(packed) < listed / 10


def test_repr_shows_items_kind_length_and_packed_bytes():
    assert repr(gpufeed.sources.PackedList(["a", "bb", "c", "d"])) == (
        "PackedList(['a', 'bb', 'c', ...], kind='str', len=4, 45 B packed)")
