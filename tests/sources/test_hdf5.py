"""HDF5Dataset: the stock loader's batches, a handle per process, faults, missing extra."""

import os
import pickle
import sys
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import gpufeed
from gpufeed._sources import hdf5 as _hdf5

h5py = pytest.importorskip("h5py")


@pytest.fixture(scope="module")
def h5file(tmp_path_factory):
    path = tmp_path_factory.mktemp("h5") / "data.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=rng.integers(0, 255, (90, 3, 4, 4), dtype=np.uint8),
                         chunks=(8, 3, 4, 4), compression="gzip")
        f.create_dataset("labels", data=np.arange(90, dtype=np.int64))
        f.create_dataset("scores", data=rng.random((90, 2), dtype=np.float32))
    return path


class PlainH5(Dataset):
    """What users write today: a per-sample h5py Dataset."""

    def __init__(self, path):
        self.path, self.f = path, None

    def __len__(self):
        return 90

    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        return tuple(torch.as_tensor(self.f[k][i]) for k in ("images", "labels", "scores"))


def test_batches_equal_the_stock_loader(h5file):
    order = np.random.default_rng(1).permutation(90).tolist()
    want = list(DataLoader(PlainH5(h5file), batch_size=16, sampler=order))
    ds = gpufeed.sources.HDF5Dataset(h5file, ("images", "labels", "scores"))
    runs = [list(DataLoader(ds, batch_size=16, sampler=order, num_workers=2))]
    for nw, wt in ((0, "process"), (2, "process"), (2, "thread")):
        runs.append(list(gpufeed.DataLoader(ds, batch_size=16, sampler=order, num_workers=nw,
                                            worker_type=wt)))
    for got in runs:
        assert len(got) == len(want)
        for w, g in zip(want, got, strict=True):
            assert type(g) is list and all(
                a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(w, g, strict=True))


def test_repeated_negative_and_sparse_indices(h5file):
    ds = gpufeed.sources.HDF5Dataset(h5file, ["labels", "images"])
    for idx in ([5, 5, 1, -1], [0, 89, 45], [3]):  # dense and sparse (point list) reads
        labels, images = ds.gpufeed_batch(idx, seed=None, epoch=0, alloc=None)
        assert labels.tolist() == [i % 90 for i in idx]
        assert torch.equal(images, torch.stack([ds[i][1] for i in idx]))
    with pytest.raises(IndexError, match="out of range for length 90"):
        ds.gpufeed_batch([1, 90], seed=None, epoch=0, alloc=None)


def test_big_endian_data_reads_and_other_dtypes_are_named(tmp_path):
    path = tmp_path / "odd.h5"
    with h5py.File(path, "w") as f:
        f["be"] = np.arange(12, dtype=">f4").reshape(6, 2)
        f["y"] = np.arange(6, dtype=">i8")
        f["s"] = np.array([b"a"] * 6, dtype=h5py.string_dtype())
    ds = gpufeed.sources.HDF5Dataset(path, ("be", "y"))
    assert ds[1][0].tolist() == [2.0, 3.0] and ds[1][1].item() == 1
    got = list(gpufeed.DataLoader(ds, batch_size=4, num_workers=1))
    assert torch.equal(torch.cat([b[0] for b in got]), torch.arange(12.0).view(6, 2))
    assert torch.cat([b[1] for b in got]).tolist() == list(range(6))
    with pytest.raises(TypeError, match=r"\['s'\] has dtype object, which no torch tensor"):
        gpufeed.sources.HDF5Dataset(path, ("y", "s"))


def test_one_handle_per_process_never_across_fork(h5file):
    ds = gpufeed.sources.HDF5Dataset(h5file, ["labels"])
    assert ds._file is None  # closed after validation: nothing open to fork
    ds[0]
    handle = ds._file
    assert handle is not None and ds._pid == os.getpid()
    assert pickle.loads(pickle.dumps(ds))._file is None
    r, w = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+: fork with threads alive warns
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # child: must open its own
        ds[1]
        os.write(w, b"1" if ds._file is not handle and ds._pid == os.getpid() else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.close(w)
    assert ds[2][0].item() == 2 and ds._file is handle  # the parent's handle still works
    ds.close()


def test_faults_are_named(h5file, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"nothing\.h5"):
        gpufeed.sources.HDF5Dataset(tmp_path / "nothing.h5", ["x"])
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not hdf5 at all" * 10)
    with pytest.raises(OSError, match=r"bad\.h5"):
        gpufeed.sources.HDF5Dataset(bad, ["x"])
    with pytest.raises(KeyError, match="no dataset 'nope'"):
        gpufeed.sources.HDF5Dataset(h5file, ["labels", "nope"])
    with h5py.File(tmp_path / "short.h5", "w") as f:
        f["a"], f["b"] = np.zeros(3), np.zeros(4)
    with pytest.raises(ValueError, match=r"differ in length \[3, 4\]"):
        gpufeed.sources.HDF5Dataset(tmp_path / "short.h5", ["a", "b"])
    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(ImportError, match=r"pip install 'gpufeed\[hdf5\]'"):
        gpufeed.sources.HDF5Dataset(h5file, ["labels"])


def test_file_removed_after_start_is_named(tmp_path):
    path = tmp_path / "gone.h5"
    with h5py.File(path, "w") as f:
        f["a"] = np.arange(8)
    ds = _hdf5.HDF5Dataset(path, ["a"])
    path.unlink()
    with pytest.raises(Exception, match=r"gone\.h5"):
        list(gpufeed.DataLoader(ds, batch_size=4, num_workers=1))


def test_repr_is_torchvisions_layout(h5file):
    lines = repr(gpufeed.sources.HDF5Dataset(h5file, ("images", "labels"))).splitlines()
    assert lines == ["Dataset HDF5Dataset", "    Number of datapoints: 90",
                     f"    Root location: {h5file}",
                     "    Keys: images uint8 (3, 4, 4), labels int64 ()",
                     "    Chunk cache: 64.0 MiB per file"]
