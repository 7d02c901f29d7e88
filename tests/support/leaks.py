"""Resource snapshots: processes, /dev/shm entries, fds and threads before and after."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import threading
import time
from collections.abc import Iterator

import psutil

from gpufeed._tools.probe import helper_pids

# -- resources -------------------------------------------------------------------------------


@dataclasses.dataclass
class Resources:
    fds: dict[int, str]
    shm: set[str]
    children: set[int]
    threads: set[str]


def _fd_targets() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return out


def _multiprocessing_helpers() -> tuple[set[int], set[int]]:
    """(pids, fds) of multiprocessing's own helpers: its resource tracker (started once, on
    first use, with a pipe kept open) and a forkserver."""
    from multiprocessing import forkserver, resource_tracker

    fds = {getattr(resource_tracker._resource_tracker, "_fd", None),
           getattr(forkserver._forkserver, "_forkserver_alive_fd", None)}
    return helper_pids(), {fd for fd in fds if fd is not None}


def snapshot() -> Resources:
    gc.collect()
    helper_pids, helper_fds = _multiprocessing_helpers()
    return Resources(
        fds={fd: t for fd, t in _fd_targets().items() if fd not in helper_fds},
        shm=set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set(),
        children={p.pid for p in psutil.Process().children(recursive=True)} - helper_pids,
        threads={t.name for t in threading.enumerate() if t.name.startswith("gpufeed")},
    )


def leaks(before: Resources, after: Resources) -> list[str]:
    out = []
    if len(after.fds) > len(before.fds):
        new = {fd: t for fd, t in after.fds.items() if before.fds.get(fd) != t}
        out.append(f"{len(after.fds) - len(before.fds)} more open fds; new: {new}")
    if after.shm - before.shm:
        out.append(f"new /dev/shm entries: {sorted(after.shm - before.shm)}")
    if after.children - before.children:
        procs = []
        for pid in sorted(after.children - before.children):
            try:
                procs.append(f"{pid} ({psutil.Process(pid).status()})")
            except psutil.NoSuchProcess:
                procs.append(f"{pid} (gone)")
        out.append(f"worker processes left: {procs}")
    if after.threads - before.threads:
        out.append(f"threads left: {sorted(after.threads - before.threads)}")
    return out


def assert_no_leaks(before: Resources, settle_s: float = 3.0) -> None:
    """Wait up to ``settle_s`` for processes, shm, fds and threads to return to ``before``."""
    end = time.monotonic() + settle_s
    while True:
        problems = leaks(before, snapshot())
        if not problems:
            return
        if time.monotonic() > end:
            raise AssertionError("; ".join(problems))
        time.sleep(0.05)


@contextlib.contextmanager
def no_leaks(settle_s: float = 3.0) -> Iterator[None]:
    """The check of the ``no_leaks`` fixture (``tests/conftest.py``) around a block: for a check
    that must run while the test still holds something (an exception, a closed iterator)."""
    before = snapshot()
    yield
    assert_no_leaks(before, settle_s)


def worker_pids() -> list[int]:
    return [p.pid for p in psutil.Process().children(recursive=True)]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
