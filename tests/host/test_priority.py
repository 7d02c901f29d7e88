"""The workers' CPU priority (NOTE [ Worker priority ] in ``_host/priority.py``): lowered for a
main-bound loop on oversubscribed cores, never for a worker-bound one, never for thread
workers, as the user's ``worker_nice`` says otherwise, and with the bad values named."""

from __future__ import annotations

import os
import time

import pytest
import torch

import gpufeed
from gpufeed._base.stats import StatsRecorder
from gpufeed._host import priority
from gpufeed._host.messages import Nice

pytestmark = pytest.mark.skipif(not hasattr(os, "nice"), reason="needs os.nice")


class Niceness(torch.utils.data.Dataset):
    """Each sample: the priority of the process (or thread) that fetched it, after ``spin_s``
    of CPU."""

    def __init__(self, n: int, spin_s: float = 0.0) -> None:
        self.n, self.spin_s = n, spin_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        _spin(self.spin_s)
        return os.getpriority(os.PRIO_PROCESS, 0)  # Linux: the calling thread's


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _niceness(loader: gpufeed.DataLoader, step_s: float = 0.0) -> list[int]:
    out = []
    for batch in loader:
        out.extend(int(x) for x in batch)
        _spin(step_s)  # the loop's own work between batches
    return out


@pytest.fixture
def cores_shared(monkeypatch):
    """The workers and the main process oversubscribe the cores, whatever this machine has."""
    monkeypatch.setattr(priority, "oversubscribed", lambda num_workers: True)


BASE = os.getpriority(os.PRIO_PROCESS, 0)


@pytest.mark.parametrize("bad, error", [
    (-1, ValueError), (20, ValueError), ("5", TypeError), (True, TypeError), (2.5, TypeError)])
def test_a_bad_worker_nice_is_named(bad, error):
    with pytest.raises(error, match=rf"worker_nice.*{bad!r}|worker_nice={bad}"):
        gpufeed.DataLoader(range(4), worker_nice=bad)


def test_an_explicit_increment_applies_from_the_first_batch():
    loader = gpufeed.DataLoader(Niceness(24), batch_size=4, num_workers=2, worker_nice=3)
    assert _niceness(loader) == [BASE + 3] * 24
    assert loader.stats().counters["worker_nice"] == 3
    assert os.getpriority(os.PRIO_PROCESS, 0) == BASE  # the main process keeps its own


def test_a_main_bound_loop_lowers_the_workers_priority(cores_shared):
    # cheap batches, a loop that spends 0.3 ms of CPU per batch: the main thread sets the rate
    loader = gpufeed.DataLoader(Niceness(600), batch_size=2, num_workers=2, prefetch_factor=2)
    seen = _niceness(loader, step_s=3e-4)
    assert seen[:8] == [BASE] * 8  # decided from the loop's costs, not from the start
    assert seen[-40:] == [BASE + priority.NICE_STEP] * 40
    assert loader.stats().counters["worker_nice"] == priority.NICE_STEP


def test_a_worker_bound_loop_keeps_the_workers_priority(cores_shared):
    # 2 ms of worker CPU per batch, a loop that does nothing: the workers set the rate
    loader = gpufeed.DataLoader(Niceness(160, spin_s=1e-3), batch_size=2, num_workers=2,
                                prefetch_factor=2)
    assert _niceness(loader) == [BASE] * 160
    assert "worker_nice" not in loader.stats().counters


def test_spare_cores_keep_the_workers_priority(monkeypatch):
    monkeypatch.setattr(priority, "usable_cpus", lambda per_rank: 64.0)
    loader = gpufeed.DataLoader(Niceness(600), batch_size=2, num_workers=2, prefetch_factor=2)
    assert _niceness(loader, step_s=3e-4) == [BASE] * 600


@pytest.mark.parametrize("worker_nice", [0, 5, None])
def test_thread_workers_and_worker_nice_0_are_never_changed(cores_shared, worker_nice):
    kind = "process" if worker_nice == 0 else "thread"
    loader = gpufeed.DataLoader(Niceness(600), batch_size=2, num_workers=2, prefetch_factor=2,
                                worker_type=kind, worker_nice=worker_nice)
    assert _niceness(loader, step_s=3e-4) == [BASE] * 600
    assert "worker_nice" not in loader.stats().counters


def test_a_persistent_pool_decides_once_and_keeps_it(cores_shared):
    loader = gpufeed.DataLoader(Niceness(400), batch_size=2, num_workers=2, prefetch_factor=2,
                                persistent_workers=True)
    first = _niceness(loader, step_s=3e-4)
    second = _niceness(loader)  # a worker-bound epoch: the priority stays lowered (one way)
    assert first[-20:] == [BASE + priority.NICE_STEP] * 20
    assert second == [BASE + priority.NICE_STEP] * 400
    assert loader.stats().counters["worker_nice"] == priority.NICE_STEP  # not lowered twice


