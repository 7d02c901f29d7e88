"""The autotuner's policy and the worker-cost model, on synthetic windows (no workers, no
timing): NOTE [ Autotuning decisions ] in ``_host/autotune.py`` and NOTE [ What a worker
costs ] in ``_host/cost.py``. The loader-level invariants are in ``test_auto_iter.py``."""

from __future__ import annotations

import logging

import pytest

from gpufeed._host import autotune as _autotune
from gpufeed._host.autotune import AutoTuner
from gpufeed._host.cost import Budgets, WorkerCost, pays_off
from gpufeed._host.window import Gauges, Move, Window

MiB = 1 << 20


def make(*, workers=2, max_workers=16, cores=2.0, memory=1 << 30, depth_fixed=False):
    return AutoTuner(max_workers=max_workers, worker_type="process",
                     budgets=Budgets(cpu_cores=cores, memory_bytes=memory), depth=2,
                     depth_fixed=depth_fixed, initial=workers)


def window(t, *, rate, bound, step_ms, batch_ms, workers=None, cpu_cores=None, seconds=1.0,
           worker_bytes=0, slot_bytes=0, worker_cpu=0.0, queued=0.0):
    """A window of ``seconds`` at ``rate`` batches/s, the loop waiting for workers ``bound``
    of its time, each worker taking ``batch_ms`` a batch."""
    batches = max(1, round(rate * seconds))
    step = step_ms / 1e3 * batches
    starved = bound * step / (1 - bound) if bound < 1 else 10.0
    n = t.workers if workers is None else workers
    return Window(workers=n, depth=t.depth, batches=batches, seconds=seconds, wait_s=starved,
                  starved_s=starved, step_s=step, busy_s=batch_ms / 1e3 * batches,
                  answered=batches, cpu_s=None if cpu_cores is None else cpu_cores * seconds,
                  gauges=Gauges(worker_bytes, slot_bytes, (2 * n + 2) * slot_bytes, 0, 2),
                  worker_cpu_s=worker_cpu * seconds, queued_s=queued * seconds)


def start(t, win):
    """Begin, let the first window settle, and judge ``win``."""
    token = t.begin()
    assert t.decide(token, win) is None  # settles
    return token, t.decide(token, win)


# -- the model ---------------------------------------------------------------------------------


def test_cost_model_workers_and_limits():
    io = WorkerCost(batch_s=0.032, cpu_s=0.001)  # waits 32 ms a batch, 1 ms of CPU
    assert io.workers_for(500) == 16
    assert io.workers_for(125) == 4
    assert io.cpu_limit(2.0) == 64  # waiting costs no CPU: far more workers than cores
    cpu = WorkerCost(batch_s=0.008, cpu_s=0.008)  # pure CPU: one core per worker
    assert cpu.cpu_limit(2.0) == 2
    # memory: each worker's private bytes, and a ring slot per batch in flight or held
    assert Gauges(worker_bytes=100, slot_bytes=10, held=2).memory(3, 4) == 300 + 14 * 10


def test_observed_cost_from_a_trial():
    cost = WorkerCost.observed(workers=2, rate=100.0, cpu_cores=0.2)
    assert cost.batch_s == pytest.approx(0.02) and cost.cpu_s == pytest.approx(0.002)
    assert cost.cpu_limit(2.0) == 20  # the tuner's ladder goes up to 16 on 2 cores


def test_crowded_means_cpu_bound_and_queued():
    assert WorkerCost(0.01, worker_cpu_s=0.006, queued_s=0.004).crowded
    assert not WorkerCost(0.01, worker_cpu_s=0.009, queued_s=0.0005).crowded  # has its core
    assert not WorkerCost(0.03, worker_cpu_s=0.001, queued_s=0.002).crowded  # waits on I/O
    # ... and on a busy machine each wake-up queues, yet it computes little
    assert not WorkerCost(0.02, worker_cpu_s=0.001, queued_s=0.01).crowded


def test_pays_off_needs_the_tolerance_and_clears_the_noise():
    assert pays_off(100, 120, tolerance=0.05)
    assert not pays_off(100, 104, tolerance=0.05)
    assert not pays_off(100, 120, tolerance=0.05, before_hi=115, after_lo=110)  # overlap
    assert pays_off(100, 120, tolerance=0.05, before_hi=105, after_lo=110)


# -- the policy --------------------------------------------------------------------------------


