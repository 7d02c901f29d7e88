"""Batches the ring does not hold: spill files instead of /dev/shm, leaves it cannot hold.

See NOTE [ Spill ] in ``_memory/spill.py``.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.utils.data as tud

import gpufeed
import gpufeed._memory.spill
from conftest import WORKER_TYPES
from support.compare import assert_same_batches, list_or_stop
from support.fakes import RichDataset
from support.leaks import no_leaks
from support.procs import deadline, script_env


class Sub(torch.Tensor):
    """A tensor subclass: its type must survive the trip, as with the stock loader."""


def _leaf(kind: str, i: int) -> torch.Tensor:
    if kind == "nested":
        with warnings.catch_warnings():  # "prototype stage" (also raised in workers)
            warnings.simplefilter("ignore", UserWarning)
            return torch.nested.nested_tensor([torch.arange(i + 1.0), torch.arange(2.0)])
    if kind == "sparse":
        return torch.eye(3).mul(i).to_sparse()
    if kind == "quantized":
        with warnings.catch_warnings():  # "deprecated" (also raised in workers)
            warnings.simplefilter("ignore", UserWarning)
            return torch.quantize_per_tensor(torch.arange(4.0) + i, 0.5, 0, torch.quint8)
    return (torch.arange(4.0) + i).as_subclass(Sub)


class OddLeafDataset(tud.Dataset):
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"odd": _leaf(self.kind, i), "plain": torch.full((300,), float(i))}


def list_collate(batch: list[dict[str, object]]) -> dict[str, object]:
    """Keeps the odd leaves as a list (default_collate refuses nested and sparse batches)."""
    return {"odd": [s["odd"] for s in batch], "plain": torch.stack([s["plain"] for s in batch])}


def _plain(x: object) -> object:
    """Values and types of an odd leaf, comparable with ==."""
    if isinstance(x, list):
        return [_plain(v) for v in x]
    assert isinstance(x, torch.Tensor)
    if x.is_nested:
        return ("nested", [t.tolist() for t in x.unbind()])
    if x.is_sparse:
        return ("sparse", x.to_dense().tolist())
    if x.is_quantized:
        return ("quantized", x.dtype, x.q_scale(), x.int_repr().tolist())
    return (type(x).__name__, x.tolist())


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")  # torch's unpickling
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")  # likewise
@pytest.mark.parametrize(
    "kind,worker_type",
    [
        *[(k, w) for k in ("nested", "sparse", "subclass") for w in WORKER_TYPES],
        ("quantized", "thread"),
        # torch's own pickling of a quantized tensor gives one with an "UnknownQuantizer"
        # (torch 2.13), with the stock loader too: nothing to compare with.
        pytest.param("quantized", "process", marks=pytest.mark.skip("torch cannot send it")),
    ],
)
@pytest.mark.usefixtures("no_leaks")
def test_leaves_the_ring_cannot_hold_go_the_ordinary_way_and_are_counted(kind, worker_type):
    ds = OddLeafDataset(kind)
    expected = list(tud.DataLoader(ds, batch_size=2, collate_fn=list_collate))
    loader = gpufeed.DataLoader(ds, batch_size=2, num_workers=2, collate_fn=list_collate,
                                worker_type=worker_type)
    with deadline(30):
        got = list_or_stop(loader)
        assert len(got) == len(expected) == 3
        for e, g in zip(expected, got, strict=True):
            assert _plain(g["odd"]) == _plain(e["odd"])
            assert torch.equal(g["plain"], e["plain"])
        del got, e, g  # torch's shared memory holds a descriptor per tensor (stock's too)
    assert loader.stats().counters.get("ring_unsupported") == 3


def test_tensor_subclass_keeps_its_type_through_default_collate(worker_type):
    ds = OddLeafDataset("subclass")
    expected = list(tud.DataLoader(ds, batch_size=2, num_workers=2))
    loader = gpufeed.DataLoader(ds, batch_size=2, num_workers=2, worker_type=worker_type)
    got = list_or_stop(loader)
    assert [_plain(b["odd"]) for b in got] == [_plain(b["odd"]) for b in expected]
    assert all(type(b["odd"]) is Sub for b in got)
    assert loader.stats().counters.get("ring_unsupported") == 3


@pytest.mark.usefixtures("no_leaks")
def test_batches_without_a_slot_leave_nothing_and_stay_intact():
    """ring_bytes=0: every batch travels in a spill file; kept batches are not overwritten,
    and nothing (file descriptor, /dev/shm entry, process) is left once they are dropped."""
    expected = list(tud.DataLoader(RichDataset(23), batch_size=5))
    with deadline(30):
        loader = gpufeed.DataLoader(RichDataset(23), batch_size=5, num_workers=2, ring_bytes=0)
        kept = list_or_stop(loader)
        assert_same_batches(expected, kept)
        assert loader.stats().counters.get("ring_grow", 0) == 0
        del kept, loader


def _fail_in_workers(main_pid: int):
    real = gpufeed._memory.spill.Region

    def region(size: int, *, shared: bool):
        if os.getpid() != main_pid:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        return real(size, shared=shared)

    return region


def test_out_of_shared_memory_says_which_memory_how_much_and_the_fixes(monkeypatch,
                                                                       small_dataset):
    """An injected failure to create a spill file (the workers inherit it by fork)."""
    monkeypatch.setattr(gpufeed._memory.spill, "Region", _fail_in_workers(os.getpid()))
    loader = gpufeed.DataLoader(small_dataset, batch_size=2, num_workers=2, ring_bytes=0,
                                multiprocessing_context="fork")
    with no_leaks(), deadline(30), pytest.raises(gpufeed.WorkerError) as info:
        list_or_stop(loader)
    msg = str(info.value)
    del info
    assert "shared memory" in msg and "memfd" in msg, msg
    assert f"{gpufeed._memory.spill.spill_reserve()} bytes" in msg, msg
    for fix in ("ring_bytes=", "worker_type='thread'", "/dev/shm"):
        assert fix in msg, f"{fix} missing from: {msg}"
    first = msg.splitlines()[0]  # gpufeed's own allocation, not the user's code
    assert first.startswith("Caught SharedMemoryError in DataLoader worker process"), first
    assert "collate_fn" not in first, first


SMALL_SHM_SCRIPT = """
import torch, torch.utils.data as tud, gpufeed

