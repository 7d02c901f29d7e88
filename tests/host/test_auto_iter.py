"""``num_workers="auto"``: the invariants of growing and shrinking the pool mid-epoch (NOTE
[ Resizing the pool ] in ``_host/elastic.py``), with decisions forced through the autotuner's
test seam (``AutoTuner.schedule``) instead of waiting for timing; the arguments; the record.
The policy itself is tested on synthetic windows in ``test_autotune.py``."""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
import warnings

import pytest
import torch

import gpufeed
from gpufeed._host import elastic as _elastic
from gpufeed._host.failures import START_PICKLE_WARNING
from gpufeed._host.window import Move
from support.compare import assert_same_batches
from support.fakes import (
    IndexDataset,
    RangeIterable,
    SampleRandomDataset,
    WorkerInfoDataset,
    failing_init,
)
from support.leaks import gone, no_leaks
from support.procs import ctrl_c, deadline, spawn_script, timer

SCHEDULE = [1, 3, 5, 2, 4, 1, 6, 2]  # worker counts, one every few batches


def cycling(every=3, counts=SCHEDULE):
    return lambda k: counts[(k // every) % len(counts)]


def auto(dataset, schedule=None, **kwargs):
    kwargs.setdefault("batch_size", 4)
    loader = gpufeed.DataLoader(dataset, num_workers="auto", **kwargs)
    loader._autotune.schedule = schedule or cycling()
    return loader


def dataset(n=240):
    return torch.utils.data.TensorDataset(torch.arange(n, dtype=torch.float32))


def counts_seen(loader):
    out, seen = [], set()
    for batch in loader:
        assert type(loader.num_workers) is int
        seen.add(loader.num_workers)
        out.append(batch)
    return out, seen


# -- the invariants ------------------------------------------------------------------------------


@pytest.mark.parametrize("in_order", [True, False])
def test_growth_and_shrinkage_lose_repeat_or_reorder_nothing(worker_type, in_order):
    ds = dataset()
    ref = list(gpufeed.DataLoader(ds, batch_size=4, shuffle=True, seed=5))
    # a shuffled plan goes to process workers by descriptor, which starts multiprocessing's
    # resource sharer (a socket it keeps for the life of the process) on first use
    list(gpufeed.DataLoader(ds, batch_size=4, shuffle=True, num_workers=1))
    with no_leaks(), deadline(60):
        got, seen = counts_seen(auto(ds, worker_type=worker_type, shuffle=True, seed=5,
                                     in_order=in_order))
        assert seen == set(SCHEDULE)
        assert_same_batches(ref, got, ordered=in_order)
        del got


@pytest.mark.slow
def test_workers_started_later_by_spawn_get_the_ring():
    # spawn pickles the ring's region for each new worker: its descriptor must stay open
    ds = dataset(64)
    ref = list(gpufeed.DataLoader(ds, batch_size=4, shuffle=True, seed=2))
    loader = auto(ds, lambda k: 2 if k < 3 else 3, shuffle=True, seed=2,
                  multiprocessing_context="spawn")
    with deadline(120):
        got, seen = counts_seen(loader)
    assert seen == {2, 3}
    assert_same_batches(ref, got)


@pytest.mark.slow
def test_a_worker_added_by_spawn_that_cannot_pickle_warns_as_the_first_start():
    # The dataset stops pickling after the first start (it opened a handle in the main
    # process, say): the new worker's start fails as the first would, after torch's warning.
    ds = IndexDataset(64)
    loader = auto(ds, lambda k: 2 if hasattr(ds, "handle") else 1,
                  multiprocessing_context="spawn")
    loader._autotune.workers = 1
    with no_leaks(), deadline(120), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = iter(loader)
        next(it)
        ds.handle = threading.Lock()
        with pytest.raises(TypeError, match="pickle"):
            list(it)
        it.close()
        del it
    assert [str(w.message) for w in caught] == [START_PICKLE_WARNING]


@pytest.mark.usefixtures("no_leaks")
def test_persistent_workers_resize_across_epochs(worker_type):
    ds = dataset(80)
    loader = auto(ds, worker_type=worker_type, persistent_workers=True, shuffle=True, seed=1)
    stock = gpufeed.DataLoader(ds, batch_size=4, shuffle=True, seed=1)
    with deadline(60):
        for _ in range(3):
            assert_same_batches(list(stock), list(loader))
    loader._iterator.close()


def test_seeded_batches_are_the_same_bytes_whatever_the_decisions(worker_type):
    ds = SampleRandomDataset(96)
    ref = list(gpufeed.DataLoader(ds, batch_size=4, num_workers=2, shuffle=True, seed=7))
    with deadline(60):
        for schedule in (cycling(2), cycling(5, [4, 1, 3]), lambda k: 1 + k % 4):
            got = list(auto(ds, schedule, worker_type=worker_type, shuffle=True, seed=7))
            assert_same_batches(ref, got)


class SlowRandom(SampleRandomDataset):
    """SampleRandomDataset whose samples take 5 ms: workers hold tasks when a shrink comes."""

    def __getitem__(self, i):
        time.sleep(0.005)
        return super().__getitem__(i)


def test_state_dict_mid_change_resumes_exactly(worker_type):
    ds = SlowRandom(120)
    kwargs = dict(batch_size=3, shuffle=True, seed=3, worker_type=worker_type)
    ref = list(gpufeed.DataLoader(ds, **{**kwargs, "worker_type": "process"}))
    # five workers with work in hand, then one: four retire after their tasks, while the
    # state is taken
    loader = auto(ds, lambda k: 5 if k < 10 else 1, **kwargs)
    head = []
    with deadline(60):
        it = iter(loader)
        for _ in range(10):
            head.append(next(it))
        assert loader.num_workers == 1 and it._retiring, "no worker was retiring"
        state = loader.state_dict()
        it.close()
        resumed = auto(ds, cycling(4, [2, 6, 1]), **kwargs)
        resumed.load_state_dict(state)
        tail = list(resumed)
    assert_same_batches(ref, head + tail)


def test_num_workers_stays_an_int_and_an_int_fixes_it():
    loader = auto(dataset(40), lambda k: 3, worker_type="thread")
    assert type(loader.num_workers) is int and loader.num_workers >= 1
    assert vars(loader)["num_workers"] == "auto"  # what a framework rebuilding it passes on
    assert isinstance(loader, torch.utils.data.DataLoader)
    it = iter(loader)
    next(it)
    assert loader.num_workers == 3 and loader.num_workers > 0
    it.close()
    loader.num_workers = 2
    assert loader.num_workers == 2 and loader._autotune is None
    assert len(list(loader)) == 10
    with pytest.raises(ValueError, match="num_workers='auto' is chosen when the DataLoader"):
        loader.num_workers = "auto"


def test_budgets_are_hard_limits_even_for_forced_moves(worker_type):
    loader = auto(dataset(200), lambda k: 8, worker_type=worker_type, max_workers=3)
    _, seen = counts_seen(loader)
    assert max(seen) == 3
    tiny = auto(dataset(200), lambda k: 1 + k % 6, worker_type=worker_type,
                memory_budget=1)  # one byte: never more than one worker
    _, seen = counts_seen(tiny)
    assert seen == {1}
    reasons = [d.reason for d in tiny.stats().autotune.decisions]
    assert all("memory budget" in r for r in reasons) or not reasons, reasons


def test_new_workers_get_seeds_of_their_own():
    ds = WorkerInfoDataset(400)
    # one batch in flight per worker: a retiring worker is soon idle, and retired
    loader = auto(ds, cycling(10, [1, 4]), batch_size=2, worker_type="process",
                  prefetch_factor=1, collate_fn=lambda b: b)
    rows = [s for batch in loader for s in batch]
    assert {r["id"] for r in rows} == {0, 1, 2, 3}
    by_seed = {}
    for r in rows:
        by_seed.setdefault(r["seed"], set()).add(r["id"])
    assert all(len(ids) == 1 for ids in by_seed.values())  # a seed belongs to one id
    seeds_of_id3 = {r["seed"] for r in rows if r["id"] == 3}
    assert len(seeds_of_id3) > 1  # worker 3 started again: a fresh random stream each time
    assert all(r["id"] < r["num_workers"] for r in rows)


def test_decisions_are_logged_at_info_and_in_stats(caplog):
    loader = auto(dataset(60), cycling(5, [2, 4, 1]), worker_type="thread")
    with caplog.at_level(logging.INFO, logger="gpufeed"):
        list(loader)
    lines = [r.getMessage() for r in caplog.records if "gpufeed autotune" in r.getMessage()]
    stats = loader.stats()
    assert stats.autotune.workers == loader.num_workers
    assert len(lines) == stats.autotune.decided > 0
    assert "2 -> 4 workers at batch 5 (grow)" in lines[0]
    assert "autotune: " in str(stats) and stats.to_dict()["autotune"]["decided"] == len(lines)


# -- failures while resizing -----------------------------------------------------------------


class KillNewWorkers(torch.utils.data.Dataset):
    """Kills (SIGKILL) a worker process whose id is 2 or more on its first sample. Long enough
    (500 batches of 4) that the first two workers' work-ahead (at most 2 chunks of 64 batches
    each) cannot hold the whole epoch: later workers get tasks."""

    def __len__(self):
        return 2000

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        if info is not None and info.id >= 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return i


def test_worker_death_while_growing_is_reported(worker_type):
    # Workers 0 and 1 start; those started at batch 3 fail in worker_init_fn (threads), or
    # are killed on their first sample (processes).
    with no_leaks(), deadline(30), timer() as elapsed:
        if worker_type == "thread":
            # 500 batches: more than workers 0 and 1 can hold ahead (2 chunks of 64 each), so
            # the loop still waits for batches after worker 2 failed, and hears of it
            loader = auto(dataset(2000), lambda k: 2 if k < 3 else 3, worker_type="thread",
                          worker_init_fn=functools.partial(_fail_from, 2))
            with pytest.raises(ValueError, match="init failed in worker 2"):
                list(loader)
        else:
            loader = auto(KillNewWorkers(), lambda k: 2 if k < 3 else 6,
                          worker_type="process")
            with pytest.raises(gpufeed.WorkerError, match="killed by SIGKILL"):
                list(loader)
        assert elapsed() < 20
        del loader


def _fail_from(first_bad, worker_id):
    if worker_id >= first_bad:
        failing_init(worker_id)


@pytest.mark.parametrize("where", ["add", "start"])
def test_ctrl_c_while_growing_leaves_nothing(worker_type, monkeypatch, where):
    pool = {"process": _elastic.ElasticProcessPool, "thread": _elastic.ElasticThreadPool}
    cls = pool[worker_type]
    real = cls.add

    def interrupted_add(self, w, n):
        if where == "start":
            real(self, w, n)  # the worker runs: Ctrl-C lands just after it started
        raise KeyboardInterrupt

    loader = auto(dataset(400), lambda k: 2 if k < 4 else 5, worker_type=worker_type)
    with no_leaks(), deadline(30):
        it = iter(loader)
        monkeypatch.setattr(cls, "add", interrupted_add)
        with pytest.raises(KeyboardInterrupt):
            for batch in it:  # a batch the test kept would keep its slot's memory mapped
                del batch
        assert type(loader.num_workers) is int and loader.num_workers == 2
        it.close()
        del it


CTRL_C_SCRIPT = """
import psutil, torch, gpufeed
loader = gpufeed.DataLoader(torch.utils.data.TensorDataset(torch.arange(10**6)), batch_size=2,
                            num_workers="auto", worker_type={wt!r})
loader._autotune.schedule = lambda k: 1 + (k % 2) * 5  # grow to 6 and shrink back every batch
it = iter(loader)
for _ in range(4):
    next(it)
print("READY", flush=True)
for _ in it:
    print("PIDS", *[p.pid for p in psutil.Process().children(recursive=True)], flush=True)
"""


def test_a_real_ctrl_c_while_growing_stops_promptly(worker_type):
    proc = spawn_script(CTRL_C_SCRIPT.format(wt=worker_type))
    pids: set[int] = set()
    assert proc.stdout.readline().startswith("READY"), ctrl_c(proc)[0]
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        pids.update(int(p) for p in proc.stdout.readline().split()[1:])
    err, seconds = ctrl_c(proc, timeout=20)
    assert seconds < 10, f"Ctrl-C took {seconds:.1f} s"
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
    end = time.monotonic() + 5
    while not all(gone(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert all(gone(p) for p in pids), f"workers outlived Ctrl-C: {pids}"


# -- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(num_workers="auto", max_workers=0), r"max_workers=0 is not supported: .* int >= 1"),
    (dict(num_workers=2, max_workers=4), r"max_workers=4 only applies to num_workers='auto'"),
    (dict(num_workers=0, memory_budget="1GiB"), r"memory_budget='1GiB' only applies to"),
    (dict(num_workers="auto", memory_budget="lots"),
     r"memory_budget='lots': cannot read 'lots' as a size in bytes; write e.g. 8GiB"),
    (dict(num_workers="auto", memory_budget=-5), r"memory_budget=-5: cannot read"),
])
def test_argument_errors_name_the_value_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gpufeed.DataLoader(dataset(8), **kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(num_workers="Auto"), r"num_workers='Auto' is not supported; use an int >= 0, or 'auto'"),
    (dict(num_workers="auto", max_workers=True), r"max_workers=True is not supported"),
    (dict(num_workers="auto", max_workers="8"), r"max_workers='8' is not supported"),
])
def test_argument_type_errors_are_type_errors(kwargs, match):
    with pytest.raises(TypeError, match=match):
        gpufeed.DataLoader(dataset(8), **kwargs)