def test_grows_towards_the_model_at_most_doubling_and_keeps_what_paid():
    t = make(workers=2)
    token, move = start(t, window(t, rate=60, bound=0.8, step_ms=2, batch_ms=32))
    assert move == Move(4, 2)  # the model wants 20 (32 ms / 2 ms, +25%): doubling at most
    assert t.workers == 4 and t.decide(token, window(t, rate=118, bound=0.7, step_ms=2,
                                                         batch_ms=32)) is None  # settles
    move = t.decide(token, window(t, rate=118, bound=0.7, step_ms=2, batch_ms=32))
    assert move == Move(8, 2)
    kinds = [d.kind for d in t.snapshot().decisions]
    assert kinds == ["grow", "kept", "grow"]
    assert str(t.snapshot().decisions[1]).startswith("2 -> 4 workers kept at batch")


def test_a_growth_that_did_not_pay_is_reverted_and_not_tried_again():
    t = make(workers=4)
    token, move = start(t, window(t, rate=100, bound=0.5, step_ms=2, batch_ms=40))
    assert move == Move(8, 2)
    t.decide(token, window(t, rate=101, bound=0.5, step_ms=2, batch_ms=80))  # settles
    move = t.decide(token, window(t, rate=101, bound=0.5, step_ms=2, batch_ms=80))
    assert move == Move(4, 2) and t.snapshot().last.kind == "revert"
    assert "8 workers gave no gain" in t.snapshot().last.reason
    t.decide(token, window(t, rate=100, bound=0.5, step_ms=2, batch_ms=40))  # settles
    move = t.decide(token, window(t, rate=100, bound=0.5, step_ms=2, batch_ms=40))
    assert move == Move(7, 2)  # below the count that gave nothing
    t.decide(token, window(t, rate=100, bound=0.5, step_ms=2, batch_ms=70))
    assert t.decide(token, window(t, rate=100, bound=0.5, step_ms=2, batch_ms=70)) == Move(4, 2)


def test_a_new_phase_lifts_the_memo():
    t = make(workers=4)
    token, _ = start(t, window(t, rate=100, bound=0.5, step_ms=2, batch_ms=40))
    t.decide(token, window(t, rate=100, bound=0.5, step_ms=2, batch_ms=80))
    t.decide(token, window(t, rate=100, bound=0.5, step_ms=2, batch_ms=80))  # revert: no 8
    assert "ceiling" in t._memos
    t.decide(token, window(t, rate=100, bound=0.0, step_ms=2, batch_ms=40))  # settles
    t.decide(token, window(t, rate=45, bound=0.02, step_ms=20, batch_ms=40))  # one slow window
    assert "ceiling" in t._memos  # one window is noise, not a phase
    t.decide(token, window(t, rate=100, bound=0.02, step_ms=2, batch_ms=40))
    t.decide(token, window(t, rate=45, bound=0.02, step_ms=20, batch_ms=40))  # 10x longer step
    assert "ceiling" in t._memos
    t.decide(token, window(t, rate=45, bound=0.02, step_ms=20, batch_ms=40))  # ... and again
    assert "ceiling" not in t._memos


@pytest.mark.parametrize(("kwargs", "limit"), [
    (dict(max_workers=2), "max_workers=2"),
    (dict(memory=40 * MiB), "the memory budget"),
    (dict(cores=1.0), "the CPU budget"),
])
def test_budgets_stop_growth_and_the_hold_says_why_once(kwargs, limit, caplog):
    t = make(workers=2, **kwargs)
    win = window(t, rate=60, bound=0.8, step_ms=2, batch_ms=32, cpu_cores=0.9, worker_bytes=
                 15 * MiB, slot_bytes=MiB)
    win = Window(**{**win.__dict__, "cpu_s": 0.9 if "cores" in kwargs else 0.05})
    with caplog.at_level(logging.INFO, logger="gpufeed"):
        token, move = start(t, win)
        assert t.decide(token, win) is None
    assert move is None and t.workers == 2
    holds = [d for d in t.snapshot().decisions if d.kind == "hold"]
    assert len(holds) == 1 and limit in holds[0].reason, t.snapshot().decisions
    assert sum("gpufeed autotune: held at 2 workers" in r.message for r in caplog.records) == 1


def test_crowded_workers_are_not_multiplied():
    t = make(workers=2)
    # 2 CPU-bound workers at 20 batches/s: 40 ms of CPU and 60 ms queued in each 100 ms batch
    win = window(t, rate=20, bound=0.9, step_ms=1, batch_ms=100, cpu_cores=0.9,
                 worker_cpu=0.8, queued=1.2)
    _, move = start(t, win)
    assert move is None and "the cores are busy" in t.snapshot().last.reason


