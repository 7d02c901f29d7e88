"""Forked process workers and Python's cyclic collector (NOTE [ Frozen heap at fork ] in
``_host/frozen_heap.py``): a worker's full collection neither finalizes the program's garbage
nor copies the pages of the objects it inherited; the program's own collector and freeze are
left as they were."""

from __future__ import annotations

import gc
import os
import sys
import sysconfig

import pytest
import torch

import gpufeed
from gpufeed._base.system import private_bytes

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the fork start method")


class Collecting(torch.utils.data.Dataset):
    """Each sample runs a full collection in the worker that fetches it (as code calling
    ``gc.collect()`` does, or Python 3.14's incremental collector over time) and returns its
    pid and how much of its memory the collection made private (KiB; -1 without smaps)."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        before = _private_kib()
        gc.collect()
        return torch.tensor([os.getpid(), _private_kib() - before])


def _private_kib():
    private = private_bytes(os.getpid())
    return -1 if private is None else private // 1024


class Finalized:
    """Garbage of the program's, in a reference cycle: its finalizer notes the process that
    runs it in a file."""

    def __init__(self, path):
        self.path, self.me = path, self

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def _garbage_in_the_oldest_generation(path):
    """A cycle the program has dropped but its collector not yet found: it waits in the oldest
    generation for the next full collection."""
    held = Finalized(path)
    gc.collect()
    gc.collect()
    del held


def _loaders():
    return {
        "workers": lambda: gpufeed.DataLoader(Collecting(), batch_size=None, num_workers=2),
        # workers started mid-epoch by num_workers="auto" (the elastic pool's own start)
        "grown": lambda: _auto(gpufeed.DataLoader(Collecting(), batch_size=None,
                                                  num_workers="auto")),
    }


def _auto(loader):
    loader._autotune.schedule = lambda k: 1 if k < 2 else 3
    return loader


@pytest.mark.parametrize("start", ["workers", "grown"])
def test_a_worker_never_finalizes_the_programs_garbage(start, tmp_path):
    path = tmp_path / "finalized"
    path.write_text("")
    loader = _loaders()[start]()
    gc.disable()  # the program's collector waits (as it would between two full collections)
    try:
        _garbage_in_the_oldest_generation(path)
        pids = {int(b[0]) for b in loader}
        assert os.getpid() not in pids and len(pids) >= 2
        assert path.read_text() == ""  # no worker finalized it, though each collected
    finally:
        gc.enable()
    gc.collect()
    assert path.read_text() == f"{os.getpid()}\n"  # the program's collector, once


@pytest.mark.skipif(_private_kib() < 0, reason="needs /proc/self/smaps_rollup")
def test_a_workers_full_collection_leaves_the_inherited_objects_pages_shared():
    rows = [{"id": i, "box": [float(i), 1.0, 2.0, 3.0]} for i in range(300_000)]  # ~75 MiB
    gc.collect()
    grown_kib = [int(b[1]) for b in gpufeed.DataLoader(Collecting(), batch_size=None,
                                                       num_workers=2)]
    # unfrozen, one collection made 86 MiB of each worker's memory private here
    assert max(grown_kib) < 4096, grown_kib
    del rows


def test_the_programs_collector_and_own_freeze_are_left_as_they_were():
    startup = gc.get_freeze_count()  # not 0 on Python 3.12, which freezes objects of its own
    assert len(list(gpufeed.DataLoader(Collecting(), batch_size=None, num_workers=2))) == 16
    assert gc.get_freeze_count() == startup  # the program's objects collectable as before
    kept = [[i] for i in range(1000)]
    gc.freeze()  # the program's own freeze, e.g. for its own forks
    try:
        frozen = gc.get_freeze_count()
        assert len(list(gpufeed.DataLoader(Collecting(), batch_size=None, num_workers=2))) == 16
        assert gc.get_freeze_count() == frozen  # neither undone nor widened
    finally:
        gc.unfreeze()
    del kept


@pytest.mark.skipif(bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
                    reason="a free-threaded build freezes in the main process (see the NOTE)")
@pytest.mark.parametrize("start", ["workers", "grown"])
def test_the_programs_young_garbage_stays_young_across_a_start(start, tmp_path):
    """Starting workers leaves the main process's generations as they were: a cycle dropped
    just before is found by the next collection of the youngest generation."""
    path = tmp_path / "finalized"
    path.write_text("")
    loader = _loaders()[start]()
    gc.collect()
    gc.disable()  # nothing collects but the test
    try:
        held = Finalized(path)
        del held  # young garbage, before the workers start (a pool's, or the added ones)
        assert len(list(loader)) == 16
        gc.collect(0)
        assert path.read_text() == f"{os.getpid()}\n"
    finally:
        gc.enable()