class Big(tud.Dataset):  # batches of 2 MB: twice the whole /dev/shm
    def __len__(self):
        return 24
    def __getitem__(self, i):
        return {"x": torch.full((256, 256), float(i)), "i": i}

expected = list(gpufeed.DataLoader(Big(), batch_size=8))
try:
    list(tud.DataLoader(Big(), batch_size=8, num_workers=2))
    print("STOCK-OK")  # then /dev/shm is not small here, and the test proves nothing
except RuntimeError:
    pass
for kw in (dict(), dict(ring_bytes=0)):
    got = list(gpufeed.DataLoader(Big(), batch_size=8, num_workers=2, **kw))
    assert len(got) == len(expected)
    assert all(torch.equal(g["x"], e["x"]) for g, e in zip(got, expected))

class BigSparse(tud.Dataset):  # torch shares sparse tensors through /dev/shm: too small
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return torch.full((512, 512), float(i)).to_sparse()

try:
    list(gpufeed.DataLoader(BigSparse(), batch_size=4, num_workers=2, collate_fn=list))
except RuntimeError as e:  # an error that names the memory and the ways out, not a crash
    assert "/dev/shm" in str(e) and "worker_type='thread'" in str(e), str(e)
else:
    raise AssertionError("sparse batches fit a 1 MB /dev/shm?")
print("OK")
"""


def test_a_1_mb_dev_shm_does_not_matter_to_process_workers():
    """In a private mount namespace with a 1 MB /dev/shm, where stock's workers fail."""
    if shutil.which("unshare") is None or sys.platform != "linux":
        pytest.skip("needs unshare (Linux)")
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1M tmpfs /dev/shm"],
        capture_output=True, text=True, timeout=30, check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.strip()}")
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c",
         f"mount -t tmpfs -o size=1M tmpfs /dev/shm && exec {sys.executable} -c \"$0\"",
         SMALL_SHM_SCRIPT],
        env=script_env(), capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.split() == ["OK"], proc.stdout
