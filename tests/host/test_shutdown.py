"""Errors, crashes, timeouts and shutdown: nothing hangs, nothing leaks.

"Nothing leaks" is checked by :func:`support.leaks.no_leaks`: child processes of the test process,
/dev/shm entries, open file descriptors and gpufeed threads, before and after (after
``gc.collect()``, allowed a few seconds to settle).
"""

from __future__ import annotations

import errno
import gc
import multiprocessing.context
import os
import re
import signal
import sys
import threading
import time

import pytest
import torch.utils.data as tud

import gpufeed
from support.compare import drain
from support.fakes import (
    BlockDataset,
    DatasetBoom,
    FailingDataset,
    GcProbeDataset,
    KillDataset,
    RichDataset,
    SleepDataset,
    failing_init,
    staggered_failing_init,
)
from support.leaks import gone, no_leaks, snapshot, worker_pids
from support.procs import deadline, run_script, spawn_script, timer

WORKER_TYPES = ["process", "thread"]


# -- exceptions raised by user code ------------------------------------------------------------


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
@pytest.mark.parametrize("exc_type", [DatasetBoom, KeyError, ValueError, IndexError])
def test_dataset_exception_reraised_with_type_traceback_and_index(exc_type, worker_type):
    loader = gpufeed.DataLoader(FailingDataset(20, bad=13, exc_type=exc_type), batch_size=4,
                                num_workers=2, worker_type=worker_type)
    with no_leaks(), deadline(15):
        with pytest.raises(exc_type) as info:
            drain(loader)
        msg = str(info.value)
        del info
    assert "cannot load sample 13" in msg  # the original message
    assert "Traceback (most recent call last)" in msg and "fakes.py" in msg
    assert "__getitem__" in msg  # the worker's frames
    assert re.search(r"index[^\n]*\b13\b", msg), f"no failing sample index in: {msg[:300]}"
    assert re.search(r"worker \d", msg), msg[:300]


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_locally_defined_exception_class(worker_type):
    """Thread workers pickle nothing: the original class comes back. Process workers cannot
    send a class defined in a function: a RuntimeError that names it."""

    class LocalBoom(Exception):
        pass

    class Bad(tud.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            if i == 5:
                raise LocalBoom("sample 5 is bad")
            return i

    loader = gpufeed.DataLoader(Bad(), batch_size=2, num_workers=2, worker_type=worker_type)
    expected = LocalBoom if worker_type == "thread" else RuntimeError
    with no_leaks(), deadline(15), pytest.raises(expected) as info:
        drain(loader)
    assert type(info.value) is expected
    assert "Caught LocalBoom" in str(info.value) and "sample 5 is bad" in str(info.value)


def test_dataset_exception_in_main_process_is_the_original():
    with pytest.raises(DatasetBoom) as ours:
        list(gpufeed.DataLoader(FailingDataset(20, bad=13), batch_size=4))
    with pytest.raises(DatasetBoom) as stock:
        list(tud.DataLoader(FailingDataset(20, bad=13), batch_size=4))
    assert str(ours.value) == str(stock.value) == "cannot load sample 13"


def _outcomes(loader):
    """Every next() of one epoch: a batch (as a list) or the name of the exception."""
    it = iter(loader)
    out = []
    try:
        while True:
            try:
                out.append(next(it).tolist())
            except StopIteration:
                return out
            except DatasetBoom:
                out.append("DatasetBoom")
    finally:
        if hasattr(it, "close"):
            it.close()


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_iteration_continues_after_a_dataset_exception_like_stock(worker_type):
    expected = _outcomes(tud.DataLoader(FailingDataset(20, bad=5), batch_size=4, num_workers=2))
    got = _outcomes(gpufeed.DataLoader(FailingDataset(20, bad=5), batch_size=4, num_workers=2,
                                       worker_type=worker_type))
    assert got == expected
    assert "DatasetBoom" in got


class BrokenStream(tud.IterableDataset):
    """Each worker's stream raises on sample 7 (whichever worker owns it)."""

    def __iter__(self):
        info = tud.get_worker_info()
        start, step = (info.id, info.num_workers) if info else (0, 1)
        for i in range(start, 20, step):
            if i == 7:
                raise DatasetBoom(f"stream broke at {i}")
            yield i


@pytest.mark.parametrize("num_workers,worker_type", [(0, "process"), (2, "process"),
                                                     (2, "thread")])
def test_iterable_dataset_exception_then_continues_like_stock(num_workers, worker_type):
    expected = _outcomes(tud.DataLoader(BrokenStream(), batch_size=2, num_workers=num_workers))
    got = _outcomes(gpufeed.DataLoader(BrokenStream(), batch_size=2, num_workers=num_workers,
                                       worker_type=worker_type))
    assert got == expected and "DatasetBoom" in got


def _bad_collate(batch):
    raise ValueError(f"collate cannot handle {len(batch)} samples")


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_collate_fn_exception_reraised(worker_type):
    loader = gpufeed.DataLoader(RichDataset(8), batch_size=4, num_workers=1,
                                collate_fn=_bad_collate, worker_type=worker_type)
    with no_leaks(), deadline(15):
        with pytest.raises(ValueError) as info:
            drain(loader)
        msg = str(info.value)
        del info
    assert "collate cannot handle 4 samples" in msg and "_bad_collate" in msg
    assert "collate_fn" in msg


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_worker_init_fn_error_is_clear_and_leaves_nothing(worker_type):
    loader = gpufeed.DataLoader(RichDataset(8), batch_size=4, num_workers=2,
                                worker_init_fn=failing_init, worker_type=worker_type)
    with no_leaks(), deadline(15), timer() as elapsed:
        with pytest.raises(ValueError) as info:
            drain(loader)
        msg = str(info.value)
        del info
    assert elapsed() < 5
    assert re.search(r"init failed in worker \d", msg) and "failing_init" in msg
    assert re.search(r"worker \d", msg)


def test_second_worker_init_error_prints_nothing(capfd):
    """Worker 1 fails after the main process has closed the pipes: no traceback on stderr."""
    loader = gpufeed.DataLoader(RichDataset(8), batch_size=4, num_workers=2,
                                worker_init_fn=staggered_failing_init)
    with deadline(15), pytest.raises(ValueError):
        drain(loader)
    time.sleep(1.0)  # worker 1 fails 0.5 s after worker 0
    err = capfd.readouterr().err
    assert "Traceback" not in err, err


def test_unpicklable_spawn_arguments_fail_cleanly():
    unraisable: list[str] = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: unraisable.append(f"{u.object!r}: {u.exc_value!r}")
    message = ""
    try:
        with no_leaks(), deadline(30):
            try:
                drain(gpufeed.DataLoader(RichDataset(8), batch_size=4, num_workers=2,
                                         multiprocessing_context="spawn",
                                         collate_fn=lambda b: b))
            except Exception as e:
                message = f"{type(e).__name__}: {e}"
            gc.collect()
    finally:
        sys.unraisablehook = old_hook
    assert "pickle" in message.lower(), message
    assert unraisable == [], unraisable


class _SecondForkFails(multiprocessing.context.ForkProcess):
    """fork() fails for the second worker (as at the process limit: EAGAIN)."""

    starts = 0

    def start(self):
        type(self).starts += 1
        if type(self).starts == 2:
            raise OSError(errno.EAGAIN, "fork failed (test)")
        super().start()


class _SecondForkFailsContext(multiprocessing.context.ForkContext):
    Process = _SecondForkFails


class _SecondThreadFails(threading.Thread):
    def start(self):
        if self.name == "gpufeed-worker-1":
            raise RuntimeError("can't start new thread (test)")
        super().start()


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_a_worker_that_cannot_start_leaves_nothing(worker_type, monkeypatch):
    """Worker 0 runs, worker 1 cannot start: worker 0, the pipes and the ring go at once."""
    kwargs = {}
    if worker_type == "process":
        _SecondForkFails.starts = 0
        kwargs["multiprocessing_context"] = _SecondForkFailsContext()
    else:
        monkeypatch.setattr(threading, "Thread", _SecondThreadFails)
    loader = gpufeed.DataLoader(RichDataset(8), batch_size=4, num_workers=2,
                                worker_type=worker_type, **kwargs)
    with no_leaks(), deadline(15), pytest.raises((OSError, RuntimeError)) as info:
        iter(loader)
    assert "(test)" in str(info.value)


class _BrokenSampler(tud.Sampler):
    def __init__(self):
        pass

    def __len__(self):
        return 8

    def __iter__(self):
        raise DatasetBoom("the sampler failed")


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_iterator_that_fails_while_starting_stops_its_workers_at_once(worker_type):
    """The first dispatch fails after the workers started. The exception kept by the caller
    holds the half-built iterator (in its traceback): stopping must not wait for the gc."""
    loader = gpufeed.DataLoader(RichDataset(8), sampler=_BrokenSampler(), batch_size=4,
                                num_workers=2, worker_type=worker_type)
    with no_leaks(), deadline(15):
        with pytest.raises(DatasetBoom) as info:
            iter(loader)
        kept = info.value  # (alive through the leak check, as a caller might keep it)
    del info, kept


class _BadStateStream(tud.IterableDataset):
    """Batches fetch fine; the per-batch state_dict(), outside the fetch, fails."""

    def __iter__(self):
        yield from range(8)

    def state_dict(self):
        raise DatasetBoom("state_dict failed")


@pytest.mark.parametrize("worker_type", ["process", "thread"])
def test_failing_dataset_state_dict_is_reraised_not_lost(worker_type, capfd):
    """An iterable dataset whose state_dict() raises: the user gets that error, with where."""
    errors: list[str] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda a: errors.append(f"{a.thread.name}: {a.exc_value!r}")
    try:
        loader = gpufeed.DataLoader(_BadStateStream(), batch_size=2, num_workers=2,
                                    worker_type=worker_type)
        with no_leaks(), deadline(15):
            with pytest.raises(DatasetBoom) as info:
                drain(loader)
            msg = str(info.value)
            del info
    finally:
        threading.excepthook = old_hook
    assert errors == [], errors
    assert "state_dict failed" in msg, msg
    assert re.search(r"worker \d saving the dataset's state", msg), msg
    assert "Traceback" not in capfd.readouterr().err  # no worker died printing one


# -- dying and hanging workers -------------------------------------------------------------------


# torch's own phrases (torch/csrc/DataLoader.cpp), which programs and frameworks match on.
STOCK_DEATH = {
    "sigkill": r"DataLoader worker \(pid \d+\) is killed by signal: Killed\. ",
    "exit": r"DataLoader worker \(pid \d+\) exited unexpectedly with exit code 3\. ",
}


@pytest.mark.parametrize("how,needle", [("sigkill", "SIGKILL"), ("exit", "exited with code 3")])
def test_worker_dying_inside_getitem_is_reported(how, needle):
    loader = gpufeed.DataLoader(KillDataset(20, bad=9, how=how), batch_size=4, num_workers=2)
    with no_leaks(), deadline(15), timer() as elapsed:
        with pytest.raises(gpufeed.WorkerError) as info:
            drain(loader)
        msg = str(info.value)
        del info
    assert elapsed() < 5, f"the death was noticed after {elapsed():.1f} s"
    assert re.match(STOCK_DEATH[how], msg), msg
    if how == "sigkill":  # stock's top-level words too (its signal phrase is their cause)
        assert re.search(r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly", msg), msg
    assert needle in msg and re.search(r"worker \d", msg), msg
    held = re.search(r"held batch(?:es)? ([\d, ]+)", msg)
    assert held, f"no batch named: {msg}"
    assert "2" in held.group(1).replace(" ", "").split(","), f"sample 9 is in batch 2: {msg}"


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_stock_reports_worker_death_with_the_same_phrase(how):
    """The phrase gpufeed starts with is the one the stock loader uses (stock raises it as the
    cause of its "DataLoader worker (pid(s) N) exited unexpectedly")."""
    with deadline(30), pytest.raises(RuntimeError) as info:
        drain(tud.DataLoader(KillDataset(20, bad=9, how=how), batch_size=4, num_workers=2))
    chain = f"{info.value}\n{info.value.__cause__}"
    assert re.search(STOCK_DEATH[how], chain), chain
    if how == "sigkill":
        assert re.match(r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly", str(info.value))


def test_worker_killed_from_outside_is_reported_with_its_pid():
    ds = SleepDataset(200, slow_from=0, seconds=0.05, once=False)  # workers always busy
    with no_leaks(), deadline(15):
        others = set(worker_pids())  # e.g. multiprocessing's resource tracker
        it = iter(gpufeed.DataLoader(ds, batch_size=1, num_workers=2))
        next(it)
        victim = next(p for p in worker_pids() if p not in others)
        os.kill(victim, signal.SIGKILL)
        with timer() as elapsed, pytest.raises(gpufeed.WorkerError) as info:
            sum(1 for _b in it)  # (a loop variable would keep the last batch alive)
        msg = str(info.value)
        del info, it
    assert elapsed() < 5
    assert msg.startswith(f"DataLoader worker (pid {victim}) is killed by signal: Killed."), msg
    assert "SIGKILL" in msg, msg
    assert re.search(r"batch(?:es)? \d+", msg), f"no batch named: {msg}"


@pytest.mark.parametrize("worker_type,seconds", [("process", 30.0), ("thread", 1.6)])
def test_timeout_raises_within_timeout_plus_a_few_seconds(worker_type, seconds):
    ds = SleepDataset(20, slow_from=5, seconds=seconds)
    loader = gpufeed.DataLoader(ds, batch_size=4, num_workers=2, timeout=1,
                                worker_type=worker_type)
    with no_leaks(settle_s=4.0), deadline(20), timer() as elapsed:
        with pytest.raises(RuntimeError) as info:  # stock raises RuntimeError too
            drain(loader)
        msg = str(info.value)
        raised_after = elapsed()
        del info
    assert raised_after < 1 + 4, f"timeout=1 raised after {raised_after:.1f} s"
    assert msg.startswith("DataLoader timed out after 1 seconds"), msg  # stock's words


@pytest.mark.parametrize("timeout", [1, 0.5])
def test_stock_times_out_with_the_same_phrase(timeout):
    ds = SleepDataset(20, slow_from=5, seconds=3)
    with deadline(20), pytest.raises(RuntimeError) as info:
        drain(tud.DataLoader(ds, batch_size=4, num_workers=1, timeout=timeout))
    assert str(info.value).startswith(f"DataLoader timed out after {timeout} seconds")


def test_timeout_applies_per_batch():
    """300 cheap batches, then 0.05 s each: timeout=1 must not fire (it is per batch)."""
    ds = SleepDataset(400, slow_from=300, seconds=0.05, once=False)
    loader = gpufeed.DataLoader(ds, batch_size=1, num_workers=1, timeout=1)
    with deadline(30):
        it = iter(loader)
        try:
            for k, _ in enumerate(it):
                if k == 330:
                    break
        finally:
            it.close()


@pytest.mark.slow
def test_close_while_a_large_task_message_is_being_sent():
    """Batches of 50,000 indices from a custom sampler go through the sender thread."""
    errors: list[str] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda a: errors.append(f"{a.thread.name}: {a.exc_value!r}")
    try:
        loader = gpufeed.DataLoader(SleepDataset(400_000, slow_from=0, seconds=60),
                                    sampler=list(range(400_000)), batch_size=50_000,
                                    num_workers=1, timeout=1)
        with no_leaks(settle_s=4.0), deadline(30), timer() as elapsed:
            with pytest.raises(gpufeed.WorkerError):
                drain(loader)
            raised_after = elapsed()
            del loader
    finally:
        threading.excepthook = old_hook
    assert errors == [], errors
    assert raised_after < 1 + 3, f"timeout=1 raised after {raised_after:.1f} s"


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


def test_iterators_inherited_by_forked_workers_are_not_closed_there():
    """A worker's gc may collect an unclosed iterator it inherited: nothing may run there."""
    gc.collect()
    gc.disable()  # keep the garbage below uncollected until the workers have forked
    try:
        old = gpufeed.DataLoader(RichDataset(8), batch_size=2, num_workers=1,
                                 persistent_workers=True)
        next(iter(old))
        old.cycle = old  # cyclic garbage with a running iterator inside
        del old
        probes = drain(gpufeed.DataLoader(GcProbeDataset(), batch_size=None, num_workers=1))
    finally:
        gc.enable()
        gc.collect()
    assert probes == [0, 0], "finalizers raised in the worker process"


STRESS_SCRIPT = """
import faulthandler, gc, sys, threading, time
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
    if wt == "stock":
        loader = tud.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=persistent)
    else:
        loader = gpufeed.DataLoader(ds, batch_size=4, num_workers=2, worker_type=wt,
                                    persistent_workers=persistent)
    before = {{p.pid for p in me.children()}}
    for epoch in range(2 if persistent else 1):
        it = iter(loader)
        got = sum(1 for _ in it)
        assert got == 4, (n, wt, got)  # every loader finishes its epochs
    pids = {{p.pid for p in me.children()}} - before
    threads = [t for t in threading.enumerate() if t.name.startswith("gpufeed-worker")]
    del it, loader
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
    """``del it, loader`` stops gpufeed's workers at once (no reference cycle keeps them), and
    stock loaders created in between keep working: 50 loaders of five kinds, one after the
    other, in one process with the cyclic collector off."""
    proc = run_script(STRESS_SCRIPT.format(rounds=50, hang_s=150), timeout=180)
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stdout + proc.stderr



FORK_SCRIPT = """
import os, sys, gpufeed
from support.fakes import RichDataset
loader = gpufeed.DataLoader(RichDataset(8), batch_size=2, num_workers=2,
                            worker_type={wt!r}, persistent_workers=True)
assert len(list(loader)) == 4
pid = os.fork()
if pid == 0:
    try:
        list(loader)
    except RuntimeError as e:
        print("CHILD", e, flush=True)
        os._exit(0)
    os._exit(3)
_, status = os.waitpid(pid, 0)
assert len(list(loader)) == 4  # the parent's loader still works
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_persistent_loader_inherited_by_fork_says_to_recreate_it(worker_type):
    proc = run_script(FORK_SCRIPT.format(wt=worker_type), timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "created before a fork" in proc.stdout and "re-create the DataLoader" in proc.stdout, \
        proc.stdout


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


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
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
