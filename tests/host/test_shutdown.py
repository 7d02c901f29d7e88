"""Shutdown: closing, dropping and forking loaders, running out of descriptors, interpreter
exit and Ctrl-C: nothing hangs, nothing leaks.

"Nothing leaks" is checked by :func:`support.leaks.no_leaks`: child processes of the test process,
/dev/shm entries, open file descriptors and gpufeed threads, before and after (after
``gc.collect()``, allowed a few seconds to settle). Errors raised in workers are in
``test_worker_errors.py``.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import threading
import time

import pytest

import gpufeed
from conftest import WORKER_TYPES
from support.compare import list_or_stop
from support.fakes import (
    BlockDataset,
    DatasetBoom,
    FailingDataset,
    GcProbeDataset,
)
from support.leaks import gone, no_leaks, snapshot
from support.procs import deadline, run_script, spawn_script, timer

# -- closing -------------------------------------------------------------------------------------


def _break_out(loader):
    for k, _ in enumerate(loader):
        if k == 2:
            break


def _raise_in_loop(loader):
    for k, _ in enumerate(loader):
        if k == 2:
            raise DatasetBoom("the user's training step failed")


def _close_cases():
    for wt in WORKER_TYPES:
        for how in ("close", "del", "break", "user_exception", "exhausted", "exhausted_fallback",
                    "dataset_error", "persistent_gc", "context_manager"):
            yield pytest.param(how, wt, id=f"{how}-{wt}")


@pytest.mark.parametrize("how,worker_type", list(_close_cases()))
def test_closing_leaves_no_process_shm_or_fd(how, worker_type):
    kwargs = dict(batch_size=4, num_workers=2, worker_type=worker_type)
    if how == "exhausted_fallback":
        kwargs["ring_bytes"] = 0
    if how == "persistent_gc":
        kwargs["persistent_workers"] = True
    ds = FailingDataset(40, bad=10) if how == "dataset_error" else BlockDataset(40)
    with no_leaks(), deadline(20):
        loader = gpufeed.DataLoader(ds, **kwargs)
        if how in ("close", "context_manager"):
            it = iter(loader)
            next(it)
            if how == "close":
                it.close()
                it.close()  # idempotent
            else:
                with it:
                    next(it)
            with pytest.raises(StopIteration):
                next(it)
            # `it` stays referenced past the check: closing alone must release everything
        elif how == "del":
            it = iter(loader)
            next(it)
            del it
        elif how == "break":
            _break_out(loader)
        elif how == "user_exception":
            with pytest.raises(DatasetBoom) as info:
                _raise_in_loop(loader)
            del info
        elif how in ("exhausted", "exhausted_fallback"):
            assert sum(1 for _ in loader) == 10
        elif how == "dataset_error":
            with pytest.raises(DatasetBoom) as info:
                list(loader)
            del info
        elif how == "persistent_gc":
            assert sum(1 for _ in loader) == 10
            _break_out(loader)
        del loader


def test_closed_iterator_stops_cleanly():
    it = iter(gpufeed.DataLoader(BlockDataset(40), batch_size=4, num_workers=2))
    next(it)
    it.close()
    it.close()
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_programs_that_reach_for_the_stock_iterators_workers_keep_working(worker_type):
    """``loader._iterator._workers`` (pids for taskset or memory probes) and
    ``loader._iterator._shutdown_workers()`` (persistent workers stopped before a loader is
    replaced): private names of torch's iterator, used by programs written for it."""
    with no_leaks(), deadline(20):
        loader = gpufeed.DataLoader(BlockDataset(40), batch_size=4, num_workers=2,
                                    persistent_workers=True, worker_type=worker_type)
        assert sum(1 for _ in loader) == 10
        held = list(loader._iterator._workers)
        pids = [w.pid for w in held]
        if worker_type == "thread":
            assert pids == []  # no process to name
        else:
            assert len(pids) == 2 and not any(gone(p) for p in pids)
            assert sum(1 for _ in loader) == 10  # persistent: the same processes
            assert [w.pid for w in loader._iterator._workers] == pids
        loader._iterator._shutdown_workers()
        loader._iterator._shutdown_workers()  # idempotent, as stock's
        assert loader._iterator._workers == []
        assert all(gone(p) for p in pids)
        # the process objects a program kept still answer, as stock's do (each holds a
        # descriptor until dropped, as stock's)
        assert all(p.join(1.0) is None and not p.is_alive() and p.exitcode is not None
                   for p in held)
        del held
        assert sum(1 for _ in loader) == 10  # the next iter() starts afresh
        del loader


