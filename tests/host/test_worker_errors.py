"""Errors in workers: exceptions raised by user code (dataset, sampler, collate_fn,
worker_init_fn, state_dict), workers that cannot start, die or hang. The error is the user's,
with its type, traceback and where; nothing hangs, nothing leaks.

"Nothing leaks" is checked by the ``no_leaks`` fixture (``tests/conftest.py``), or by
:func:`support.leaks.no_leaks` where the check must run while the test still holds something:
child processes of the test process, /dev/shm entries, open file descriptors and gpufeed
threads, before and after (after ``gc.collect()``, allowed a few seconds to settle).
"""

from __future__ import annotations

import errno
import gc
import inspect
import multiprocessing.context
import os
import re
import signal
import sys
import threading
import time

import pytest
import torch
import torch.utils.data as tud

import gpufeed
from support.compare import list_or_stop
from support.fakes import (
    DatasetBoom,
    FailingDataset,
    KillDataset,
    SleepDataset,
    failing_init,
    late_failing_init,
    second_worker_failing_init,
    staggered_failing_init,
)
from support.leaks import no_leaks, worker_pids
from support.procs import deadline, timer

# -- exceptions raised by user code ------------------------------------------------------------


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("exc_type", [DatasetBoom, KeyError, ValueError, IndexError])
def test_dataset_exception_reraised_with_type_traceback_and_index(exc_type, worker_type):
    loader = gpufeed.DataLoader(FailingDataset(20, bad=13, exc_type=exc_type), batch_size=4,
                                num_workers=2, worker_type=worker_type)
    with deadline(15):
        with pytest.raises(exc_type) as info:
            list_or_stop(loader)
        msg = str(info.value)
        del info
    assert "cannot load sample 13" in msg  # the original message
    assert "Traceback (most recent call last)" in msg and "fakes.py" in msg
    assert "__getitem__" in msg  # the worker's frames
    assert re.search(r"index[^\n]*\b13\b", msg), f"no failing sample index in: {msg[:300]}"
    assert re.search(r"DataLoader worker (process|thread) \d", msg), msg[:300]


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("where", ["dataset", "init"])
def test_worker_exception_starts_with_stocks_words(where):
    """People and tools search logs for torch's "Caught KeyError in DataLoader worker process
    3." and "Original Traceback (most recent call last):"; gpufeed's context comes between,
    on a line of its own."""
    def run(cls):
        if where == "dataset":
            loader = cls(FailingDataset(20, bad=13, exc_type=KeyError), batch_size=4,
                         num_workers=2)
        else:
            loader = cls(FailingDataset(20), batch_size=4, num_workers=2,
                         worker_init_fn=failing_init)
        with deadline(15), pytest.raises(Exception) as info:
            list_or_stop(loader)
        return type(info.value), str(info.value).splitlines()

    stock_type, stock = run(tud.DataLoader)
    ours_type, ours = run(gpufeed.DataLoader)
    assert ours_type is stock_type
    head = stock[0].rstrip(".")  # "Caught KeyError in DataLoader worker process 1"
    assert re.fullmatch(r"Caught \w+ in DataLoader worker process \d", head), stock[0]
    assert ours[0] == head + ".", (ours[0], stock[0])
    assert ours[1].startswith("(gpufeed: ") and ours[1].endswith(")"), ours[1]
    assert ours[2] == stock[1] == "Original Traceback (most recent call last):"


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
        list_or_stop(loader)
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