def test_shrinks_when_the_loop_does_not_wait_and_reverts_if_it_then_waits():
    t = make(workers=8)
    calm = window(t, rate=20, bound=0.0, step_ms=50, batch_ms=2)  # a 50 ms step, cheap data
    token, move = start(t, calm)
    assert move is None  # one calm window is not enough
    move = t.decide(token, calm)
    assert move == Move(4, 2)  # the model needs 1; halving at most
    t.decide(token, window(t, rate=20, bound=0.3, step_ms=50, batch_ms=2))  # settles
    move = t.decide(token, window(t, rate=14, bound=0.3, step_ms=50, batch_ms=2))
    assert move == Move(8, 2) and t.snapshot().last.kind == "revert"
    assert t._memos["floor"].value == 8


def test_over_the_memory_budget_shrinks_to_fit():
    t = make(workers=6, memory=100 * MiB)
    win = window(t, rate=100, bound=0.0, step_ms=10, batch_ms=10, worker_bytes=30 * MiB)
    _, move = start(t, win)
    assert move is not None and move.workers == 3  # 3 x 30 MiB + the ring fit in 100 MiB
    assert "over the memory budget" in t.snapshot().last.reason


def test_a_noisy_machine_holds_and_says_so():
    t = make(workers=2)
    token, _ = start(t, window(t, rate=100, bound=0.02, step_ms=5, batch_ms=5))
    for rate in (40, 160, 40, 160, 40, 160):
        t.decide(token, window(t, rate=rate, bound=0.02, step_ms=5, batch_ms=5))
        if t._noise > _autotune.NOISY:
            break
    assert t.snapshot().last.kind == "hold" and "too noisy" in t.snapshot().last.reason
    assert t.workers == 2


def test_waits_with_enough_workers_deepen_the_work_ahead_after_two_windows():
    t = make(workers=4)
    jitter = window(t, rate=200, bound=0.1, step_ms=4, batch_ms=8)
    token, move = start(t, jitter)
    assert move is None  # the model says 4 keep up: one waiting window may be noise
    assert t.decide(token, jitter) == Move(4, 4) and t.snapshot().last.kind == "deepen"
    fixed = make(workers=4, depth_fixed=True)  # an explicit prefetch_factor is never moved
    token, _ = start(fixed, jitter)
    move = fixed.decide(token, jitter)
    assert move is None or move.depth == 2


def test_forced_moves_go_through_the_hard_limits():
    t = make(workers=2, max_workers=3, memory=64 * MiB)
    t.schedule = lambda k: 8
    assert t.scheduled(Gauges()) == Move(3, 2)  # max_workers
    t.schedule = lambda k: 1
    assert t.scheduled(Gauges()) == Move(1, 2)
    t.schedule = lambda k: 3
    assert t.scheduled(Gauges(worker_bytes=30 * MiB)) == Move(2, 2)  # 3 x 30 MiB > 64 MiB
    assert "held to 2 by the memory budget" in t.snapshot().last.reason
    assert [d.kind for d in t.snapshot().decisions] == ["grow", "shrink", "grow"]


def test_windows_of_an_older_iterator_are_ignored():
    t = make(workers=2)
    old = t.begin()
    t.begin()
    assert t.decide(old, window(t, rate=60, bound=0.8, step_ms=2, batch_ms=32)) is None
    assert t._last is None


def test_work_ahead_that_paid_is_not_given_back_and_one_that_did_not_is_not_retried():
    t = make(workers=4)
    jitter = window(t, rate=200, bound=0.1, step_ms=4, batch_ms=12.5)
    token, _ = start(t, jitter)
    assert t.decide(token, jitter) == Move(4, 4)
    t.decide(token, window(t, rate=240, bound=0.0, step_ms=4, batch_ms=12.5))  # settles
    assert t.decide(token, window(t, rate=240, bound=0.0, step_ms=4, batch_ms=12.5)) is None
    assert t.snapshot().last.kind == "deepen"  # a gain of 1.2x: one more window to be sure
    assert t.decide(token, window(t, rate=240, bound=0.0, step_ms=4, batch_ms=12.5)) is None
    assert t.snapshot().last.kind == "kept"
    calm = window(t, rate=240, bound=0.0, step_ms=4, batch_ms=12.5)
    assert t.decide(token, calm) is None  # calm, but 4 ahead is what stopped the waits
    assert t.depth == 4
    assert t.decide(token, window(t, rate=240, bound=0.1, step_ms=4, batch_ms=12.5)) is None
    move = t.decide(token, window(t, rate=240, bound=0.1, step_ms=4, batch_ms=12.5))
    assert move == Move(4, 8)
    t.decide(token, window(t, rate=236, bound=0.1, step_ms=4, batch_ms=12.5))  # settles
    move = t.decide(token, window(t, rate=236, bound=0.1, step_ms=4, batch_ms=12.5))
    assert move == Move(4, 4) and t.snapshot().last.kind == "revert"
    t.decide(token, window(t, rate=240, bound=0.1, step_ms=4, batch_ms=12.5))  # settles
    t.decide(token, window(t, rate=240, bound=0.1, step_ms=4, batch_ms=12.5))
    assert t.depth == 4, t.snapshot().decisions  # 8 ahead gave nothing: not tried again