def test_close_is_fast_while_another_iterator_runs():
    """Workers forked later inherit this iterator's pipe ends: EOF alone would not stop it."""
    a = iter(gpufeed.DataLoader(BlockDataset(40), batch_size=4, num_workers=2))
    next(a)
    b = iter(gpufeed.DataLoader(BlockDataset(40), batch_size=4, num_workers=2))
    next(b)
    try:
        with timer() as elapsed:
            a.close()
        assert elapsed() < 1.0, f"close() took {elapsed():.2f} s"
    finally:
        a.close()
        b.close()


def test_iterators_inherited_by_forked_workers_are_not_closed_there(small_dataset):
    """A worker's gc may collect an unclosed iterator it inherited: nothing may run there."""
    gc.collect()
    gc.disable()  # keep the garbage below uncollected until the workers have forked
    try:
        old = gpufeed.DataLoader(small_dataset, batch_size=2, num_workers=1,
                                 persistent_workers=True)
        next(iter(old))
        old.cycle = old  # cyclic garbage with a running iterator inside
        del old
        probes = list_or_stop(gpufeed.DataLoader(GcProbeDataset(), batch_size=None, num_workers=1))
    finally:
        gc.enable()
        gc.collect()
    assert probes == [0, 0], "finalizers raised in the worker process"


class _FailsThenCollects(FailingDataset):
    """Sample 0 fails; every other sample runs a garbage collection, as an allocation in a
    worker thread (a decode, an import inside Pillow's Image.open) may."""

    def __getitem__(self, i):
        if i == 0:
            raise DatasetBoom("cannot load sample 0")
        time.sleep(0.002)
        gc.collect()
        return i


def test_an_iterator_finalized_on_its_own_thread_worker_stops_its_threads(monkeypatch):
    """Five failed epochs whose iterators only a garbage collection frees, and the collection
    runs on a worker thread (this pool's or the next one's): the finalizer must not join its
    own thread ("cannot join current thread"), nor wait on the others, and every thread ends."""
    unraisable: list[str] = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: unraisable.append(repr(u.exc_value)))
    with deadline(60):
        for _ in range(5):
            loader = gpufeed.DataLoader(_FailsThenCollects(40), batch_size=2, num_workers=2,
                                        worker_type="thread")
            it = iter(loader)
            cycle = [it]
            cycle.append(cycle)  # only a collection frees the iterator
            with pytest.raises(DatasetBoom):
                for _batch in it:
                    pass
            del it, cycle, loader
            time.sleep(0.1)  # the workers, still fetching ahead, collect it
        gc.collect()
        gone_in = time.monotonic() + 5
        while time.monotonic() < gone_in and _gpufeed_threads():
            time.sleep(0.05)
    assert unraisable == []
    assert _gpufeed_threads() == []


def _gpufeed_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("gpufeed")]


STRESS_SCRIPT = """
import faulthandler, gc, sys, threading, time, weakref
import psutil, torch, torch.utils.data as tud, gpufeed
from support.fakes import RichDataset
faulthandler.dump_traceback_later({hang_s}, exit=True)  # a hang fails, with its stacks
gc.disable()  # the point: shutdown may not wait for a cyclic collection
me = psutil.Process()
KINDS = [("process", False), ("thread", True), ("stock", False), ("process", True),
         ("thread", False)]
worst = 0.0
for n in range({rounds}):
    wt, persistent = KINDS[n % len(KINDS)]
    ds = RichDataset(16)
    shuffle = n % 10 >= 5
    if wt == "stock":
        loader = tud.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=persistent,
                                shuffle=shuffle)
    else:
        loader = gpufeed.DataLoader(ds, batch_size=4, num_workers=2, worker_type=wt,
                                    persistent_workers=persistent, shuffle=shuffle)
    before = {{p.pid for p in me.children()}}
    for epoch in range(2 if persistent else 1):
        it = iter(loader)
        got = sum(1 for _ in it)
        assert got == 4, (n, wt, got)  # every loader finishes its epochs
    pids = {{p.pid for p in me.children()}} - before
    threads = [t for t in threading.enumerate() if t.name.startswith("gpufeed-worker")]
    dataset = weakref.ref(ds)
    del it, loader, ds
    if dataset() is not None:  # as stock's: nothing of the loader's keeps it
        sys.exit(f"round {{n}} ({{wt}}, persistent={{persistent}}, shuffle={{shuffle}}): the "
                 "dataset outlived its loader")
    t0 = time.monotonic()
    while True:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        alive += [t.name for t in threads if t.is_alive()]
        if wt == "stock" or not alive:
            break
        if time.monotonic() - t0 > 5:
            sys.exit(f"round {{n}} ({{wt}}, persistent={{persistent}}): {{alive}} outlived the "
                     "loader by 5 s")
        time.sleep(0.02)
    worst = max(worst, time.monotonic() - t0)
print("OK", worst)
"""


