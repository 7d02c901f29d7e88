"""System reads, gpufeed's one reader of each: the CPUs this process may use, the memory it may
still take, and what a process tree uses of both. ``_tools/probe.py`` hands them to the doctor
(tests replace them there); the tuner and the autotuner (``num_workers="auto"``) take their
budgets from them. Usable CPUs are divided among the local ranks under torchrun
(``LOCAL_WORLD_SIZE``) because each rank runs a loader of its own on the same cores. Run-queue
time matters because workers that wait for a core would not go faster in greater numbers,
whoever keeps the cores busy.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

_ROLLUP_KEYS = {"Pss:": "pss", "Pss_Anon:": "anon", "Pss_File:": "file", "Pss_Shmem:": "shmem"}
_PRIVATE_KEYS = {"Private_Clean:": "clean", "Private_Dirty:": "dirty"}


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def cpu_quota() -> float | None:
    """CPUs allowed by the cgroup quota (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``),
    fractional; None when unlimited or unknown."""
    text = _read("/sys/fs/cgroup/cpu.max")
    try:
        if text is not None:
            quota, period = text.split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        q, p = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _read(
            "/sys/fs/cgroup/cpu/cpu.cfs_period_us")
        if q is None or p is None or int(q) <= 0:
            return None
        return int(q) / int(p)
    except (ValueError, ZeroDivisionError):
        return None


def cpu_affinity() -> set[int] | None:
    """The CPUs this process may run on, None where the platform cannot say."""
    getter = getattr(os, "sched_getaffinity", None)
    return set(getter(0)) if getter is not None else None


def local_ranks() -> int:
    """Processes of this job on this machine (torchrun's ``LOCAL_WORLD_SIZE``), else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def usable_cpus(*, per_rank: bool = True) -> float:
    """CPUs this process may use: its affinity capped by the cgroup quota, and with
    ``per_rank`` divided among the local ranks."""
    affinity = cpu_affinity()
    usable = float(len(affinity)) if affinity else float(os.cpu_count() or 1)
    quota = cpu_quota()
    if quota is not None:
        usable = min(usable, quota)
    return usable / local_ranks() if per_rank else usable


def memory_available() -> int:
    """Bytes this process could still take: the kernel's available memory, capped by the
    cgroup v2 limit (``memory.max`` less ``memory.current``) where one is set."""
    import psutil

    avail = int(psutil.virtual_memory().available)
    limit, current = _read("/sys/fs/cgroup/memory.max"), _read("/sys/fs/cgroup/memory.current")
    if limit is not None and current is not None and limit.strip() != "max":
        with contextlib.suppress(ValueError):
            avail = min(avail, max(0, int(limit) - int(current)))
    return avail


def _smaps(pid: int, keys: dict[str, str]) -> dict[str, int] | None:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(" ")
                name = keys.get(key)
                if name is not None:
                    out[name] = int(rest.split()[0]) * 1024  # the file says kB
    except (OSError, ValueError, IndexError):
        return None
    return out


def rollup(pid: int) -> dict[str, int] | None:
    """PSS fields of ``/proc/<pid>/smaps_rollup`` in bytes (``pss``, and where the kernel
    splits it ``anon``, ``file``, ``shmem``); None where it cannot be read. Reading it makes
    the kernel walk the process's page tables (about 40 us per resident MiB)."""
    out = _smaps(pid, _ROLLUP_KEYS)
    return out if out is not None and "pss" in out else None


def private_bytes(pid: int) -> int | None:
    """The pages only process ``pid`` maps (``Private_Clean + Private_Dirty``), what one more
    worker adds: the pages it shares with the main process (libraries, the dataset before
    copy-on-write, the slot ring) are there already. None where it cannot be read."""
    out = _smaps(pid, _PRIVATE_KEYS)
    return None if not out else sum(out.values())


class CpuTimes(NamedTuple):
    """Cumulative seconds: ``total``, CPU of this process (every thread) and of the workers;
    ``workers``, CPU of the workers alone; ``queued``, time the workers were runnable but
    waited for a core (the kernel's run-queue delay, ``/proc/.../schedstat``; 0 where the
    kernel does not keep it)."""

    total: float
    workers: float
    queued: float


def thread_sched(pid: int, tid: int | None = None) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of thread ``tid`` of process
    ``pid`` (its main thread when None), cumulative: they split a stretch of wall time into
    on a core, waiting for one and asleep. None where the kernel keeps no ``schedstat`` (not
    Linux) or the thread is gone."""
    text = _read(f"/proc/{pid}/task/{pid if tid is None else tid}/schedstat")
    if text is None:
        return None
    try:
        cpu, queued = text.split()[:2]
        return int(cpu) / 1e9, int(queued) / 1e9
    except ValueError:
        return None


class TreeCpu:
    """CPU and run-queue seconds of this process and a changing set of workers, cumulative.

    :meth:`read` takes the worker processes' pids and the thread workers' native ids. A
    worker's figures are those of the thread that runs it; one that has exited keeps its last
    figures, so the sums never go back as workers come and go. Without ``schedstat`` (not
    Linux), a process worker's CPU comes from psutil and nothing is queued.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, int], tuple[float, float]] = {}
        self._gone = {"p": [0.0, 0.0], "t": [0.0, 0.0]}  # exited workers' figures, by kind

    def read(self, pids: Iterable[int] = (), tids: Iterable[int] = ()) -> CpuTimes:
        now: dict[tuple[str, int], tuple[float, float]] = {}
        me = os.getpid()
        for kind, ids in (("p", pids), ("t", tids)):
            for i in ids:
                got = thread_sched(i) if kind == "p" else thread_sched(me, i)
                if got is None and kind == "p":
                    got = _psutil_cpu(i)
                if got is not None:
                    now[(kind, i)] = got
        for key, (spent, waited) in self._last.items():
            if key not in now:
                self._gone[key[0]][0] += spent
                self._gone[key[0]][1] += waited
        self._last = now
        cpu = {k: self._gone[k][0] + sum(v[0] for i, v in now.items() if i[0] == k)
               for k in "pt"}
        queued = self._gone["p"][1] + self._gone["t"][1] + sum(v[1] for v in now.values())
        # this process's CPU clock has its threads' time, exited ones too: add processes only
        return CpuTimes(time.process_time() + cpu["p"], cpu["p"] + cpu["t"], queued)


def _psutil_cpu(pid: int) -> tuple[float, float] | None:
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError):
        return None
    return t.user + t.system, 0.0