# -- the rule itself, on a fake clock ---------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def advance(self, wall: float, cpu: float) -> None:
        self.wall, self.cpu = self.wall + wall, self.cpu + cpu


def _rule(monkeypatch, num_workers=2):
    clock, sent = _Clock(), []
    monkeypatch.setattr(priority.time, "perf_counter", lambda: clock.wall)
    monkeypatch.setattr(priority.time, "thread_time", lambda: clock.cpu)
    p = priority.WorkerPriority(None, num_workers=num_workers, process=True,
                                send=lambda w, m: sent.append((w, m)), recorder=StatsRecorder())
    return p, clock, sent


def _feed(p, clock, *, windows, main_s, worker_s, batches=priority.WINDOW_BATCHES):
    yielded = p._start[2] if p._start else 0
    if p._start is None:
        p.observe(yielded, 0, 0.0)
    for _ in range(windows):
        clock.advance(priority.WINDOW_S * 1.01, main_s * batches)
        yielded += batches
        p.observe(yielded, batches, worker_s * batches)


@pytest.mark.parametrize("main_over_worker, lowered", [(0.36, True), (0.30, False)])
def test_the_rule_is_main_cpu_against_a_workers_time_over_workers_plus_one(
        monkeypatch, cores_shared, main_over_worker, lowered):
    p, clock, sent = _rule(monkeypatch)  # 2 workers: the line is at 1/3
    _feed(p, clock, windows=priority.WINDOWS, main_s=main_over_worker * 1e-4, worker_s=1e-4)
    assert (p.applied == priority.NICE_STEP) is lowered
    assert sent == ([(0, Nice(0, 5)), (1, Nice(0, 5))] if lowered else [])


def test_one_main_bound_window_is_not_enough(monkeypatch, cores_shared):
    p, clock, sent = _rule(monkeypatch)
    _feed(p, clock, windows=1, main_s=1e-3, worker_s=1e-4)  # e.g. a loop's first batches
    _feed(p, clock, windows=1, main_s=1e-5, worker_s=1e-4)
    _feed(p, clock, windows=priority.WINDOWS - 1, main_s=1e-3, worker_s=1e-4)
    assert sent == [] and p.applied == 0
    _feed(p, clock, windows=1, main_s=1e-3, worker_s=1e-4)
    assert p.applied == priority.NICE_STEP


def test_workers_started_later_get_the_increment(monkeypatch, cores_shared):
    p, clock, sent = _rule(monkeypatch)
    p.started(2)
    assert sent == []  # nothing lowered yet: a new worker has the main process's priority
    _feed(p, clock, windows=priority.WINDOWS, main_s=1e-3, worker_s=1e-4)
    assert sent == [(0, Nice(0, 5)), (1, Nice(0, 5))]
    p.resize(3)
    p.started(2)  # a new process
    p.catch_up(1)  # already has it: nothing twice
    p.resize(1)  # the autotuner retires worker 1 ... then takes it back
    p.catch_up(1)
    assert sent[2:] == [(2, Nice(0, priority.NICE_STEP))]


def test_a_worker_retiring_when_it_was_decided_gets_it_when_taken_back(monkeypatch,
                                                                     cores_shared):
    p, clock, sent = _rule(monkeypatch)
    p.resize(1)  # worker 1 is retiring: only worker 0 is in use when it is decided
    _feed(p, clock, windows=priority.WINDOWS, main_s=1e-3, worker_s=1e-4)
    assert sent == [(0, Nice(0, priority.NICE_STEP))]
    p.resize(2)
    p.catch_up(1)  # the autotuner takes worker 1 back
    assert sent[1:] == [(1, Nice(0, priority.NICE_STEP))]


def test_workers_the_autotuner_adds_get_the_increment_too():
    loader = gpufeed.DataLoader(Niceness(240), batch_size=2, num_workers="auto", worker_nice=4)
    loader._autotune.schedule = lambda k: 1 if k < 20 else 3  # (the autotuner's test seam)
    seen, counts = [], set()
    for batch in loader:
        counts.add(loader.num_workers)
        seen.extend(int(x) for x in batch)
    assert counts == {1, 3}
    assert seen == [BASE + 4] * 240


def test_the_gauge_says_what_is_in_force_in_each_epoch(cores_shared):
    # a main-bound first epoch lowers it; the next epoch's new workers start at the main
    # process's priority, and a worker-bound epoch keeps them there
    loader = gpufeed.DataLoader(Niceness(400), batch_size=2, num_workers=2, prefetch_factor=2)
    assert _niceness(loader, step_s=3e-4)[-1] == BASE + priority.NICE_STEP
    assert loader.stats().counters["worker_nice"] == priority.NICE_STEP
    loader.dataset.spin_s = 1e-3
    assert _niceness(loader) == [BASE] * 400
    assert loader.stats().counters["worker_nice"] == 0
