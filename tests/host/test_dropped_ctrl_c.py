"""A Ctrl-C where Python would drop it reaches the program: while a worker process is forked,
and while an iterator dropped unclosed closes its pool (NOTE [ Ctrl-C that Python drops ] in
``_base/interrupts.py``).

Python handles a signal that arrived during ``fork()`` at the first bytecode after it, which is
an ``os.register_at_fork`` hook's, and drops the KeyboardInterrupt raised there. The scripts
below raise SIGINT from such a hook, which is where a real one lands, deterministically.
"""

from __future__ import annotations

import gc
import signal
import threading
import time

import pytest

import gpufeed
from conftest import WORKER_TYPES
from gpufeed._base.interrupts import ctrl_c_held
from gpufeed._host.pool import ProcessPool, ThreadPool
from support.leaks import no_leaks
from support.procs import deadline, run_script

# -- the hold itself ---------------------------------------------------------------------------


def test_a_ctrl_c_inside_the_block_is_raised_when_it_ends():
    ran_on = []
    with pytest.raises(KeyboardInterrupt), ctrl_c_held():
        signal.raise_signal(signal.SIGINT)
        ran_on.append("after the signal")  # not interrupted here
    assert ran_on == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_nothing_is_held_where_no_at_fork_hook_runs():
    """A spawned worker's start runs no at-fork hook in this process, and may pickle a large
    dataset: a Ctrl-C then is raised at once, not after the start."""
    ran_on = []
    with pytest.raises(KeyboardInterrupt), ctrl_c_held(hold=False):
        signal.raise_signal(signal.SIGINT)
        ran_on.append("after the signal")
    assert ran_on == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_programs_own_handler_gets_the_held_signal_once_afterwards():
    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with ctrl_c_held():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            assert calls == []
        assert calls == [signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_ignored_ctrl_c_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with ctrl_c_held():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_other_threads_cannot_change_handlers_and_are_left_alone():
    errors = []

    def run():
        try:
            with ctrl_c_held():
                pass
        except BaseException as e:  # signal.signal from a thread would raise ValueError
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert errors == []


# -- the pools -----------------------------------------------------------------------------------

FORK_SCRIPT = """
import os, signal, torch, gpufeed
from support.leaks import no_leaks

armed = [False]

def ctrl_c_during_fork():
    if armed[0]:
        armed[0] = False
        signal.raise_signal(signal.SIGINT)

os.register_at_fork(after_in_parent=ctrl_c_during_fork)
data = torch.utils.data.TensorDataset(torch.arange(4000))
with no_leaks():
    if {kind!r} == "fixed":
        loader = gpufeed.DataLoader(data, batch_size=2, num_workers=2,
                                    multiprocessing_context="fork")
    else:
        loader = gpufeed.DataLoader(data, batch_size=2, num_workers="auto",
                                    worker_type="process", multiprocessing_context="fork")
        loader._autotune.schedule = lambda k: 1 + (k % 2) * 3  # a worker forked every batch
    it = None
    try:
        if {kind!r} == "fixed":
            armed[0] = True
            it = iter(loader)
        else:
            it = iter(loader)
            next(it)
            armed[0] = True
        for _ in range(200):
            next(it)
        print("NOT INTERRUPTED", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
    finally:
        if it is not None:
            it.close()
        del it
print("NO LEAKS", flush=True)
"""


@pytest.mark.parametrize("kind", ["fixed", "growing"])
def test_a_ctrl_c_during_a_workers_fork_stops_the_loop_and_leaves_nothing(kind):
    done = run_script(FORK_SCRIPT.format(kind=kind), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["INTERRUPTED", "NO LEAKS"], done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr


@pytest.mark.parametrize("worker_type", WORKER_TYPES)
def test_a_ctrl_c_while_a_dropped_iterator_closes_its_pool_is_raised_after_it(
        worker_type, monkeypatch):
    cls = ProcessPool if worker_type == "process" else ThreadPool
    real, closes = cls.close, []

    def close_interrupted(self, *args, **kwargs):
        if not closes:  # the first close only: Ctrl-C lands as the workers are being stopped
            closes.append(1)
            signal.raise_signal(signal.SIGINT)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, "close", close_interrupted)
    loader = gpufeed.DataLoader(list(range(64)), batch_size=2, num_workers=2,
                                worker_type=worker_type)
    with no_leaks(), deadline(30):
        it = iter(loader)
        next(it)
        with pytest.raises(KeyboardInterrupt):
            del it  # closed by __del__, which would drop the KeyboardInterrupt
            gc.collect()
            time.sleep(2)  # interrupted soon after the close
        assert closes == [1]
