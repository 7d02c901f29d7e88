"""System reads behind the autotuner's and the tuner's budgets (``_base/system.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpufeed._base import system
from gpufeed._host.cost import Budgets, default_max_workers


@pytest.mark.parametrize(("affinity", "quota", "ranks", "usable"), [
    ({0, 1, 2, 3, 4, 5, 6, 7}, None, "1", 8.0),
    ({0, 1, 2, 3, 4, 5, 6, 7}, 2.5, "1", 2.5),  # docker --cpus 2.5
    ({0, 1, 2, 3, 4, 5, 6, 7}, None, "4", 2.0),  # torchrun --nproc-per-node 4
    ({0, 1}, 6.0, "2", 1.0),
    ({0, 1}, None, "bogus", 2.0),
])
def test_usable_cpus_are_the_affinity_capped_by_the_quota_per_local_rank(
        monkeypatch, affinity, quota, ranks, usable):
    monkeypatch.setattr(system, "cpu_affinity", lambda: affinity)
    monkeypatch.setattr(system, "cpu_quota", lambda: quota)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    assert system.usable_cpus() == usable
    assert system.usable_cpus(per_rank=False) == min(len(affinity), quota or 99)
    assert Budgets.default(1 << 20).cpu_cores == usable
    assert default_max_workers(usable) == max(2, min(64, int(8 * usable)))


def test_memory_available_is_capped_by_the_cgroup_limit(monkeypatch):
    files = {"/sys/fs/cgroup/memory.max": "3000000\n", "/sys/fs/cgroup/memory.current": "1000000\n"}
    monkeypatch.setattr(system, "_read", files.get)
    assert system.memory_available() == 2_000_000
    files["/sys/fs/cgroup/memory.max"] = "max\n"
    assert system.memory_available() > 2_000_000


def test_tree_cpu_counts_workers_that_came_and_went():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\n"
                              "while time.time() - t < 0.3: pass\ntime.sleep(30)"])
    try:
        tree = system.TreeCpu()
        time.sleep(0.5)
        seen = tree.read([child.pid])
        assert seen.workers > 0.02 and seen.workers + seen.queued > 0.2  # busy, or queued
        child.kill()
        child.wait()
        later = tree.read([])  # gone: its figures stay in the sums
        assert later.workers == pytest.approx(seen.workers)
        assert later.total >= seen.total
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_private_bytes_of_this_process():
    if not os.path.exists("/proc/self/smaps_rollup"):
        pytest.skip("needs /proc/<pid>/smaps_rollup")
    assert system.private_bytes(os.getpid()) > 0
    assert system.private_bytes(2**22 + 12345) is None  # no such process
