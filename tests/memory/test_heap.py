"""NOTE [ Worker heap ] in _memory/heap.py: a process worker keeps the heap its samples need."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from gpufeed._memory import heap
from gpufeed._memory.heap import MMAP_THRESHOLD_MAX, HeapFollower

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


# A fresh interpreter: a worker inherits the test process's malloc state by fork, and glibc's
# thresholds in a long test session are wherever the tests before left them.
_SCRIPT = """
import ctypes
import numpy as np, torch
from torch.utils.data import Dataset
import gpufeed

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost").split()]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2

class Crops(Dataset):
    def __len__(self):
        return 6 * {batch}

    def __getitem__(self, i):
        heap = mallinfo2().arena  # bytes of heap the worker holds
        return torch.from_numpy(np.full({sample}, i % 251, dtype=np.uint8)), heap

for k, (crops, heap) in enumerate(gpufeed.DataLoader(Crops(), batch_size={batch},
                                                     num_workers=1)):
    assert torch.equal(crops[:, 0], torch.arange(k * {batch}, (k + 1) * {batch}) % 251)
    print(int(heap[-1] - heap[0]))
"""
BATCH, SAMPLE = 64, 3 * 192 * 192  # 7 MB batches of crops under glibc's first threshold


def _heap_growth_per_batch() -> list[int]:
    """Bytes a process worker's heap grew by over each batch, in a new process."""
    script = _SCRIPT.format(batch=BATCH, sample=SAMPLE)
    env = {k: v for k, v in os.environ.items() if k not in heap._USER_SET}  # glibc's own
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return [int(n) for n in out.stdout.split()]


needs_glibc = pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")


@needs_glibc
def test_a_process_worker_keeps_the_heap_a_batch_freed_for_the_next() -> None:
    # Without the follower glibc trims the batch's freed samples from the heap, and the next
    # batch grows it again, faulting every page in (2x slower fetches, in the NOTE).
    growth = _heap_growth_per_batch()
    assert max(growth[2:]) < BATCH * SAMPLE // 4, growth  # the first two: its first crops


def test_thresholds_follow_the_largest_batch_up_to_glibc_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(heap, "_mallopt", lambda: lambda p, v: calls.append((p, v)) or 1)
    follower = HeapFollower()
    follower.follow_batch(64 << 10)  # under the default: nothing to raise
    assert calls == []
    follower.follow_batch(7 << 20)
    assert calls == [(heap.M_TRIM_THRESHOLD, 14 << 20), (heap.M_MMAP_THRESHOLD, 7 << 20)]
    follower.follow_batch(1 << 20)  # smaller batches never lower it
    follower.follow_batch(7 << 20)
    assert len(calls) == 2
    follower.follow_batch(1 << 30)  # capped where glibc caps its own
    assert calls[-1] == (heap.M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
    assert follower.threshold == MMAP_THRESHOLD_MAX


def test_a_refused_setting_turns_the_follower_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(heap, "_mallopt", lambda: lambda p, v: calls.append(p) or 0)
    follower = HeapFollower()
    follower.follow_batch(7 << 20)
    follower.follow_batch(9 << 20)
    assert calls == [heap.M_TRIM_THRESHOLD] and not follower.active


@pytest.mark.parametrize("env", [
    {"MALLOC_MMAP_THRESHOLD_": "1000000"}, {"MALLOC_TOP_PAD_": "0"},
    {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"},
    {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
])
def test_malloc_chosen_by_the_user_is_not_touched(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert not HeapFollower().active


@needs_glibc
def test_glibc_without_user_settings_is_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in (*heap._USER_SET, "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(key, raising=False)
    assert HeapFollower().active