def test_a_growth_that_slows_the_loop_is_reverted_even_if_it_then_waits_less():
    # thread workers holding the GIL slow the loop's own step: less waiting, fewer batches
    t = make(workers=4)
    token, move = start(t, window(t, rate=30, bound=0.5, step_ms=10, batch_ms=80))
    assert move == Move(8, 2)
    t._noise = 0.2  # a loaded machine (seen: ±23%), which a 20% fall would hide in
    t.decide(token, window(t, rate=24, bound=0.0, step_ms=40, batch_ms=300))  # settles
    move = t.decide(token, window(t, rate=24, bound=0.0, step_ms=40, batch_ms=300))
    assert move == Move(4, 2) and t.snapshot().last.kind == "revert"


def test_a_small_gain_is_judged_on_two_windows_against_the_better_of_two_before():
    t = make(workers=4)
    token, _ = start(t, window(t, rate=100, bound=0.02, step_ms=2, batch_ms=40))
    t.decide(token, window(t, rate=70, bound=0.2, step_ms=2, batch_ms=40))  # a dip: grows
    assert t.workers == 8  # judged against 100 (the better window before), not the dip
    t.decide(token, window(t, rate=120, bound=0.1, step_ms=2, batch_ms=40))  # settles
    assert t.decide(token, window(t, rate=120, bound=0.1, step_ms=2, batch_ms=40)) is None
    assert t.snapshot().last.kind == "grow"  # 1.2x: not yet
    move = t.decide(token, window(t, rate=98, bound=0.2, step_ms=2, batch_ms=40))
    assert move == Move(4, 2) and t.snapshot().last.kind == "revert"  # the gain was noise


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_thread_workers_the_gil_holds_back_are_told_about_once(kind):
    """held_back in _host/auto_iter.py: the loop waits, 4 thread workers gave nothing over 2,
    and the process used one core of two: the work holds the GIL, and the advice names
    worker_type="process", once per loader. Process workers that do not scale get none."""
    from gpufeed._host.auto_iter import held_back

    t = make(workers=2)
    t.worker_type = kind
    token, move = start(t, window(t, rate=100, bound=0.5, step_ms=2, batch_ms=20, cpu_cores=1.0))
    assert move == Move(4, 2)
    win = window(t, rate=101, bound=0.5, step_ms=2, batch_ms=40, cpu_cores=1.0)
    t.decide(token, win)
    decided = t.snapshot().decided
    assert t.decide(token, win) == Move(2, 2) and t.snapshot().last.kind == "revert"
    advice = held_back(t, win, decided)
    if kind == "process":
        assert advice is None
        return
    assert advice is not None and "worker_type='process'" in advice
    assert "4 workers gave no gain" in advice and "1.0 of the 2 cores" in advice
    assert held_back(t, win, decided) is None  # said once per loader


def test_thread_workers_that_use_the_cores_get_no_advice():
    """Threads waiting on I/O or in GIL-free code (the process uses both cores): no advice,
    held back or reverted as they may be."""
    from gpufeed._host.auto_iter import held_back

    t = make(workers=2)
    t.worker_type = "thread"
    token, _ = start(t, window(t, rate=100, bound=0.5, step_ms=2, batch_ms=20, cpu_cores=1.9))
    said = []
    for _ in range(6):
        win = window(t, rate=101, bound=0.5, step_ms=2, batch_ms=40, cpu_cores=1.9)
        decided = t.snapshot().decided
        t.decide(token, win)
        said.append(held_back(t, win, decided))
    assert {d.kind for d in t.snapshot().decisions} & {"hold", "revert"}
    assert said == [None] * 6
