"""The main process's budget per batch (bench.mainproc)."""

from __future__ import annotations

import sys

import pytest

from bench.mainproc import _sched_split, classify, measure_epochs, stage_budget

LOOP = "<module> (bench/mainproc.py:1);_timed_epoch (bench/mainproc.py:9)"


def _stack(*inner: str) -> str:
    return ";".join([LOOP, *inner])


def test_samples_are_sorted_into_stages() -> None:
    nxt = "WorkerIter.__next__ (gpufeed/_host/worker_iter.py:300)"
    wait = "WorkerIter._wait (gpufeed/_host/worker_iter.py:280)"
    assert classify("main (x.py:1);build (bench/workloads.py:3)") is None
    assert classify(_stack()) == "the loop itself"
    assert classify(_stack(nxt)) == "__next__ + hand-out"
    assert classify(_stack(nxt, wait, "ProcessPool.poll (gpufeed/_host/pool.py:204)")) \
        == "waiting for a worker"
    assert classify(_stack(nxt, wait, "ProcessPool.poll (gpufeed/_host/pool.py:204)",
                           "_ConnectionBase.recv (multiprocessing/connection.py:250)")) \
        == "receive: recv + decode"
    assert classify(_stack(nxt, "WorkerIter._dispatch (gpufeed/_host/worker_iter.py:222)",
                           "SlotRing.acquire (gpufeed/_memory/ring.py:215)")) \
        == "dispatch: acquire slots"
    # the first matching stage wins: stats recorded inside bookkeeping count as stats
    assert classify(_stack(nxt, wait, "WorkerIter._handle (gpufeed/_host/worker_iter.py:240)",
                           "StatsRecorder.add (gpufeed/_base/stats.py:251)")) \
        == "stats recording"
    assert classify(_stack("Tensor.__len__ (torch/_tensor.py:1)")) == "the loop itself"


def test_the_budget_splits_the_measured_cpu_by_busy_samples() -> None:
    raw = [
        _stack("WorkerIter.__next__ (gpufeed/_host/worker_iter.py:300)") + " 30",
        _stack("WorkerIter.__next__ (gpufeed/_host/worker_iter.py:300)",
               "unpack (gpufeed/_host/collate.py:230)") + " 10",
        _stack("WorkerIter.__next__ (gpufeed/_host/worker_iter.py:300)",
               "ProcessPool.poll (gpufeed/_host/pool.py:204)") + " 500",
        "main (x.py:1) 99",  # outside the timed loop
    ]
    rows = {r["stage"]: r for r in stage_budget(raw, 40e-6)}
    assert rows["__next__ + hand-out"]["us_per_batch"] == pytest.approx(30.0)
    assert rows["lease + unpack"]["share"] == pytest.approx(0.25)
    assert rows["waiting for a worker"]["samples"] == 500
    assert rows["waiting for a worker"]["us_per_batch"] is None


def test_epochs_are_measured_per_batch() -> None:
    rows = measure_epochs("tabular", "array", "gpufeed", epochs=1, warmup=2, quick=True)
    (row,) = rows
    assert row["batches"] == -(-20_000 // 256) - 2
    us = row["us_per_batch"]
    # workers >= 0: on a quick epoch they may have fetched every batch before the clocks start
    assert 0 < us["main_thread"] <= us["main_process"] + 1 and us["workers"] >= 0
    assert row["samples_per_s"] > 0
    assert 0 <= row["machine_idle"] <= 1 and row["worker_nice"] in (0, 5)
    if sys.platform.startswith("linux"):  # schedstat: the main thread and both workers
        sched = row["sched_us_per_batch"]
        assert sorted(sched) == ["main thread", "worker 0", "worker 1"]
        for t in sched.values():
            assert min(t.values()) >= 0
            assert t["on_cpu"] + t["waiting_for_cpu"] + t["asleep"] >= us["wall"] * 0.99


def test_a_worker_nice_given_is_the_loaders() -> None:
    (row,) = measure_epochs("tabular", "array", "gpufeed", epochs=1, warmup=2, quick=True,
                            worker_nice=3)
    assert row["worker_nice"] == 3


def test_one_loader_can_serve_every_epoch() -> None:
    rows = measure_epochs("tabular", "array", "gpufeed", epochs=2, warmup=2, quick=True,
                          same_loader=True)
    assert [r["batches"] for r in rows] == [-(-20_000 // 256) - 2] * 2


def test_a_step_spends_its_cpu_in_the_loop() -> None:
    """--step-us: the loop's own CPU per batch, a training step's stand-in (NOTE [ Main-process
    bound ]): it shows in the main thread's CPU per batch."""
    (bare,) = measure_epochs("tabular", "array", "gpufeed", epochs=1, warmup=2, quick=True)
    (row,) = measure_epochs("tabular", "array", "gpufeed", epochs=1, warmup=2, quick=True,
                            step_us=2000)
    assert row["us_per_batch"]["main_thread"] >= 2000
    assert row["us_per_batch"]["main_thread"] > bare["us_per_batch"]["main_thread"] + 1500


def test_wall_time_is_split_into_on_cpu_waiting_and_asleep() -> None:
    start = {"main thread": (1.0, 0.5), "worker 0": (2.0, 0.0), "worker 1": None}
    end = {"main thread": (1.2, 0.6), "worker 0": (2.5, 0.1)}
    split = _sched_split(start, end, seconds=0.5, batches=100)
    assert split == {  # us per batch; a worker without figures (or gone) is left out
        "main thread": pytest.approx({"on_cpu": 2000.0, "waiting_for_cpu": 1000.0,
                                      "asleep": 2000.0}),
        "worker 0": pytest.approx({"on_cpu": 5000.0, "waiting_for_cpu": 1000.0,
                                   "asleep": 0.0})}