def test_iterable_datasets_refuse_auto_and_say_why():
    with pytest.raises(ValueError, match=r"num_workers='auto' needs a map-style dataset: an "
                                         r"IterableDataset is split among workers"):
        gpufeed.DataLoader(RangeIterable(8), batch_size=2, num_workers="auto")


def test_defaults_and_move_values():
    loader = gpufeed.DataLoader(dataset(8), num_workers="auto", memory_budget="64MiB")
    t = loader._autotune
    assert t.budgets.memory_bytes == 64 << 20 and t.max_workers >= 2
    assert 1 <= loader.num_workers <= t.max_workers
    assert Move(3, 2) == (3, 2)


def test_a_framework_rebuilding_the_loader_keeps_the_switch():
    # Lightning's distributed-sampler injection rebuilds a loader from vars() and __init__'s
    # signature: "auto" and max_workers must survive, not the count in force at the time
    data = pytest.importorskip("lightning.pytorch.utilities.data")
    ds = dataset(20)
    loader = gpufeed.DataLoader(ds, batch_size=4, num_workers="auto", max_workers=3)
    rebuilt = data._update_dataloader(loader, torch.utils.data.SequentialSampler(ds))
    assert rebuilt._autotune is not None and rebuilt._autotune.max_workers == 3
    assert len(list(rebuilt)) == 5