def test_dropping_loaders_stops_their_workers_without_the_garbage_collector():
    """``del it, loader, dataset`` stops gpufeed's workers and frees the dataset at once (no
    reference cycle keeps them), and stock loaders created in between keep working: 50 loaders
    of five kinds, shuffled or not, one after the other, in one process with the cyclic
    collector off."""
    proc = run_script(STRESS_SCRIPT.format(rounds=50, hang_s=150), timeout=180)
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stdout + proc.stderr



FORK_SCRIPT = """
import os, sys, gpufeed
from support.fakes import RichDataset
codes = []
for wt in {worker_types!r}:  # one loader at a time, each in a fork of its own
    loader = gpufeed.DataLoader(RichDataset(8), batch_size=2, num_workers=2,
                                worker_type=wt, persistent_workers=True)
    assert len(list(loader)) == 4
    pid = os.fork()
    if pid == 0:
        try:
            list(loader)
        except RuntimeError as e:
            print("CHILD", wt, e, flush=True)
            os._exit(0)
        os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert len(list(loader)) == 4, wt  # the parent's loader still works
    codes.append(os.waitstatus_to_exitcode(status))
    del loader
print("CODES", *codes, flush=True)
sys.exit(max(codes))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_persistent_loader_inherited_by_fork_says_to_recreate_it():
    """Every worker type, in one interpreter (one start instead of one per type)."""
    proc = run_script(FORK_SCRIPT.format(worker_types=WORKER_TYPES), timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = {line.split()[1]: line for line in proc.stdout.splitlines()
            if line.startswith("CHILD ")}
    assert set(said) == set(WORKER_TYPES), proc.stdout
    for line in said.values():
        assert "created before a fork" in line and "re-create the DataLoader" in line, line


FD_SCRIPT = """
import os, resource, gpufeed
from support.fakes import RichDataset
it = iter(gpufeed.DataLoader(RichDataset(64), batch_size=4, num_workers=2, ring_bytes=0,
                             prefetch_factor=2))  # every batch arrives as a descriptor
