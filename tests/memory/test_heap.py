"""NOTE [ Worker heap ] in _memory/heap.py: a process worker keeps the heap its samples need."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

import gpufeed
from gpufeed._memory import heap
from gpufeed._memory.heap import MMAP_THRESHOLD_MAX, HeapFollower

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
needs_glibc = pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")


class _Recorder:
    """A ``mallopt`` stand-in that appends each call to a file: forked workers inherit it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self) -> Callable[[int, int], int]:
        def mallopt(param: int, value: int) -> int:
            with open(self.path, "a") as f:
                f.write(f"{os.getpid()} {param} {value}\n")
            return 1
        return mallopt

    def calls(self) -> list[tuple[int, int, int]]:
        if not self.path.exists():
            return []
        return [tuple(map(int, line.split())) for line in self.path.read_text().splitlines()]


class Crops(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 6 * 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 64, 64), i % 251, dtype=torch.uint8)  # 12 KiB: 768 KiB batches


def test_process_workers_raise_the_thresholds_to_their_batches(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    recorder = _Recorder(tmp_path / "mallopt")
    monkeypatch.setattr(heap, "_mallopt", recorder)
    loader = gpufeed.DataLoader(Crops(), batch_size=64, num_workers=2,
                                multiprocessing_context="fork")
    for k, batch in enumerate(loader):
        assert torch.equal(batch[:, 0, 0, 0], torch.arange(k * 64, (k + 1) * 64) % 251)
    calls = recorder.calls()
    workers = {pid for pid, _, _ in calls}
    assert len(workers) == 2 and os.getpid() not in workers  # each worker, never the main
    batch = 64 * 3 * 64 * 64
    for pid in workers:  # once each: later batches are no larger
        mine = [(param, value) for p, param, value in calls if p == pid]
        assert len(mine) == 2, mine
        (trim, trim_to), (mmap, mmap_to) = mine
        assert (trim, mmap) == (heap.M_TRIM_THRESHOLD, heap.M_MMAP_THRESHOLD)
        assert batch <= mmap_to < batch + (64 << 10) and trim_to == 2 * mmap_to


def test_thread_workers_leave_the_process_heap_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    recorder = _Recorder(tmp_path / "mallopt")
    monkeypatch.setattr(heap, "_mallopt", recorder)
    assert len(list(gpufeed.DataLoader(Crops(), batch_size=64, num_workers=2,
                                       worker_type="thread"))) == 6
    assert recorder.calls() == []


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


@pytest.mark.parametrize(("env", "named"), [
    ({"MALLOC_MMAP_THRESHOLD_": "1000000"}, "MALLOC_MMAP_THRESHOLD_ is set"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}, "GLIBC_TUNABLES"),
    ({"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}, "tcmalloc"),
])
@needs_glibc
def test_left_alone_names_the_users_setting(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str,
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    why = heap.left_alone()
    assert why is not None and named in why


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
