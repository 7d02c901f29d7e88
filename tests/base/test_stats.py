import pickle
import threading
import time

import pytest

from gpufeed._base.stats import LoaderStats, StageStats, StatsRecorder, format_table, percentile


def test_percentile_interpolates_and_handles_edges():
    assert percentile([], 50) == 0.0
    assert percentile([3.0], 99) == 3.0
    values = [float(i) for i in range(101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 90) == 90.0
    assert percentile([0.0, 1.0], 50) == pytest.approx(0.5)


def test_stage_totals_percentiles_and_counters():
    rec = StatsRecorder()
    for i in range(100):
        rec.add("fetch", busy_s=(i + 1) / 1000)
    rec.add("wait", blocked_s=0.25)
    rec.add("step", busy_s=0.75)
    rec.count("ring_fallback")
    rec.count("samples", 64)
    rec.count("samples", 64)
    snap = rec.snapshot()
    fetch = snap.stages["fetch"]
    assert fetch.batches == 100
    assert fetch.busy_s == pytest.approx(sum(range(1, 101)) / 1000)
    assert fetch.blocked_s == 0.0
    assert fetch.p50_s == pytest.approx(0.0505)
    assert fetch.p99_s == pytest.approx(0.09901)
    assert fetch.mean_s == pytest.approx(0.0505)
    assert snap.counters == {"ring_fallback": 1, "samples": 128}
    assert snap.input_bound == pytest.approx(0.25)
    assert snap.wall_s > 0


def test_ring_window_keeps_only_recent_batches():
    rec = StatsRecorder(window=10)
    for _ in range(50):
        rec.add("fetch", busy_s=1.0)
    for _ in range(10):
        rec.add("fetch", busy_s=0.001)
    s = rec.snapshot().stages["fetch"]
    assert s.batches == 60
    assert s.busy_s == pytest.approx(50.01)
    assert s.p99_s == pytest.approx(0.001)  # the slow batches fell out of the window


def test_occupancy_mean_max_capacity():
    rec = StatsRecorder()
    for used in (1, 3, 2):
        rec.occupancy("ring", used, 4)
    s = rec.snapshot().stages["ring"]
    assert (s.occupancy_mean, s.occupancy_max, s.capacity, s.batches) == (2.0, 3, 4, 0)


def test_handout_records_what_add_count_occupancy_and_gauge_record():
    """``handout`` is one lock round trip for what a batch handed out records, and records
    exactly what the separate calls would."""
    one, many = StatsRecorder(window=3), StatsRecorder(window=3)
    for k, (step, wait) in enumerate([(None, 0.5), (0.25, 0.125), (0.75, 0.0625),
                                      (0.5, 0.25), (1.0, 0.375)]):
        occupancy = [("ring", k % 3, 4), ("prefetch", 5 - k, 6)]
        gauges = [("ring_slots", k), ("ring_bytes", 4096 * k)]
        one.handout(step, wait, 8 if k else None, occupancy, gauges)
        if step is None:
            many.add("startup", blocked_s=wait)
        else:
            many.add("step", busy_s=step)
            many.add("wait", blocked_s=wait)
        many.count("batches")
        if k:
            many.count("samples", 8)
        for o in occupancy:
            many.occupancy(*o)
        for g in gauges:
            many.gauge(*g)
    a, b = one.snapshot().to_dict(), many.snapshot().to_dict()
    del a["wall_s"], b["wall_s"]
    assert a == b
    assert a["stages"]["wait"]["batches"] == 4 and a["counters"]["ring_slots"] == 4


def test_snapshot_is_frozen_picklable_and_renders():
    rec = StatsRecorder()
    rec.add("wait", blocked_s=0.1)
    rec.add("step", busy_s=0.3)
    rec.occupancy("ring", 2, 8)
    rec.count("batches")
    snap = rec.snapshot()
    with pytest.raises(AttributeError):
        snap.wall_s = 1.0  # type: ignore[misc]
    again = pickle.loads(pickle.dumps(snap))
    assert again == snap
    text = str(snap)
    assert "input-bound: 25%" in text and "wait" in text and "2.0/8" in text
    d = snap.to_dict()
    assert d["stages"]["step"]["busy_s"] == pytest.approx(0.3)
    assert d["counters"] == {"batches": 1}


def test_input_bound_none():
    rec = StatsRecorder()
    rec.add("fetch", busy_s=1.0)
    assert rec.snapshot().input_bound is None
    assert LoaderStats(wall_s=0.0).input_bound is None
    assert StageStats("x", 0, 0.0, 0.0, 0.0, 0.0, 0.0).mean_s == 0.0


def test_bad_window_names_the_value():
    with pytest.raises(ValueError, match=r"window must be a positive int.*0"):
        StatsRecorder(window=0)


def test_threads_do_not_lose_updates():
    rec = StatsRecorder(window=64)

    def work():
        for _ in range(2000):
            rec.add("fetch", busy_s=0.001)
            rec.count("batches")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = rec.snapshot()
    assert snap.stages["fetch"].batches == 8000
    assert snap.counters["batches"] == 8000


def test_add_is_cheap():
    rec = StatsRecorder()
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        rec.add("fetch", 0.001, 0.0)
    per_call = (time.perf_counter() - t0) / n
    assert per_call < 20e-6  # contract: a few microseconds; generous for a loaded 2-core box


def test_format_table_aligns():
    text = format_table(["a", "bb"], [["x", 1], ["yyy", 22]])
    lines = text.splitlines()
    assert lines[0] == "a    bb"
    assert lines[2] == "x     1"
    assert lines[3] == "yyy  22"