def test_decisions_are_instants_of_the_trace(worker_type):
    """Each decision the autotuner records shows in gpufeed.trace's timeline, on the loader's
    main track, with the counts before and after."""
    from support.trace_format import check_trace

    loader = auto(dataset(), cycling(4, [2, 3, 1]), worker_type=worker_type)
    with deadline(60), gpufeed.trace() as tr:
        assert len(list(loader)) == 60
    read = check_trace(tr.to_dict())
    moves = [e for e in read.instants if e["name"].startswith("autotune: ")]
    decisions = loader.stats().autotune.decisions
    assert moves and len(moves) == len(decisions)
    assert [e["args"]["workers"] for e in moves] == [
        f"{d.workers[0]} -> {d.workers[1]}" for d in decisions]


def test_the_advice_on_thread_workers_is_warned_at_the_loop(monkeypatch):
    """held_back in _host/auto_iter.py: the iterator asks after each window and warns with the
    advice it gets, pointing at the loop."""
    from gpufeed._host import auto_iter as _auto_iter
    from gpufeed.errors import ThreadWorkersWarning

    calls = []

    def advise(tuner, win, decided):  # every window: "held back" at the second
        calls.append(decided)
        return "use worker_type='process'" if len(calls) == 2 else None

    monkeypatch.setattr(_auto_iter, "held_back", advise)
    loader = gpufeed.DataLoader(dataset(400), batch_size=2, num_workers="auto",
                                worker_type="thread")
    loader._autotune.window_batches, loader._autotune.window_s = 4, 0.0
    with pytest.warns(ThreadWorkersWarning, match="worker_type='process'") as caught:
        for _ in loader:
            pass
    said = [w for w in caught if issubclass(w.category, ThreadWorkersWarning)]
    assert len(calls) > 2 and len(said) == 1 and said[0].filename == __file__