@pytest.mark.parametrize("device", [None, "cpu"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_iteration_continues_after_a_dataset_exception_like_stock(worker_type, num_workers,
                                                                   device):
    """A loop that catches a failing batch's error gets the batches after it, as with the
    stock loader, with a device stage too (it used to end the epoch there: the rest of its
    batches were silently lost)."""
    expected = _outcomes(tud.DataLoader(FailingDataset(20, bad=5), batch_size=4,
                                        num_workers=num_workers))
    got = _outcomes(gpufeed.DataLoader(FailingDataset(20, bad=5), batch_size=4,
                                       num_workers=num_workers, worker_type=worker_type,
                                       device=device))
    assert got == expected
    assert "DatasetBoom" in got and len(got) == 5


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


@pytest.mark.usefixtures("no_leaks")
def test_collate_fn_exception_reraised(worker_type, small_dataset):
    loader = gpufeed.DataLoader(small_dataset, batch_size=4, num_workers=1,
                                collate_fn=_bad_collate, worker_type=worker_type)
    with deadline(15):
        with pytest.raises(ValueError) as info:
            list_or_stop(loader)
        msg = str(info.value)
        del info
    assert "collate cannot handle 4 samples" in msg and "_bad_collate" in msg
    assert "collate_fn" in msg


def test_worker_init_fn_error_is_clear_and_leaves_nothing(worker_type, small_dataset):
    loader = gpufeed.DataLoader(small_dataset, batch_size=4, num_workers=2,
                                worker_init_fn=failing_init, worker_type=worker_type)
    with no_leaks(), deadline(15), timer() as elapsed:
        with pytest.raises(ValueError) as info:
            list_or_stop(loader)
        msg = str(info.value)
        del info
    assert elapsed() < 5
    assert re.search(r"init failed in worker \d", msg) and "failing_init" in msg
    assert re.search(r"worker \d", msg)


@pytest.mark.parametrize("init", [late_failing_init, second_worker_failing_init],
                         ids=["all-fail-worker-0-last", "worker-1-fails"])
def test_a_worker_init_error_comes_at_its_first_batch_as_stocks(init, small_dataset,
                                                                 monkeypatch):
    """The stock loader raises a worker's ``worker_init_fn`` error at that worker's first
    batch, in order: the batches before it come first, and when every worker fails it is
    worker 0's error, whichever reached the main process first (it was the first to arrive,
    at once: worker 1's, before batch 0)."""
    def run(cls):
        loader = cls(small_dataset, batch_size=4, num_workers=2, worker_init_fn=init)
        got = []
        with deadline(15), pytest.raises(ValueError) as info:
            for batch in loader:
                leaves = torch.utils._pytree.tree_flatten(batch)[0]
                got.append([x.tolist() if isinstance(x, torch.Tensor) else x for x in leaves])
        return got, str(info.value).splitlines()[0]

    with no_leaks():
        ours = run(gpufeed.DataLoader)
    # the stock iterator's shutdown waits this long for each worker here (5 s by default)
    monkeypatch.setattr(torch.utils.data._utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    stock = run(tud.DataLoader)
    gc.collect()  # its iterator, in a cycle with the error's traceback, shuts down now
    assert ours == stock


def test_second_worker_init_error_prints_nothing(capfd, small_dataset):
    """Worker 1 fails after the main process has closed the pipes: no traceback on stderr."""
    loader = gpufeed.DataLoader(small_dataset, batch_size=4, num_workers=2,
                                worker_init_fn=staggered_failing_init)
    with deadline(15), pytest.raises(ValueError):
        list_or_stop(loader)
    time.sleep(1.0)  # worker 1 fails 0.5 s after worker 0
    err = capfd.readouterr().err
    assert "Traceback" not in err, err


def test_unpicklable_spawn_arguments_fail_cleanly(small_dataset):
    unraisable: list[str] = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: unraisable.append(f"{u.object!r}: {u.exc_value!r}")
    message = ""
    try:
        with no_leaks(), deadline(30):
            try:
                list_or_stop(gpufeed.DataLoader(small_dataset, batch_size=4, num_workers=2,
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


def test_a_worker_that_cannot_start_leaves_nothing(worker_type, monkeypatch, small_dataset):
    """Worker 0 runs, worker 1 cannot start: worker 0, the pipes and the ring go at once."""
    kwargs = {}
    if worker_type == "process":
        _SecondForkFails.starts = 0
        kwargs["multiprocessing_context"] = _SecondForkFailsContext()
    else:
        monkeypatch.setattr(threading, "Thread", _SecondThreadFails)
    loader = gpufeed.DataLoader(small_dataset, batch_size=4, num_workers=2,
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


def test_iterator_that_fails_while_starting_stops_its_workers_at_once(worker_type,
                                                                      small_dataset):
    """The first dispatch fails after the workers started. The exception kept by the caller
    holds the half-built iterator (in its traceback): stopping must not wait for the gc."""
    loader = gpufeed.DataLoader(small_dataset, sampler=_BrokenSampler(), batch_size=4,
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
                list_or_stop(loader)
            msg = str(info.value)
            del info
    finally:
        threading.excepthook = old_hook
    assert errors == [], errors
    assert "state_dict failed" in msg, msg
    assert re.search(r"DataLoader worker (process|thread) \d\.\n\(gpufeed: saving the "
                     r"dataset's state", msg), msg
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
            list_or_stop(loader)
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


def _die(how: str) -> None:
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_stock_reports_worker_death_with_the_same_phrase(how):
    """The phrases gpufeed's message starts with are torch's own.

    Run end to end, the stock loader's words are a race (seen both ways in CI): its SIGCHLD
    handler raises the per-worker phrase wherever the main thread is, and a queue read that
    fails first raises "DataLoader worker (pid(s) N) exited unexpectedly" instead. So the
    per-worker phrase is taken from the check that handler runs
    (``torch._C._error_if_any_worker_fails``), on a worker that has exited and is not yet
    reaped, and the top-level phrase from the stock iterator's source."""
    proc = multiprocessing.get_context("fork").Process(target=_die, args=(how,))
    proc.start()
    key, registered = id(proc), False
    try:
        with deadline(30):
            while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                time.sleep(0.01)
        with pytest.raises(RuntimeError) as info:  # (a stray SIGCHLD raises the same here)
            torch._C._set_worker_pids(key, (proc.pid,))
            registered = True
            torch._C._error_if_any_worker_fails()
    finally:
        if registered:
            torch._C._remove_worker_pids(key)
        proc.join()
    assert re.match(STOCK_DEATH[how], str(info.value)), str(info.value)
    source = inspect.getsource(tud.dataloader._MultiProcessingDataLoaderIter._try_get_data)
    assert 'f"DataLoader worker (pid(s) {pids_str}) exited unexpectedly"' in source


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


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.leaks(settle_s=4.0)
@pytest.mark.parametrize("worker_type,seconds", [("process", 30.0), ("thread", 2.5)])
def test_timeout_raises_when_it_expires_like_stock(worker_type, seconds):
    """Batch 1 holds the slow sample: ``next()`` raises once ``timeout`` has passed (stock:
    1.0 s), not after the workers' grace period on top (it took 3.0 s)."""
    ds = SleepDataset(20, slow_from=5, seconds=seconds)
    loader = gpufeed.DataLoader(ds, batch_size=4, num_workers=2, timeout=1,
                                worker_type=worker_type)
    with deadline(20):
        it = iter(loader)
        next(it)
        with timer() as elapsed, pytest.raises(RuntimeError) as info:  # stock's type too
            next(it)
        msg = str(info.value)
        raised_after = elapsed()
        del info, it
    assert 1.0 <= raised_after < 1.6, f"timeout=1 raised after {raised_after:.2f} s"
    assert msg.startswith("DataLoader timed out after 1 seconds"), msg  # stock's words


@pytest.mark.parametrize("timeout", [1, 0.5])
def test_stock_times_out_with_the_same_phrase(timeout):
    ds = SleepDataset(20, slow_from=5, seconds=3)
    with deadline(20), pytest.raises(RuntimeError) as info:
        list_or_stop(tud.DataLoader(ds, batch_size=4, num_workers=1, timeout=timeout))
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
                list_or_stop(loader)
            raised_after = elapsed()
            del loader
    finally:
        threading.excepthook = old_hook
    assert errors == [], errors
    assert raised_after < 1 + 3, f"timeout=1 raised after {raised_after:.1f} s"


class _Interrupt(KeyboardInterrupt):
    pass


class _RaisesAt5(tud.Dataset):
    def __init__(self, error):
        self.error = error

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 5:
            raise self.error
        return i


@pytest.mark.parametrize("error", [SystemExit(3), _Interrupt("from the dataset")])
def test_a_base_exception_in_a_thread_worker_raises_at_its_batch_like_num_workers_0(error):
    """SystemExit or a KeyboardInterrupt subclass from a dataset in a thread worker comes out of
    the batch that raised it, in order (it ran ahead of the batches before it, and ended the
    epoch), as with num_workers=0 in the same process; the loop may go on past it."""
    got = []
    it = iter(gpufeed.DataLoader(_RaisesAt5(error), batch_size=4, num_workers=2,
                                 worker_type="thread"))
    while True:
        try:
            got.append(next(it).tolist())
        except StopIteration:
            break
        except BaseException as e:  # the point: SystemExit and KeyboardInterrupt too
            assert type(e) is type(error)
            assert f"Caught {type(error).__name__} in DataLoader worker thread 1" in str(e)
            got.append("error")
    assert got == [[0, 1, 2, 3], "error", [8, 9, 10, 11], [12, 13, 14, 15]]


class _KilledAt5(tud.Dataset):
    """Sample 0 is slow, sample 5 kills its worker: the worker of batch 1 dies while batch 0
    is still being fetched by the other."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 0:
            time.sleep(0.5)
        if i == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return i


def test_a_dead_workers_error_comes_after_the_batches_before_its_own():
    got = []
    it = iter(gpufeed.DataLoader(_KilledAt5(), batch_size=4, num_workers=2, timeout=30))
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed by signal"
                                           r".* while it held batch(es)? 1\b"):
        for batch in it:
            got.append(batch.tolist())
    assert got == [[0, 1, 2, 3]]  # batch 0, from the other worker, first
    assert list_or_stop(it) == []  # then the epoch is over