next(it)
top = max(int(f) for f in os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE,
                   (top + 8, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
hold = []
while True:  # use up every descriptor number
    try:
        hold.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        break
try:
    sum(1 for _ in it)
except RuntimeError as e:
    print(type(e).__name__, e)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_running_out_of_file_descriptors_says_so_like_stock():
    proc = run_script(FD_SCRIPT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    msg = proc.stdout
    assert msg.startswith("WorkerError Too many open files."), msg + proc.stderr
    assert "`ulimit -n`" in msg and "set_sharing_strategy('file_system')" in msg, msg
    assert "ancdata" not in msg, msg

KEPT_SCRIPT = """
import resource, torch, torch.utils.data as tud, gpufeed
resource.setrlimit(resource.RLIMIT_NOFILE, (100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

class Tiny(tud.IterableDataset):
    def __iter__(self):
        for i in range(5000):
            yield torch.tensor([i])

kept = []  # every batch kept: past the ring's budget each one travels as a descriptor
try:
    for batch in gpufeed.DataLoader(Tiny(), batch_size=1, num_workers=2):
        kept.append(batch)
    print("finished", len(kept))
except RuntimeError as e:
    print(type(e).__name__, e)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_keeping_batches_under_a_low_descriptor_limit_says_so_like_stock():
    """``ulimit -n 100``, tiny batches of an iterable dataset, every batch kept: a worker (or
    the main process) runs out of descriptors passing a batch's memory file. The error is
    torch's "Too many open files" text, not a worker that "exited unexpectedly (code 0)"."""
    proc = run_script(KEPT_SCRIPT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    msg = proc.stdout
    assert msg.startswith("WorkerError Too many open files. Communication with the workers is "
                          "no longer possible."), msg + proc.stderr[-2000:]
    assert "`ulimit -n`" in msg and "set_sharing_strategy('file_system')" in msg, msg
    assert "exited unexpectedly" not in msg and "num_workers=0" not in msg, msg


# -- interpreter exit and Ctrl-C -------------------------------------------------------------------

EXIT_SCRIPT = """
import sys, psutil, gpufeed
from support.fakes import BlockDataset, SleepDataset
ds = {dataset}
loader = gpufeed.DataLoader(ds, batch_size=2, num_workers=2, worker_type={wt!r},
                            persistent_workers={persistent})
it = iter(loader)
next(it); next(it)
print("PIDS", *[p.pid for p in psutil.Process().children(recursive=True)], flush=True)
{ending}
"""


@pytest.mark.parametrize(
    "case",
    [
        "process",
        pytest.param("thread_stuck_in_user_code", marks=pytest.mark.slow),
        "persistent",
        "uncaught_exception",
    ],
)
def test_interpreter_exit_mid_epoch_leaves_nothing(case):
    dataset = "BlockDataset(400)"
    if case == "thread_stuck_in_user_code":
        dataset = "SleepDataset(400, slow_from=6, seconds=60)"
    code = EXIT_SCRIPT.format(
        dataset=dataset,
        wt="thread" if case.startswith("thread") else "process",
        persistent=case == "persistent",
        ending="raise RuntimeError('user code failed')" if case == "uncaught_exception"
        else "sys.exit(0)",
    )
    before = snapshot()
    with timer() as elapsed:
        proc = run_script(code, timeout=30)
    assert elapsed() < 15, f"the interpreter took {elapsed():.1f} s to exit"
    assert proc.stdout.startswith("PIDS"), proc.stderr
    pids = [int(p) for p in proc.stdout.split()[1:]]
    if case == "uncaught_exception":
        assert proc.returncode == 1
        assert proc.stderr.count("Traceback") == 1 and "user code failed" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, \
            proc.stderr
    end = time.monotonic() + 3
    while not all(gone(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert all(gone(p) for p in pids), f"workers outlived the interpreter: {pids}"
    assert _ours(snapshot().shm - before.shm, set(pids)) == set()  # (workers make segments)


def _ours(shm: set[str], pids: set[int]) -> set[str]:
    """/dev/shm entries, less torch's ``torch_<pid>_...`` of processes outside ``pids``
    (other test runs on the machine come and go meanwhile)."""
    return {
        name for name in shm
        if not (m := re.match(r"torch_(\d+)_", name)) or int(m.group(1)) in pids
    }


CTRL_C_SCRIPT = """
import psutil, gpufeed
from support.fakes import SleepDataset
loader = gpufeed.DataLoader(SleepDataset(10**6, slow_from=0, seconds=0.02, once=False),
                            batch_size=1, num_workers=2, worker_type={wt!r})
it = iter(loader)
next(it)
print("PIDS", *[p.pid for p in psutil.Process().children(recursive=True)], flush=True)
for _ in it:
    pass
"""


def test_ctrl_c_stops_promptly_with_keyboard_interrupt(worker_type):
    proc = spawn_script(CTRL_C_SCRIPT.format(wt=worker_type))
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), proc.stderr.read() if proc.poll() is not None else line
        pids = [int(p) for p in line.split()[1:]]
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        with timer() as elapsed:
            _, err = proc.communicate(timeout=15)
        assert elapsed() < 5, f"Ctrl-C took {elapsed():.1f} s"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err, err
    assert "Exception ignored" not in err, err
    end = time.monotonic() + 3
    while not all(gone(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert all(gone(p) for p in pids), f"workers outlived Ctrl-C: {pids}"


def test_a_second_ctrl_c_at_exit_still_stops_every_loader_quietly(monkeypatch):
    """The exit hook closes every live iterator; a Ctrl-C inside one close (a terminal sends
    it to the whole group twice) stops the others at once instead of escaping as a traceback
    and leaving them to their workers' parent check."""
    from gpufeed._host import pool

    closed = []

    class Fake:
        def __init__(self, name, interrupt):
            self.name, self.interrupt = name, interrupt

        def close(self, grace_s):
            closed.append((self.name, grace_s))
            if self.interrupt:
                raise KeyboardInterrupt

    fakes = [Fake("a", True), Fake("b", False)]
    monkeypatch.setattr(pool, "live", fakes)
    pool.close_all()
    assert closed == [("a", pool.GRACE_S), ("b", 0.0)]
